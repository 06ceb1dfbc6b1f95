"""One Decode call on one decode worker, watched: its chunks, the worker's ejection, silence.

``next`` returns the next chunk (None at the end of the stream) and turns every way the call
can go wrong into a gateway error: the worker refusing the request (``InvalidRequest``), the
call failing (``WorkerFailed``, with the worker's own reason such as "kv_transfer_failed"), the
pool ejecting the worker meanwhile (``WorkerFailed``: a dead or hung worker is noticed by its
health check, and the requests streaming from it move on at once), or no chunk within the
timeout (``WorkerTimedOut``). Unreachable and silent workers are ejected from the pool.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from gateway.errors import InvalidRequest, WorkerFailed, WorkerTimedOut
from gateway.pool import DecodeWorker, WorkerPool, unless_down
from pdserve.rpc.client import RpcCallError
from protos.v1 import worker_pb2


class DecodeStream:
    def __init__(
        self,
        worker: DecodeWorker,
        request_id: str,
        stream: AsyncGenerator[worker_pb2.DecodeChunk, None],
        pool: WorkerPool,
    ) -> None:
        self.worker = worker
        self.request_id = request_id
        self._stream = stream
        self._pool = pool
        self._down: asyncio.Future[object] = asyncio.ensure_future(worker.down.wait())

    async def next(self, timeout_s: float | None) -> worker_pb2.DecodeChunk | None:
        """The next chunk, None when the stream ended; ``timeout_s`` None: no limit."""
        step = asyncio.ensure_future(anext(self._stream))
        if await unless_down(self.worker, step, timeout_s, self._down):
            return self._result(step)
        address = self.worker.address
        if self._down.done():
            raise WorkerFailed(
                f"decode worker {address} was ejected: {self.worker.last_error}", worker=address
            )
        self._pool.mark_failed(self.worker, f"no token for {timeout_s:.0f} s")
        raise WorkerTimedOut(
            f"decode worker {address} sent no token for {timeout_s:.0f} s", worker=address
        )

    def _result(
        self, step: asyncio.Future[worker_pb2.DecodeChunk]
    ) -> worker_pb2.DecodeChunk | None:
        try:
            return step.result()
        except StopAsyncIteration:
            return None
        except RpcCallError as err:
            if err.caller_error:
                raise InvalidRequest(
                    f"the decode worker rejected the request: {err.details}"
                ) from err
            if err.code == "UNAVAILABLE" and not err.reason:
                self._pool.mark_failed(self.worker, str(err))
            kind = WorkerTimedOut if err.code == "DEADLINE_EXCEEDED" else WorkerFailed
            raise kind(
                f"decode worker {self.worker.address} failed: {err.code}: {err.details}",
                worker=self.worker.address,
                reason=err.reason,
            ) from err

    async def close(self) -> None:
        """Cancel the call if it is still open (never suspends for long)."""
        self._down.cancel()
        await self._stream.aclose()
