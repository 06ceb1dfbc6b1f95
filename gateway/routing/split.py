"""Where a prompt is computed: on the prefill worker the picker chose (its KV then moves to
the decode worker) or on the decode worker itself (conditional disaggregation), per request
(setting ``disagg_policy``).

``static``: always the prefill worker (the picker has already sent prompts whose uncached part
is at most ``disagg_min_uncached_tokens`` to the decode worker). ``adaptive`` predicts, from
this gateway's own measurements of both workers (``Worker.pace``: prompt tokens queued and
computed per second; ``Worker.steps``: decode step, hand-off, answer length)::

    ttft via P   = (P's queued tokens + the prompt's tokens P must compute) / P's rate
                   + the hand-off (KV pull and first step, measured on this decode worker)
    ttft local   = (D's queued local tokens + the tokens D must compute) / D's local rate
                   + one decode step
    stall        = the tokens D must compute / D's local rate

and computes the prompt on the decode worker when that gives the first token sooner and costs
the streams it decodes no objective: it decodes none, or each of them, stalled once by
``stall`` (vLLM's chunked prefill runs the prompt between their steps), still meets the time
per output token objective (the request's, else ``slo_tpot_ms``), with its tokens taken as the
measured mean answer length. Without a TPOT objective, streams are never stalled. Until the
prefill worker's rate is measured, and until the decode worker has streamed a step where
streams are at stake, it chooses the prefill worker; the decode worker's local rate starts
as the prefill worker's. On two cores the local path gains most: a decode worker computing
a prompt borrows the idle prefill engine's core (``pdserve.worker.core_lending``), a prefill
worker has one.

Every choice is counted (``pdserve_gateway_split_decisions``) and the request's log line
names it with the predicted time to first token (``gateway.request_log``).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from gateway.metrics import GatewayMetrics
from gateway.pool import DecodeWorker, PrefillWorker
from gateway.routing.interfaces import DECODE_WORKER, PREFILL_WORKER, Route, Split
from gateway.slo import Slo

log = logging.getLogger(__name__)


def streams_on(worker: DecodeWorker) -> int:
    """Requests the decode worker serves now: every gateway's, or its engine's count."""
    return max(worker.in_flight + worker.peer_in_flight, int(worker.reported("running")))


def predict(
    prefill: PrefillWorker, decode: DecodeWorker, prefill_tokens: int, local_tokens: int,
    slo: Slo,
) -> Split:  # fmt: skip
    """The adaptive choice for a prompt of which P must compute ``prefill_tokens`` and D
    ``local_tokens`` (module docstring)."""
    rate_p = prefill.pace.tokens_per_s
    if rate_p <= 0:
        return Split(PREFILL_WORKER, "learning")
    rate_d = decode.pace.tokens_per_s or rate_p
    steps = decode.steps
    ttft_p = (prefill.pace.queued_tokens + prefill_tokens) / rate_p + steps.handoff_s
    ttft_d = (decode.pace.queued_tokens + local_tokens) / rate_d + steps.step_s
    stall = local_tokens / rate_d
    streams = streams_on(decode)

    def split(where: str, reason: str) -> Split:
        return Split(where, reason, ttft_p, ttft_d, stall, streams)

    if ttft_d >= ttft_p:
        return split(PREFILL_WORKER, "prefill_sooner")
    if streams == 0:
        return split(DECODE_WORKER, "decode_idle")
    if slo.tpot_s is None:
        return split(PREFILL_WORKER, "streams_unguarded")
    if steps.step_s <= 0 or steps.answer_tokens <= 0:
        return split(PREFILL_WORKER, "learning")
    if steps.step_s + stall / steps.answer_tokens <= slo.tpot_s:
        return split(DECODE_WORKER, "within_tpot")
    return split(PREFILL_WORKER, "tpot_guard")


class SplitPolicy:
    """Applies ``disagg_policy`` to a picker's route (``decide``)."""

    def __init__(self, policy: str, metrics: GatewayMetrics) -> None:
        self.policy = policy
        self.metrics = metrics

    def decide(self, route: Route, prompt_tokens: int, slo: Slo) -> Route:
        """``route`` as the picker made it, or on the decode worker alone; with the choice
        (``Route.split``). A route without a prefill worker is the picker's own choice."""
        if route.prefill is None:
            return route
        if self.policy != "adaptive":
            split = Split(PREFILL_WORKER, "static")
        else:
            split = predict(
                route.prefill, route.decode,
                prompt_tokens - (route.predicted_cached_tokens or 0),
                prompt_tokens - (route.decode_cached_tokens or 0), slo,
            )  # fmt: skip
            log.debug("split: %r", split)
        self.metrics.split_decisions.labels(split.where, split.reason).inc()
        if split.where == PREFILL_WORKER:
            return replace(route, split=split)
        return replace(
            route, prefill=None, predicted_cached_tokens=route.decode_cached_tokens, split=split
        )
