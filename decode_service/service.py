"""Decode core: pull the prompt's KV blocks (or compute the prompt) and stream tokens.

With a hand-off, the connector pulls the blocks the local prefix cache lacks and the engine
computes only the last prompt token; without one the engine computes the prompt itself. The
final event carries usage and what the connector measured (``TransferStats``).

A hand-off that is not for this request's prompt, or not sealed with the deployment secret
(``kv_transfer.seal``), is refused before the engine sees the request (INVALID_ARGUMENT); the
connector checks it again, so nothing foreign is ever pulled into, or cached by, the engine.

Releasing the prefill worker's blocks of a hand-off this worker will not run goes through the
hand-off's connector. Ours: a release on the prefill worker's KV port, and lease renewals while
the request waits in the engine's queue; our engine does not release a hand-off when it aborts
a request it has not pulled yet (``kv_transfer.scheduler``): the gateway may hand it on to
another decode worker (a retry before the first token), and releases it itself when the request
ends (its ``Abort`` to the prefill worker). vLLM's NixlConnector: the engine itself sends the
producer a notification for a request submitted already aborted
(``notify_kv_transfer_request_rejected``, vllm/v1/engine/async_llm.py:924-950, which runs the
connector's ``request_finished`` with ``do_remote_prefill`` still set: nixl/pull_scheduler.py:
219-230, and its worker notifies without reading, nixl/pull_worker.py:67-75, 444-467); an
aborted request the engine has is released the same way by vLLM, or by its read's own
notification; vLLM's decode engine renews the producer's lease by heartbeats itself
(nixl/base_scheduler.py:199-238, base_worker.py:3179-3211). So ``abort`` with a NIXL hand-off
releases it only when the request never reached this worker's engine, and remembers it: a
Decode call that brings it later (the abort overtook it) is refused, as nothing may read blocks
the producer has freed. A failed NIXL read is not released (vLLM sends no notification after a
failure: base_worker.py:3131-3161): the producer frees the blocks when the lease ends
(``--kv-lease-s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from kv_transfer import seal
from kv_transfer.client import release, renew
from kv_transfer.errors import KVTransferError, PromptMismatch
from pdserve.runtime.supervise import start_task
from pdserve.telemetry import tracing
from pdserve.worker.engine_times import EnginePhases
from pdserve.worker.errors import InvalidRequest, KVTransferFailed
from pdserve.worker.sampling import cache_salt, engine_prompt, salted_transfer_params, to_vllm
from pdserve.worker.service import WorkerService
from protos.v1 import common_pb2

log = logging.getLogger(__name__)

# NIXL hand-offs released by this worker that a late Decode call must not use (the newest).
RELEASED_KEPT = 4096


# Per token: (token id, its logprob, its rank, the top alternatives as (id, logprob)).
Logprobs = list[tuple[int, float, int, list[tuple[int, float]]]]


@dataclass
class DecodeEvent:
    token_ids: list[int]
    text: str
    logprobs: Logprobs = field(default_factory=list)
    prompt_logprobs: Logprobs = field(default_factory=list)
    finish_reason: str = ""
    stop_reason: str = ""  # the stop string that ended generation
    stop_token_id: int | None = None  # or the stop token
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    transfer: dict[str, Any] = field(default_factory=dict)
    phases: EnginePhases = field(default_factory=EnginePhases)


def _logprobs(completion: Any, start: int) -> Logprobs:
    if not completion.logprobs:
        return []
    return _ranked(completion.token_ids, completion.logprobs[start:])


def _prompt_logprobs(output: Any, token_ids: list[int]) -> Logprobs:
    """Entry i is prompt token i+1 (vLLM has none for the first prompt token)."""
    ranked = list(output.prompt_logprobs or [])[1:]
    return _ranked(token_ids[1:], ranked) if ranked else []


def _ranked(tokens: Any, per_token: Any) -> Logprobs:
    out = []
    for token, ranked in zip(tokens, per_token, strict=False):
        if ranked is None:
            continue
        top = sorted(ranked.items(), key=lambda kv: kv[1].rank or 0)
        chosen = ranked.get(token)
        out.append(
            (
                int(token),
                float(chosen.logprob) if chosen else 0.0,
                int(chosen.rank or 0) if chosen else 0,
                [(int(t), float(lp.logprob)) for t, lp in top],
            )
        )
    return out


@contextlib.contextmanager
def _discarding(active: set[str], request_id: str) -> Iterator[None]:
    try:
        yield
    finally:
        active.discard(request_id)


@contextlib.contextmanager
def _cancelling(task: asyncio.Task[None] | None) -> Iterator[None]:
    try:
        yield
    finally:
        if task is not None:
            task.cancel()


def _trace_pull(stats: dict[str, Any]) -> None:
    """A span of the KV pull, child of the current (Decode) span, from what the transfer
    process measured: when it started, how long it took, the blocks and bytes received."""
    started = float(stats.get("transfer_started_unix") or 0.0)
    if not tracing.enabled() or not started:
        return
    span = tracing.start_span(
        "kv.pull",
        {
            "pdserve.kv.blocks": int(stats.get("received_blocks", 0)),
            "pdserve.kv.bytes": int(stats.get("received_bytes", 0)),
            "pdserve.kv.tokens": int(stats.get("received_tokens", 0)),
            "pdserve.kv.local_cached_tokens": int(stats.get("local_cached_tokens", 0)),
        },
        start_time=started,
    )
    if stats.get("transfer_error"):
        tracing.fail(span, str(stats["transfer_error"]))
    tracing.end_at(span, started + float(stats.get("transfer_seconds") or 0.0))


class DecodeService(WorkerService):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.connector = self.settings.kv_connector  # how hand-offs reach this worker
        self.active: set[str] = set()  # requests given to the engine, until they end
        self.released: OrderedDict[str, None] = OrderedDict()  # NIXL: remote_request_id

    async def decode(
        self,
        request_id: str,
        token_ids: list[int],
        params: common_pb2.SamplingParams,
        handoff: dict[str, Any] | None,
    ) -> AsyncIterator[DecodeEvent]:
        from vllm.sampling_params import RequestOutputKind

        self.check_alive()
        try:
            if not token_ids:
                raise InvalidRequest("prompt_token_ids is empty")
            if handoff:
                self._check_handoff(handoff, token_ids)
                if str(handoff.get("remote_request_id")) in self.released:
                    handoff = None  # released already: nothing left to release either
                    raise InvalidRequest("the KV hand-off was released: its request was cancelled")
            salt = cache_salt(params)
            adapter = self.adapters.get(params.lora_name)
            lora = await self.lora_request(params.lora_name)
            tag = adapter.tier_tag if adapter else None
            tier = self.settings.kv_tier != "off"
            transfer = salted_transfer_params(handoff, salt, tier, tag)
            extra = {"kv_transfer_params": transfer} if transfer else None
            sampling = to_vllm(
                params,
                self.info.max_model_len,
                len(token_ids),
                output_kind=RequestOutputKind.DELTA,
                extra_args=extra,
            )
        except InvalidRequest:
            await self._release(handoff)
            raise
        prompt = engine_prompt(list(token_ids), salt)
        generated = 0
        first = True
        # While the engine has the request queued, the prefill worker's lease on its blocks
        # is kept alive: a busy decode worker must not turn waiting into a recomputation.
        keeper = self._keep_lease(handoff) if handoff and self.connector == "pdserve" else None
        self.active.add(request_id)
        with self.counted(), _cancelling(keeper), _discarding(self.active, request_id):
            # vLLM's own request spans (when its tracing is on) join the caller's trace.
            trace = self.trace_headers()
            async for output in self.engine.generate(
                prompt,
                sampling,
                request_id,
                trace_headers=trace,
                lora_request=lora,
            ):
                if keeper is not None:  # the blocks are in (the first output comes after)
                    keeper.cancel()
                    keeper = None
                completion = output.outputs[0]
                generated += len(completion.token_ids)
                event = DecodeEvent(
                    token_ids=list(completion.token_ids),
                    text=completion.text,
                    logprobs=_logprobs(completion, 0),
                )
                if first and params.HasField("prompt_logprobs"):
                    event.prompt_logprobs = _prompt_logprobs(output, token_ids)
                first = False
                if output.finished:
                    self._finish(event, output, len(token_ids), generated)
                yield event

    def _finish(self, event: DecodeEvent, output: Any, prompt_len: int, generated: int) -> None:
        completion = output.outputs[0]
        stats = dict((output.kv_transfer_params or {}).get("pdserve") or {})
        event.phases = EnginePhases.of(output)
        event.phases.trace()
        _trace_pull(stats)
        if completion.finish_reason == "error":
            reason = stats.get("transfer_error") or "the engine failed the request"
            raise KVTransferFailed(reason)
        event.finish_reason = str(completion.finish_reason or "stop")
        if isinstance(completion.stop_reason, int):
            event.stop_token_id = completion.stop_reason
        elif completion.stop_reason is not None:
            event.stop_reason = str(completion.stop_reason)
        event.prompt_tokens = prompt_len
        event.completion_tokens = generated
        event.cached_tokens = int(output.num_cached_tokens or 0)
        event.transfer = stats

    def _keep_lease(self, handoff: dict[str, Any]) -> asyncio.Task[None]:
        # Restarted if it fails (it keeps no state); one name, so one restart counter.
        return start_task(lambda: self._renew_until_cancelled(handoff), "kv-lease-renewal")

    async def _renew_until_cancelled(self, handoff: dict[str, Any]) -> None:
        """Renew the hand-off's lease on every TP rank every third of the lease."""
        host, port = str(handoff["remote_host"]), int(handoff["remote_port"])
        ranks = max(1, int(handoff.get(seal.TP_SIZE) or 1))
        request = str(handoff["remote_request_id"])
        while True:
            await asyncio.sleep(self.settings.kv_lease_s / 3)
            for rank in range(ranks):
                try:
                    held = await asyncio.to_thread(
                        renew, host, port + rank, request, secret=self.secret
                    )
                except (OSError, KVTransferError) as exc:
                    log.warning("could not renew the lease of %s: %s", request, exc)
                    continue
                if not held:
                    return  # pulled, released or expired meanwhile: nothing left to keep

    def _check_handoff(self, handoff: dict[str, Any], token_ids: list[int]) -> None:
        try:
            seal.verify(handoff, token_ids, self.secret)
        except PromptMismatch as exc:
            if not seal.is_genuine(handoff, self.secret):
                handoff.clear()  # never act on a forged hand-off, not even to release it
            raise InvalidRequest(str(exc)) from exc

    async def abort(self, request_id: str, handoff: dict[str, Any] | None = None) -> bool:
        """Abort the request; ``handoff``: one no engine was given (the request ended between
        prefill and decode), whose blocks this worker releases on its prefill worker."""
        await self.engine.abort(request_id)
        if not handoff:
            return True
        if not seal.is_genuine(handoff, self.secret):
            log.warning("not releasing a hand-off that is not sealed with the deployment secret")
        elif self.connector != "nixl" or request_id not in self.active:
            # Under NIXL a request the engine has is released by vLLM (module doc).
            await self._release(handoff)
        return True

    def _remember_released(self, remote_request_id: str) -> None:
        self.released[remote_request_id] = None
        while len(self.released) > RELEASED_KEPT:
            self.released.popitem(last=False)

    async def _release(self, handoff: dict[str, Any] | None) -> None:
        """Unpin the prefill worker's blocks of a request this worker will not run: through
        the engine under NIXL, else on every TP rank of the prefill worker (rank r's agent
        listens on remote_port + r)."""
        if not handoff or not handoff.get("remote_host"):
            return
        if self.connector == "nixl":
            await self._release_nixl(handoff)
            return
        host, port = str(handoff["remote_host"]), int(handoff["remote_port"])
        for rank in range(max(1, int(handoff.get(seal.TP_SIZE) or 1))):
            try:
                await asyncio.to_thread(
                    release,
                    host,
                    port + rank,
                    str(handoff["remote_request_id"]),
                    secret=self.secret,
                )
            except (OSError, KVTransferError) as exc:
                log.warning("could not unpin rejected request's blocks: %s", exc)

    async def _release_nixl(self, handoff: dict[str, Any]) -> None:
        """vLLM's own release of a NIXL hand-off: a request submitted already aborted, under an
        id of its own (never one of a live request), whose ``request_finished`` makes the
        engine's NIXL worker notify the producer."""
        self._remember_released(str(handoff.get("remote_request_id")))
        params = {**handoff, "do_remote_prefill": True, "do_remote_decode": False}
        release_id = f"release-{uuid.uuid4().hex}"
        try:
            await self.engine.notify_kv_transfer_request_rejected(release_id, params)
        except Exception as exc:  # named policy: a failed release leaves it to the lease
            log.warning(
                "could not release the blocks of %s on its prefill worker: %s (its lease will)",
                handoff.get("remote_request_id"),
                exc,
            )
