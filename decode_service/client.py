"""Typed async client of the decode worker (``pdserve.v1.DecodeWorker``).

Imports only gRPC and the generated protos (never vLLM): the gateway uses it.
Failed calls raise ``pdserve.rpc.client.RpcCallError``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence

from pdserve.rpc.client import WorkerClient
from protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc


class DecodeClient(WorkerClient):
    """One channel to one decode worker; ``close()`` when done."""

    STUB = worker_pb2_grpc.DecodeWorkerStub

    def decode(
        self,
        request_id: str,
        token_ids: Sequence[int],
        params: common_pb2.SamplingParams,
        kv_transfer_params: worker_pb2.KvTransferParams | None = None,
        timeout: float | None = None,
    ) -> AsyncGenerator[worker_pb2.DecodeChunk, None]:
        """Stream the generated tokens; ``timeout`` bounds the whole stream.

        Without ``kv_transfer_params`` the worker computes the prompt itself. Closing the
        iterator (``aclose``) or cancelling the task that iterates it cancels the RPC.
        """
        request = worker_pb2.DecodeRequest(
            request_id=request_id, prompt_token_ids=list(token_ids), params=params
        )
        if kv_transfer_params is not None:
            request.kv_transfer_params.CopyFrom(kv_transfer_params)
        return self.stream("Decode", self.stub.Decode, request, request_id, timeout)

    async def abort(
        self,
        request_id: str,
        timeout: float | None = None,
        kv_transfer_params: worker_pb2.KvTransferParams | None = None,
    ) -> bool:
        """Stop the request; True when the worker knew it. ``kv_transfer_params``: a hand-off
        no decode engine was given, to release on its prefill worker."""
        request = worker_pb2.AbortRequest(request_id=request_id)
        if kv_transfer_params is not None:
            request.kv_transfer_params.CopyFrom(kv_transfer_params)
        response: worker_pb2.AbortResponse = await self.unary(
            "Abort", self.stub.Abort, request, request_id, timeout
        )
        return response.found
