"""gRPC adapter of the prefill worker: translation only."""

from __future__ import annotations

from typing import Any

import grpc

from pdserve.worker import handoff
from pdserve.worker.errors import WorkerError
from pdserve.worker.sampling import cache_salt
from pdserve.worker.server import PREFILL_SERVICE, ServicerBase, fail, rpc_span
from prefill_service.service import PrefillService
from protos.v1 import worker_pb2, worker_pb2_grpc

SERVICE_NAME = PREFILL_SERVICE


class PrefillServicer(ServicerBase, worker_pb2_grpc.PrefillWorkerServicer):
    role = worker_pb2.ROLE_PREFILL

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        with rpc_span(context, f"{SERVICE_NAME}/Prefill", request.request_id) as span:
            service: PrefillService = await self.ready(context)
            try:
                result = await service.prefill(
                    request.request_id,
                    list(request.prompt_token_ids),
                    cache_salt(request.params),
                    request.params.lora_name,
                )
            except WorkerError as exc:
                await fail(context, exc)
            span.set_attributes(
                {
                    "pdserve.prompt_tokens": result.prompt_tokens,
                    "pdserve.cached_tokens": result.cached_tokens,
                }
            )
        return worker_pb2.PrefillResponse(
            request_id=request.request_id,
            kv_transfer_params=handoff.to_message(result.kv_transfer_params),
            first_token_id=result.first_token_id,
            prompt_tokens=result.prompt_tokens,
            cached_tokens=result.cached_tokens,
            engine=result.phases.message(),
        )


def register(servicer: PrefillServicer) -> Any:
    return lambda server: worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server)
