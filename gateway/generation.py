"""One request's life after routing: prefill, KV hand-off, decode stream, recovery, clean-up.

``Generation.open`` runs the prefill and waits for the decode worker's first chunk, so that
every failure before the first token can still become a proper status code. ``events`` then
yields ``TokenDelta``s and one final ``Finish``. Phase changes and recoveries are decided by the
transition functions of ``gateway.recovery``. Whatever ends a generation early (client
gone, worker failure, consumer stopping) sends ``Abort`` to every worker the request touched,
from a background task: the caller may itself be under cancellation and must not await the
network. The prompt's KV blocks on the prefill worker are released with it: under our
connector by the prefill worker's ``Abort``; under vLLM's NixlConnector, whose prefill engine
cannot release a finished prompt, by the decode worker's: its ``Abort`` brings the hand-off the
call was given (or the one no decode call was given yet), and the decode worker releases it
through its engine unless its engine has the request (then vLLM does). A NIXL hand-off is
given to one decode worker only (``gateway.pairing.single_use_handoffs``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from gateway import recovery, request_log
from gateway.config import GatewaySettings
from gateway.decode_stream import DecodeStream
from gateway.errors import GatewayError, InvalidRequest, WorkerFailed, WorkerTimedOut
from gateway.events import (
    PATH_DISAGGREGATED,
    PATH_LOCAL,
    PATH_SIBLING,
    Event,
    Finish,
    TokenDelta,
    Usage,
    outcome_for,
)
from gateway.metrics import GatewayMetrics
from gateway.pairing import single_use_handoffs
from gateway.pool import DecodeWorker, PrefillWorker, WorkerPool, unless_down
from gateway.recovery import Action, Phase, Transition, alternative, backoff_s, continuation
from gateway.routing.interfaces import Route
from gateway.slo import Slo, time_per_output_token
from pdserve.rpc.client import RpcCallError
from pdserve.telemetry import tracing
from protos.v1 import common_pb2, worker_pb2

log = logging.getLogger(__name__)

LOCAL_PREFILL = "local"
KV_TRANSFER_FAILED = "kv_transfer_failed"  # a worker's x-pdserve-error reason


AnyWorker = PrefillWorker | DecodeWorker
# abort(workers, internal request id, hand-off to release on a decode worker or None)
AbortFn = Callable[[Sequence[AnyWorker], str, worker_pb2.KvTransferParams | None], None]


class Generation:
    def __init__(
        self,
        *,
        request_id: str,
        model: str,
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
        edge_id: str = "",
        sibling: bool = False,
        slo: Slo | None = None,
    ) -> None:
        """``sibling``: a further choice of an ``n > 1`` request, computed by its first
        choice's decode worker from that engine's prefix cache (path "sibling")."""
        self.request_id = request_id  # the first attempt's id; retries get fresh ones
        self.edge_id = edge_id or request_id  # the client's id (logged, never sent to workers)
        self.trace_id = tracing.current_trace_id()  # the request's trace (for the request log)
        self.model = model  # the served base model's name, a label of its metrics
        self.endpoint = endpoint
        self.token_ids = list(token_ids)
        self.params = params
        self.decode = route.decode
        self.prefill = route.prefill
        # A LoRA adapter's request moves only to workers serving it at the same path.
        name = params.lora_name
        path = route.decode.adapter_path(name) if name else None
        self._adapter = None if path is None else (name, path)
        self.path = PATH_DISAGGREGATED if route.prefill else PATH_LOCAL
        if sibling:
            self.path = PATH_SIBLING
        self.phase = Phase.ADMITTED
        self._received_at = received_at
        self._slo = slo or Slo()
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
        # (worker, internal id) of every call not yet known to be over: aborted at the end.
        self._calls: list[tuple[AnyWorker, str]] = []
        self._stream: DecodeStream | None = None
        # The hand-off of the last prefill until a decode worker is given it (who releases it).
        self._staged: worker_pb2.KvTransferParams | None = None
        # Single-use hand-offs by the decode call (worker, internal id) that was given them.
        self._given: dict[tuple[AnyWorker, str], worker_pb2.KvTransferParams] = {}
        self._first: worker_pb2.DecodeChunk | None = None
        self._last_token_at: float | None = None
        self._generated: list[int] = []
        self._migrations = 0
        self.retries = 0  # prefill and decode retries (migrations are counted apart)
        self.first_token_at: float | None = None
        self._done = False
        self._predicted = route.predicted_cached_tokens
        self._feedback = route.feedback  # told how computing the routed prompt went
        self._split = route.split  # where the prompt is computed, and why (for the log)
        self._decode_span: Any = tracing.NO_SPAN  # from a Decode call to its stream's end
        self._prefill_engine: common_pb2.EngineTimes | None = None
        self._prefill_call_s = 0.0  # the answered prefill call's duration
        self._held: list[AnyWorker] = []
        for worker in (route.prefill, route.decode):
            if worker is not None:
                self._hold(worker)

    def _healthy_prefill(self) -> list[PrefillWorker]:
        """Healthy prefill workers that can compute this request (its adapter's, if any)."""
        return self._pool.serving(self._pool.healthy_prefill(), self._adapter)

    def _healthy_decode(self) -> list[DecodeWorker]:
        return self._pool.serving(self._pool.healthy_decode(), self._adapter)

    def _hold(self, worker: AnyWorker) -> None:
        worker.in_flight += 1
        self._held.append(worker)

    def _unhold(self, worker: AnyWorker) -> None:
        if worker in self._held:
            worker.in_flight -= 1
            self._held.remove(worker)

    def _release_workers(self) -> None:
        for worker in list(self._held):
            self._unhold(worker)
        if self._on_end is not None:
            on_end, self._on_end = self._on_end, None
            on_end()

    @property
    def received_at(self) -> float:
        return self._received_at

    @property
    def completion_tokens(self) -> int:
        return len(self._generated)

    @property
    def migrations(self) -> int:
        return self._migrations

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
        await self._run(self.token_ids, self.params, self.request_id)
        if self._first is not None:
            self.prompt_logprobs = list(self._first.prompt_logprobs)

    async def _run(self, prompt: list[int], params: common_pb2.SamplingParams, rid: str) -> None:
        """One pass through the states: prefill (with retries) and the first decode chunk."""
        handoff = await self._prefill(prompt, params, rid)
        await self._open_decode(prompt, params, handoff, rid)

    def _call(self, worker: AnyWorker, rid: str) -> None:
        self._calls.append((worker, rid))

    def _cancel_call(self, worker: AnyWorker, rid: str) -> None:
        """Abort one failed call now (its worker may still hold the request's state)."""
        if (worker, rid) in self._calls:
            self._calls.remove((worker, rid))
            self._abort([worker], rid, self._given.pop((worker, rid), None))

    def _single_use(self) -> bool:
        """The current prefill worker's hand-offs are read once, released by decode workers."""
        return self.prefill is not None and single_use_handoffs(self.prefill.capabilities)

    def _release_staged(self) -> None:
        """Release the hand-off no decode worker was given, where only one can (NIXL)."""
        staged, self._staged = self._staged, None
        if staged is not None and self._single_use():
            self._abort([self.decode], new_attempt_id(), staged)

    async def _prefill(
        self, prompt: list[int], params: common_pb2.SamplingParams, rid: str
    ) -> worker_pb2.KvTransferParams | None:
        """The hand-off of ``prompt``: tried on up to ``prefill_retries`` other prefill workers,
        then ``prefill_failure_policy`` (None: the decode worker computes the prompt)."""
        if self.prefill is not None:
            self.phase = recovery.advance(self.phase, Phase.PREFILLING)
        tried: list[PrefillWorker] = []
        while self.prefill is not None:
            worker = self.prefill
            self._call(worker, rid)
            try:
                response = await self._prefill_call(worker, prompt, params, rid)
            except RpcCallError as err:
                if err.caller_error and recovery.on_invalid(self.phase).aborts:
                    raise InvalidRequest(
                        f"the prefill worker rejected the request: {err.details}"
                    ) from err
                self._cancel_call(worker, rid)
                if err.unreachable and not err.reason:
                    self._pool.mark_failed(worker, str(err))
                tried.append(worker)
                await self._next_prefill(tried, err)
                rid = new_attempt_id()
                continue
            if not response.HasField("kv_transfer_params"):
                log.warning(
                    "request %s: prefill worker %s returned no kv_transfer_params; the "
                    "decode worker computes the prompt", rid, worker.address,
                )  # fmt: skip
                self._fall_back(recovery.on_no_handoff(self.phase), "no_handoff")
                return None
            self._pool.mark_ok(worker)
            self.phase = recovery.advance(self.phase, Phase.KV_STAGED)
            self._staged = response.kv_transfer_params
            return response.kv_transfer_params
        return None

    async def _next_prefill(self, tried: list[PrefillWorker], err: RpcCallError) -> None:
        """Move to another prefill worker after a backoff, or apply the failure policy."""
        left = self._settings.prefill_retries - len(tried) + 1
        nxt = None
        if left > 0:
            nxt = alternative(
                self._healthy_prefill(), tried, lambda w: w.load(),
                lambda w: self._pool.compatible(w, self.decode),
            )  # fmt: skip
        step = recovery.on_prefill_failed(self.phase, retries_left=left, another=nxt is not None,
                                          policy=self._settings.prefill_failure_policy)  # fmt: skip
        failed = tried[-1]
        if step.aborts:  # policy "fail"
            kind = WorkerTimedOut if err.code == "DEADLINE_EXCEEDED" else WorkerFailed
            raise kind(
                f"prefill worker {failed.address} failed: {err.code}", worker=failed.address
            ) from err
        if step.action is Action.LOCAL:  # policy "local"
            self._fall_back(step, "prefill_failed", err)
            return
        assert nxt is not None
        self.phase = step.phase
        log.warning("request %s: %s; retrying on prefill worker %s", self.request_id, err,
                    nxt.address)  # fmt: skip
        self._metrics.retries.labels("prefill").inc()
        self.retries += 1
        await asyncio.sleep(backoff_s(self._settings.retry_backoff_s, len(tried)))
        self._unhold(failed)
        self._hold(nxt)
        self.prefill = nxt

    async def _prefill_call(
        self,
        worker: PrefillWorker,
        prompt: list[int],
        params: common_pb2.SamplingParams,
        rid: str,
    ) -> worker_pb2.PrefillResponse:
        started = time.monotonic()
        # The deadline follows the worker's queue and the prompt: a prefill that is merely
        # queued never times out into a second computation of the same prompt.
        tokens = len(prompt) - (self._predicted or 0)
        s = self._settings
        deadline = worker.pace.deadline_s(tokens, s.prefill_timeout_s, s.prefill_deadline_slack)
        self._metrics.prefill_deadline_seconds.observe(deadline)
        ahead = worker.pace.sent(tokens)
        ok = False
        try:
            attributes = {"pdserve.worker": worker.worker_id, "pdserve.prompt_tokens": tokens}
            with tracing.span("prefill", attributes, kind="client") as span:
                call = asyncio.ensure_future(  # the call's metadata carries the span
                    worker.client.prefill(
                        rid, prompt, params, timeout=min(deadline, self._timeout_s)
                    )
                )
                if not await unless_down(worker, call):  # ejected meanwhile: dead or hung
                    why = f"ejected: {worker.last_error}"
                    raise RpcCallError(worker.address, "Prefill", "UNAVAILABLE", why, "ejected")
                response = call.result()
                span.set_attribute("pdserve.cached_tokens", response.cached_tokens)
            ok = True
        finally:
            elapsed = time.monotonic() - started
            worker.pace.answered(tokens, ahead, elapsed, ok)
        self._prefill_call_s = elapsed
        self._metrics.prefill_seconds.observe(elapsed)
        self._prefill_engine = response.engine if response.HasField("engine") else None
        if self._predicted is not None:  # the prefill worker's cache vs the router's guess
            self._metrics.prediction(self._predicted, response.cached_tokens)
            self._predicted = None
        self._computed(worker, response.cached_tokens)
        return response

    def _computed(self, worker: AnyWorker, cached_tokens: int) -> None:
        """``worker`` computed the routed prompt: the picker learns from it (its KV tier)."""
        if self._feedback is not None:
            self._feedback.computed(worker, cached_tokens)

    def _fall_back(self, step: Transition, reason: str, err: Any = None, spent: str = "") -> None:
        """LOCAL: continue on the local path; the prefill worker is told to free what it holds."""
        if err is not None:
            log.warning("request %s: %s; %sthe decode worker computes the prompt (policy 'local')",
                        self.request_id, err, spent)  # fmt: skip
        self.phase = step.phase
        if self.prefill is not None:
            for worker, rid in [c for c in self._calls if c[0] is self.prefill]:
                self._cancel_call(worker, rid)
            self._unhold(self.prefill)
        self.prefill = None
        self.path = PATH_LOCAL
        self._predicted = None  # the prediction was for the prefill worker's cache
        self._metrics.fallbacks.labels(reason).inc()

    async def _open_decode(
        self,
        prompt: list[int],
        params: common_pb2.SamplingParams,
        handoff: worker_pb2.KvTransferParams | None,
        rid: str,
    ) -> None:
        """Start the decode stream and read its first chunk: on another decode worker (same
        hand-off) after a failure, up to ``decode_retries`` times; a hand-off that can no
        longer be pulled falls back to the local path (policy "local")."""
        tried: list[DecodeWorker] = []
        while True:
            try:
                await self._start_decode(prompt, params, handoff, rid)
                return
            except WorkerFailed as err:
                self._cancel_call(self.decode, rid)
                rid = new_attempt_id()
                if handoff is not None and err.reason == KV_TRANSFER_FAILED:
                    self._handoff_gone(err, KV_TRANSFER_FAILED)
                    handoff = None
                    continue
                tried.append(self.decode)
                self._next_decode(tried, err)
                if handoff is not None and self._single_use():
                    # The failed decode worker may have read it: its blocks may be gone.
                    self._handoff_gone(err, "handoff_spent", "the hand-off is spent, ")
                    handoff = None
                await asyncio.sleep(backoff_s(self._settings.retry_backoff_s, len(tried)))

    def _handoff_gone(self, err: WorkerFailed, reason: str, spent: str = "") -> None:
        """The hand-off can no longer be pulled: the local path (policy "local"), or ``err``."""
        step = recovery.on_pull_failed(self.phase, policy=self._settings.prefill_failure_policy)
        if step.aborts:
            raise err
        self._fall_back(step, reason, err.message, spent)

    def _next_decode(self, tried: list[DecodeWorker], err: WorkerFailed) -> None:
        left = self._settings.decode_retries - len(tried) + 1
        nxt = None
        if left > 0:
            nxt = alternative(
                self._healthy_decode(), tried, lambda w: w.load(),
                lambda w: self.prefill is None or self._pool.compatible(self.prefill, w),
            )  # fmt: skip
        step = recovery.on_decode_failed_before_first_token(self.phase, retries_left=left,
                                                            another=nxt is not None)  # fmt: skip
        if step.aborts or nxt is None:
            raise err
        self.phase = step.phase
        log.warning("request %s: %s; retrying on decode worker %s", self.request_id,
                    err.message, nxt.address)  # fmt: skip
        self._metrics.retries.labels("decode").inc()
        self.retries += 1
        self._unhold(self.decode)
        self._hold(nxt)
        self.decode = nxt

    async def _start_decode(
        self,
        prompt: list[int],
        params: common_pb2.SamplingParams,
        handoff: worker_pb2.KvTransferParams | None,
        rid: str,
    ) -> None:
        self._call(self.decode, rid)
        if handoff is not None:
            self._staged = None  # the decode worker owns its release from now on
            if self._single_use():
                self._given[(self.decode, rid)] = handoff
        call = self.decode.client.decode(rid, prompt, params, handoff, timeout=self._timeout_s)
        self._stream = DecodeStream(self.decode, rid, call, self._pool)
        started = time.monotonic()
        # The decode worker computes the prompt itself: its rate (gateway.routing.split).
        local = handoff is None and self.path == PATH_LOCAL
        tokens = len(prompt) - (self._predicted or 0) if local else 0
        ahead = self.decode.pace.sent(tokens)
        ok = False
        self._end_decode_span({"pdserve.outcome": "retried"}, "retried")  # an earlier attempt
        attributes = {"pdserve.worker": self.decode.worker_id, "pdserve.kv_handoff": bool(handoff),
                      "pdserve.prompt_tokens": len(prompt)}  # fmt: skip
        self._decode_span = tracing.start_span("decode", attributes, kind="client")
        try:
            with tracing.use(self._decode_span):  # the call's metadata carries this span
                self._first = await self._stream.next(None)
            ok = self._first is not None
        except BaseException:
            await self._close_stream()
            raise
        finally:
            elapsed = time.monotonic() - started
            self.decode.pace.answered(tokens, ahead, elapsed, ok and local)
            if ok and handoff is not None:
                self.decode.steps.handed_off(elapsed)
        if self._first is None:
            raise WorkerFailed(
                f"decode worker {self.decode.address} ended the stream without a token",
                worker=self.decode.address,
            )
        self.phase = recovery.advance(self.phase, Phase.DECODING)

    async def _close_stream(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            await stream.close()

    async def _following(self) -> worker_pb2.DecodeChunk:
        """The stream's next chunk; a failing or silent decode worker is migrated from."""
        assert self._stream is not None
        try:
            chunk = await self._stream.next(self._settings.inter_token_timeout_s)
            if chunk is None:
                raise WorkerFailed(
                    f"decode worker {self.decode.address} ended the stream without a finish reason",
                    worker=self.decode.address,
                )
            return chunk
        except WorkerFailed as err:  # an InvalidRequest is none: the table's INVALID row
            return await self._migrate(err)

    async def _migrate(self, err: WorkerFailed) -> worker_pb2.DecodeChunk:
        """Continue the generation on another decode worker: the prompt and the tokens so far
        are prefilled again (through a prefill worker when one is healthy) and decoding goes
        on from there. Raises ``err`` when the request cannot move."""
        why, lost_in = recovery.migratable(self.params), self.phase
        if self._stream_lost(lost_in, why, None).aborts:
            if why:
                log.warning("request %s: %s; %s", self.request_id, err.message, why)
            raise err
        failed = self.decode
        await self._close_stream()
        for worker, rid in [c for c in self._calls if c[0] is failed]:
            self._cancel_call(worker, rid)
        if self.params.max_tokens and len(self._generated) >= self.params.max_tokens:
            # Every token arrived; only the final chunk was lost.
            return worker_pb2.DecodeChunk(finish_reason="length")
        tried: list[DecodeWorker] = [failed]
        while True:
            nxt = alternative(
                self._healthy_decode(),
                tried,
                lambda w: w.load(),
            )
            step = self._stream_lost(lost_in, why, nxt is not None)
            self._migrations += 1  # an attempt, counted even when it finds no worker
            if step.aborts or nxt is None:
                raise err
            self.phase = step.phase  # ADMITTED: the prompt and the tokens so far, again
            self._metrics.retries.labels("migration").inc()
            log.warning("request %s: %s; continuing on decode worker %s after %d tokens "
                        "(migration %d)", self.request_id, err.message, nxt.address,
                        len(self._generated), self._migrations)  # fmt: skip
            self._unhold(self.decode)
            self._hold(nxt)
            self.decode = nxt
            self._pick_prefill(nxt)
            prompt = self.token_ids + self._generated
            params = continuation(self.params, len(self._generated))
            params.ClearField("prompt_logprobs")  # the client has them already
            try:
                await self._run(prompt, params, new_attempt_id())
            except WorkerFailed as again:
                if self._stream_lost(lost_in, why, None).aborts:
                    raise
                err = again
                tried.append(nxt)
                continue
            assert self._first is not None
            return self._first

    def _stream_lost(self, lost_in: Phase, why: str, another: bool | None) -> Transition:
        """The STREAM_LOST row for the stream lost in ``lost_in``: each migration recovers it."""
        left = self._settings.max_migrations - self._migrations
        return recovery.on_stream_lost(lost_in, migrations_left=left, structured=bool(why),
                                       another=another)  # fmt: skip

    def _pick_prefill(self, decode: DecodeWorker) -> None:
        """The prefill worker of a migrated request: the least loaded compatible healthy one
        (None: the decode worker computes the prompt and tokens so far itself)."""
        if self.prefill is not None:
            self._unhold(self.prefill)
        self.prefill = alternative(
            self._healthy_prefill(), (), lambda w: w.load(),
            lambda w: self._pool.compatible(w, decode),
        )  # fmt: skip
        if self.prefill is not None:
            self._hold(self.prefill)
        self._predicted = None
        self._feedback = None  # routing looked at the original prompt only

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
                chunk = await self._following()
        except GatewayError as err:
            self.abandon(outcome_for(err))
            raise
        finally:
            # Client gone (CancelledError) or consumer stopped early (GeneratorExit).
            self.abandon("cancelled")
            await self._close_stream()  # cancels the RPC if still open; never suspends

    def _on_tokens(self, chunk: worker_pb2.DecodeChunk) -> TokenDelta | None:
        count = len(chunk.token_ids)
        if not count and not chunk.text:
            return None
        if count:
            now = time.monotonic()
            if self._last_token_at is None:
                self.first_token_at = now
                self._metrics.ttft.labels(self.model, self.path).observe(now - self._received_at)
                self._decode_span.add_event("first_token")
            else:
                per_token = (now - self._last_token_at) / count
                self.decode.steps.stepped(per_token)
                for _ in range(count):
                    self._metrics.itl.labels(self.model, self.path).observe(per_token)
            self._last_token_at = now
            self._generated.extend(chunk.token_ids)
        return TokenDelta(tuple(chunk.token_ids), chunk.text, tuple(chunk.logprobs))

    async def _finish(self, chunk: worker_pb2.DecodeChunk) -> Finish:
        if chunk.finish_reason == "error" and recovery.on_engine_error(self.phase).aborts:
            raise WorkerFailed(
                f"decode worker {self.decode.address} reported an error", worker=self.decode.address
            )
        if self._stream is not None:
            trailing = await self._stream.next(None)  # read the status: the RPC ends cleanly
            if trailing is not None:
                log.warning("request %s: chunks after the finish", self.request_id)
        usage = chunk.usage
        transfer = common_pb2.TransferStats()
        transfer.CopyFrom(chunk.transfer)
        self._metrics.kv_bytes.inc(transfer.kv_bytes_received)
        if transfer.kv_blocks_received:
            self._metrics.kv_seconds.observe(transfer.kv_transfer_seconds)
        engine = chunk.engine if chunk.HasField("engine") else None
        phases = self._metrics.phases(
            self._prefill_engine if self.prefill else None, engine, transfer, self._prefill_call_s
        )
        self._end_decode_span({"pdserve.finish_reason": chunk.finish_reason,
                               "pdserve.completion_tokens": len(self._generated),
                               "pdserve.kv.bytes": transfer.kv_bytes_received,
                               "pdserve.kv.blocks": transfer.kv_blocks_received})  # fmt: skip
        self._done = True
        self.phase = recovery.advance(self.phase, Phase.DONE)
        self._calls.clear()  # every call ended normally
        self._given.clear()
        self._pool.mark_ok(self.decode)
        self.decode.steps.answered(len(self._generated))
        self._release_workers()
        self._metrics.requests.labels(self.model, self.endpoint, self.path, "ok").inc()
        self._count_slo()
        request_log.generation_ended(
            self._logged(), "ok", cached_tokens=usage.cached_tokens, phases=phases
        )
        if self._predicted is not None:  # local path: the decode worker's cache
            self._metrics.prediction(self._predicted, usage.cached_tokens)
        if self.prefill is None:
            self._computed(self.decode, usage.cached_tokens)
        return Finish(
            finish_reason=chunk.finish_reason,
            stop_reason=_stop_reason(chunk),
            usage=Usage(
                prompt_tokens=len(self.token_ids),
                completion_tokens=len(self._generated),
                cached_tokens=usage.cached_tokens,
            ),
            path=self.path,
            prefill_worker=self.prefill.address if self.prefill else LOCAL_PREFILL,
            decode_worker=self.decode.address,
            transfer=transfer,
        )

    def _count_slo(self) -> None:
        """Each objective of a finished generation, met or missed (``gateway.slo``)."""
        if self.first_token_at is None or self._last_token_at is None:
            return  # no token generated: no time to first token
        ttft = self.first_token_at - self._received_at
        tpot = time_per_output_token(self.first_token_at, self._last_token_at, len(self._generated))
        for objective, met in self._slo.outcomes(ttft, tpot).items():
            self._metrics.slo.labels(self.model, objective, "met" if met else "missed").inc()

    def abandon(self, outcome: str) -> None:
        """End early: count the outcome once and abort the touched workers (in background)."""
        if self._done:
            return
        self._done = True
        self.phase = recovery.on_ended_early(self.phase).phase  # ABORT, carried out here
        self._release_workers()
        self._metrics.requests.labels(self.model, self.endpoint, self.path, outcome).inc()
        request_log.generation_ended(self._logged(), outcome)
        self._end_decode_span(
            {"pdserve.outcome": outcome}, None if outcome == "cancelled" else outcome
        )
        calls, self._calls = self._calls, []
        for worker, rid in calls:
            self._abort([worker], rid, self._given.pop((worker, rid), None))
        self._release_staged()

    def _logged(self) -> request_log.RoutedRequest:
        return request_log.RoutedRequest(
            edge_id=self.edge_id, request_id=self.request_id, trace_id=self.trace_id,
            endpoint=self.endpoint, path=self.path,
            prefill_worker=self.prefill.worker_id if self.prefill else "local",
            decode_worker=self.decode.worker_id, prompt_tokens=len(self.token_ids),
            completion_tokens=self.completion_tokens, retries=self.retries,
            migrations=self.migrations, received_at=self.received_at,
            first_token_at=self.first_token_at, split=self._split,
        )  # fmt: skip

    def _end_decode_span(self, attributes: dict[str, Any], error: str | None = None) -> None:
        span, self._decode_span = self._decode_span, tracing.NO_SPAN
        tracing.finish(span, attributes, error)

    async def aclose(self) -> None:
        """For callers that stop before or without iterating ``events``."""
        self.abandon("cancelled")
        await self._close_stream()


def new_attempt_id() -> str:
    """A fresh internal id for a retried or migrated call (random, like the first)."""
    return uuid.uuid4().hex


def _stop_reason(chunk: worker_pb2.DecodeChunk) -> str | int | None:
    """vLLM's ``stop_reason``: the stop token's id, the stop string, or None."""
    if chunk.HasField("stop_token_id"):
        return chunk.stop_token_id
    return chunk.stop_reason or None
