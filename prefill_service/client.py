"""Typed async client of the prefill worker (``pdserve.v1.PrefillWorker``).

Imports only gRPC and the generated protos (never vLLM): the gateway uses it.
Failed calls raise ``pdserve.rpc.client.RpcCallError``.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.rpc.client import WorkerClient
from protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc


class PrefillClient(WorkerClient):
    """One channel to one prefill worker; ``close()`` when done."""

    STUB = worker_pb2_grpc.PrefillWorkerStub

    async def prefill(
        self,
        request_id: str,
        token_ids: Sequence[int],
        params: common_pb2.SamplingParams,
        timeout: float | None = None,
    ) -> worker_pb2.PrefillResponse:
        """Compute the prompt; the answer says where its KV blocks wait (pinned under a lease)."""
        request = worker_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=list(token_ids), params=params
        )
        return await self.unary("Prefill", self.stub.Prefill, request, request_id, timeout)

    async def abort(self, request_id: str, timeout: float | None = None) -> bool:
        """Stop the request and free its pinned blocks; True when the worker knew it."""
        request = worker_pb2.AbortRequest(request_id=request_id)
        response: worker_pb2.AbortResponse = await self.unary(
            "Abort", self.stub.Abort, request, request_id, timeout
        )
        return response.found
