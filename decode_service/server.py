"""gRPC adapter of the decode worker: translation only."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from decode_service.service import DecodeEvent, DecodeService
from pdserve.worker import handoff
from pdserve.worker.errors import WorkerError
from pdserve.worker.server import DECODE_SERVICE, ServicerBase, fail, rpc_span
from protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc

SERVICE_NAME = DECODE_SERVICE


def to_chunk(event: DecodeEvent) -> worker_pb2.DecodeChunk:
    chunk = worker_pb2.DecodeChunk(token_ids=event.token_ids, text=event.text)
    for token, logprob, rank, top in event.logprobs:
        chunk.logprobs.add(
            token_id=token,
            logprob=logprob,
            rank=rank,
            top=[common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in top],
        )
    for token, logprob, rank, top in event.prompt_logprobs:
        chunk.prompt_logprobs.add(
            token_id=token,
            logprob=logprob,
            rank=rank,
            top=[common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in top],
        )
    if event.finish_reason:
        chunk.finish_reason = event.finish_reason
        chunk.stop_reason = event.stop_reason
        if event.stop_token_id is not None:
            chunk.stop_token_id = event.stop_token_id
        chunk.usage.CopyFrom(
            common_pb2.Usage(
                prompt_tokens=event.prompt_tokens,
                completion_tokens=event.completion_tokens,
                cached_tokens=event.cached_tokens,
            )
        )
        t = event.transfer
        chunk.transfer.CopyFrom(
            common_pb2.TransferStats(
                prompt_tokens_computed=int(t.get("prompt_computed", 0)),
                local_cached_tokens=int(t.get("local_cached_tokens", 0)),
                kv_tokens_received=int(t.get("received_tokens", 0)),
                kv_blocks_received=int(t.get("received_blocks", 0)),
                kv_bytes_received=int(t.get("received_bytes", 0)),
                kv_transfer_seconds=float(t.get("transfer_seconds", 0.0)),
                kv_transfer_started_unix=float(t.get("transfer_started_unix", 0.0)),
            )
        )
        engine = event.phases.message()
        if engine is not None:
            chunk.engine.CopyFrom(engine)
    return chunk


class DecodeServicer(ServicerBase, worker_pb2_grpc.DecodeWorkerServicer):
    role = worker_pb2.ROLE_DECODE

    async def Decode(  # type: ignore[override]
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.DecodeChunk]:
        with rpc_span(context, f"{SERVICE_NAME}/Decode", request.request_id) as span:
            service: DecodeService = await self.ready(context)
            params = (
                handoff.to_params(request.kv_transfer_params)
                if request.HasField("kv_transfer_params")
                else None
            )
            span.set_attribute("pdserve.kv_handoff", params is not None)
            try:
                async for event in service.decode(
                    request.request_id, list(request.prompt_token_ids), request.params, params
                ):
                    yield to_chunk(event)
            except WorkerError as exc:
                await fail(context, exc)


def register(servicer: DecodeServicer) -> Any:
    return lambda server: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
