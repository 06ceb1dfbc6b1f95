"""One request's life after routing: prefill, KV hand-off, decode stream, clean-up.

``Generation.open`` runs the prefill (or falls back to the local path by the named policy) and
waits for the decode worker's first chunk, so that every failure before the first token can
still become a proper status code. ``events`` then yields ``TokenDelta``s and one final
``Finish``. Whatever ends a generation early (client gone, worker failure, consumer stopping)
sends ``Abort`` to every worker the request touched, from a background task: the caller may
itself be under cancellation and must not await the network.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.config import GatewaySettings
from gateway.errors import (
    GatewayError,
    InvalidRequest,
    NoWorkerAvailable,
    Overloaded,
    WorkerFailed,
)
from gateway.metrics import GatewayMetrics
from gateway.pool import DecodeWorker, PrefillWorker, WorkerPool
from gateway.routing import Route
from pdserve import tracing
from pdserve.grpc_client import RpcCallError
from protos.v1 import common_pb2, worker_pb2

log = logging.getLogger(__name__)

PATH_DISAGGREGATED = "disaggregated"
PATH_LOCAL = "local"
LOCAL_PREFILL = "local"
KV_TRANSFER_FAILED = "kv_transfer_failed"  # a worker's x-pdserve-error reason


@dataclass(frozen=True)
class TokenDelta:
    """Newly generated tokens and their text (text may be empty while a character is partial);
    ``logprobs`` one per token when the request asked for them."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[common_pb2.TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Finish:
    """The last event of a generation."""

    finish_reason: str  # "stop", "length" or "abort"
    stop_reason: str  # the stop string or token that ended generation, if any
    usage: Usage
    path: str  # PATH_DISAGGREGATED or PATH_LOCAL
    prefill_worker: str  # address, or "local"
    decode_worker: str
    transfer: common_pb2.TransferStats


Event = TokenDelta | Finish
AnyWorker = PrefillWorker | DecodeWorker
AbortFn = Callable[[Sequence[AnyWorker], str], None]


def outcome_for(err: GatewayError) -> str:
    """The metrics ``outcome`` label of a failed request."""
    if isinstance(err, WorkerFailed):
        return "error"
    if isinstance(err, NoWorkerAvailable):
        return "unavailable"
    if isinstance(err, Overloaded):
        return "overloaded"
    return "invalid"


class Generation:
    def __init__(
        self,
        *,
        request_id: str,
        endpoint: str,
        token_ids: Sequence[int],
        params: common_pb2.SamplingParams,
        route: Route,
        received_at: float,
        settings: GatewaySettings,
        pool: WorkerPool,
        metrics: GatewayMetrics,
        abort: AbortFn,
        on_end: Callable[[], None] | None = None,
        deadline_s: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.endpoint = endpoint
        self.token_ids = list(token_ids)
        self.params = params
        self.decode = route.decode
        self.prefill = route.prefill
        self.path = PATH_DISAGGREGATED if route.prefill else PATH_LOCAL
        self._received_at = received_at
        self._settings = settings
        self._pool = pool
        self._metrics = metrics
        self._abort = abort
        self._on_end = on_end
        self._timeout_s = settings.request_timeout_s
        if deadline_s is not None:
            self._timeout_s = max(0.001, min(self._timeout_s, deadline_s))
        # Prompt logprobs (entry i: prompt token i+1), when params.prompt_logprobs is set.
        self.prompt_logprobs: list[common_pb2.TokenLogprob] = []
        self._touched: list[AnyWorker] = []
        self._stream: AsyncGenerator[worker_pb2.DecodeChunk, None] | None = None
        self._first: worker_pb2.DecodeChunk | None = None
        self._last_token_at: float | None = None
        self._completion_tokens = 0
        self._done = False
        self._predicted = route.predicted_cached_tokens
        self._decode_span: Any = tracing.NO_SPAN  # from the Decode call to the stream's end
        self._prefill_engine: common_pb2.EngineTimes | None = None
        self._held: list[AnyWorker] = [w for w in (route.prefill, route.decode) if w is not None]
        for worker in self._held:
            worker.in_flight += 1

    def _release_workers(self) -> None:
        for worker in self._held:
            worker.in_flight -= 1
        self._held = []
        if self._on_end is not None:
            on_end, self._on_end = self._on_end, None
            on_end()

    def routing_headers(self) -> dict[str, str]:
        """Where the request went (empty when the deployment hides its topology)."""
        if not self._settings.routing_headers:
            return {}
        return {
            "x-pdserve-prefill-worker": self.prefill.worker_id if self.prefill else LOCAL_PREFILL,
            "x-pdserve-decode-worker": self.decode.worker_id,
        }

    async def open(self) -> None:
        """Prefill, start the decode stream and wait for its first chunk."""
        handoff = await self._prefill()
        try:
            await self._start_decode(handoff)
        except WorkerFailed as err:
            local_ok = self._settings.prefill_failure_policy == "local"
            if handoff is None or err.reason != KV_TRANSFER_FAILED or not local_ok:
                raise
            log.warning(
                "request %s: %s; the decode worker computes the prompt (policy 'local')",
                self.request_id,
                err.message,
            )
            self._fall_back(KV_TRANSFER_FAILED)
            await self._start_decode(None)

    async def _start_decode(self, handoff: worker_pb2.KvTransferParams | None) -> None:
        if self.decode not in self._touched:
            self._touched.append(self.decode)
        self._stream = self.decode.client.decode(
            self.request_id,
            self.token_ids,
            self.params,
            handoff,
            timeout=self._timeout_s,
        )
        attributes = {"pdserve.worker": self.decode.worker_id, "pdserve.kv_handoff": bool(handoff)}
        self._decode_span = tracing.start_span("decode", attributes, kind="client")
        with tracing.use(self._decode_span):  # the call's metadata carries this span
            self._first = await self._next_chunk()
        if self._first is not None:
            self.prompt_logprobs = list(self._first.prompt_logprobs)

    async def _prefill(self) -> worker_pb2.KvTransferParams | None:
        worker = self.prefill
        if worker is None:
            return None
        self._touched.append(worker)
        started = time.monotonic()
        # The deadline follows the worker's queue and the prompt: a prefill that is merely
        # queued never times out into a second computation of the same prompt.
        tokens = len(self.token_ids) - (self._predicted or 0)
        s = self._settings
        deadline = worker.pace.deadline_s(tokens, s.prefill_timeout_s, s.prefill_deadline_slack)
        self._metrics.prefill_deadline_seconds.observe(deadline)
        ahead = worker.pace.sent(tokens)
        ok = False
        try:
            attributes = {"pdserve.worker": worker.worker_id, "pdserve.prompt_tokens": tokens}
            with tracing.span("prefill", attributes, kind="client") as span:
                response = await worker.client.prefill(
                    self.request_id,
                    self.token_ids,
                    self.params,
                    timeout=min(deadline, self._timeout_s),
                )
                span.set_attribute("pdserve.cached_tokens", response.cached_tokens)
            ok = True
        except RpcCallError as err:
            self._prefill_failed(worker, err)
            return None
        finally:
            worker.pace.answered(tokens, ahead, time.monotonic() - started, ok)
        self._metrics.prefill_seconds.observe(time.monotonic() - started)
        self._prefill_engine = response.engine if response.HasField("engine") else None
        if self._predicted is not None:  # the prefill worker's cache vs the router's guess
            self._metrics.prediction(self._predicted, response.cached_tokens)
            self._predicted = None
        if not response.HasField("kv_transfer_params"):
            log.warning(
                "request %s: prefill worker %s returned no kv_transfer_params; the "
                "decode worker computes the prompt",
                self.request_id,
                worker.address,
            )
            self._fall_back("no_handoff")
            return None
        return response.kv_transfer_params

    def _prefill_failed(self, worker: PrefillWorker, err: RpcCallError) -> None:
        """Named policy ``prefill_failure_policy``: "local" falls back, "fail" raises."""
        if err.caller_error:
            raise InvalidRequest(f"the prefill worker rejected the request: {err.details}") from err
        if err.code == "UNAVAILABLE" and not err.reason:
            self._pool.mark_failed(worker, str(err))
        if self._settings.prefill_failure_policy == "fail":
            raise WorkerFailed(
                f"prefill worker {worker.address} failed: {err.code}", worker=worker.address
            ) from err
        log.warning(
            "request %s: %s; the decode worker computes the prompt (policy 'local')",
            self.request_id,
            err,
        )
        self._fall_back("prefill_failed")

    def _fall_back(self, reason: str) -> None:
        """Continue on the local path; the prefill worker is told to free what it holds."""
        if self.prefill is not None and self.prefill in self._touched:
            self._abort([self.prefill], self.request_id)
            self._touched.remove(self.prefill)
        self.prefill = None
        self.path = PATH_LOCAL
        self._predicted = None  # the prediction was for the prefill worker's cache
        self._metrics.fallbacks.labels(reason).inc()

    async def _next_chunk(self) -> worker_pb2.DecodeChunk | None:
        assert self._stream is not None
        try:
            return await anext(self._stream)
        except StopAsyncIteration:
            return None
        except RpcCallError as err:
            if err.code == "UNAVAILABLE" and not err.reason:
                self._pool.mark_failed(self.decode, str(err))
            if err.caller_error:
                raise InvalidRequest(
                    f"the decode worker rejected the request: {err.details}"
                ) from err
            raise WorkerFailed(
                f"decode worker {self.decode.address} failed: {err.code}: {err.details}",
                worker=self.decode.address,
                reason=err.reason,
            ) from err

    async def events(self) -> AsyncIterator[Event]:
        """Token deltas, then one ``Finish``; raises ``GatewayError`` on a worker failure."""
        try:
            chunk = self._first
            while chunk is not None:
                delta = self._on_tokens(chunk)
                if delta is not None:
                    yield delta
                if chunk.finish_reason:
                    finish = await self._finish(chunk)
                    yield finish
                    return
                chunk = await self._next_chunk()
            raise WorkerFailed(
                f"decode worker {self.decode.address} ended the stream without a finish reason",
                worker=self.decode.address,
            )
        except GatewayError as err:
            self.abandon(outcome_for(err))
            raise
        finally:
            # Client gone (CancelledError) or consumer stopped early (GeneratorExit).
            self.abandon("cancelled")
            if self._stream is not None:
                await self._stream.aclose()  # cancels the RPC if still open; never suspends

    def _on_tokens(self, chunk: worker_pb2.DecodeChunk) -> TokenDelta | None:
        count = len(chunk.token_ids)
        if not count and not chunk.text:
            return None
        if count:
            now = time.monotonic()
            if self._last_token_at is None:
                self._metrics.ttft.labels(self.path).observe(now - self._received_at)
                self._decode_span.add_event("first_token")
            else:
                per_token = (now - self._last_token_at) / count
                for _ in range(count):
                    self._metrics.itl.labels(self.path).observe(per_token)
            self._last_token_at = now
            self._completion_tokens += count
        return TokenDelta(tuple(chunk.token_ids), chunk.text, tuple(chunk.logprobs))

    async def _finish(self, chunk: worker_pb2.DecodeChunk) -> Finish:
        if chunk.finish_reason == "error":
            raise WorkerFailed(
                f"decode worker {self.decode.address} reported an error", worker=self.decode.address
            )
        trailing = await self._next_chunk()  # read the status so the RPC ends cleanly
        if trailing is not None:
            log.warning("request %s: decode worker sent chunks after the finish", self.request_id)
        usage = chunk.usage
        transfer = common_pb2.TransferStats()
        transfer.CopyFrom(chunk.transfer)
        self._metrics.kv_bytes.inc(transfer.kv_bytes_received)
        if transfer.kv_blocks_received:
            self._metrics.kv_seconds.observe(transfer.kv_transfer_seconds)
        engine = chunk.engine if chunk.HasField("engine") else None
        self._metrics.phases(self._prefill_engine if self.prefill else None, engine, transfer)
        tracing.finish(
            self._decode_span,
            {
                "pdserve.finish_reason": chunk.finish_reason,
                "pdserve.completion_tokens": usage.completion_tokens,
                "pdserve.kv.bytes": transfer.kv_bytes_received,
                "pdserve.kv.blocks": transfer.kv_blocks_received,
            },
        )
        self._done = True
        self._release_workers()
        self._metrics.requests.labels(self.endpoint, self.path, "ok").inc()
        if self._predicted is not None:  # local path: the decode worker's cache
            self._metrics.prediction(self._predicted, usage.cached_tokens)
        return Finish(
            finish_reason=chunk.finish_reason,
            stop_reason=chunk.stop_reason,
            usage=Usage(
                prompt_tokens=usage.prompt_tokens or len(self.token_ids),
                completion_tokens=usage.completion_tokens or self._completion_tokens,
                cached_tokens=usage.cached_tokens,
            ),
            path=self.path,
            prefill_worker=self.prefill.address if self.prefill else LOCAL_PREFILL,
            decode_worker=self.decode.address,
            transfer=transfer,
        )

    def abandon(self, outcome: str) -> None:
        """End early: count the outcome once and abort the touched workers (in background)."""
        if self._done:
            return
        self._done = True
        self._release_workers()
        self._metrics.requests.labels(self.endpoint, self.path, outcome).inc()
        error = None if outcome == "cancelled" else outcome
        tracing.finish(self._decode_span, {"pdserve.outcome": outcome}, error)
        if self._touched:
            self._abort(list(self._touched), self.request_id)

    async def aclose(self) -> None:
        """For callers that stop before or without iterating ``events``."""
        self.abandon("cancelled")
        if self._stream is not None:
            await self._stream.aclose()
