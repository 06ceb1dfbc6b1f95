"""Where a prompt is computed (``gateway.routing.split``): the adaptive policy's predictions
and choices from the workers' measured queues, rates and steps, and how each is counted."""

from __future__ import annotations

from typing import Any

from gateway.metrics import GatewayMetrics
from gateway.pool import DecodeWorker, PrefillWorker, Worker
from gateway.routing.interfaces import DECODE_WORKER, PREFILL_WORKER, Route
from gateway.routing.split import SplitPolicy, predict
from gateway.slo import Slo
from protos.v1 import worker_pb2
from tests.helpers import counted

NO_SLO = Slo()
TPOT_100MS = Slo(tpot_s=0.1)


def workers(
    *, p_rate: float = 1000.0, p_queued: int = 0, d_rate: float = 0.0, d_queued: int = 0,
    step_s: float = 0.02, handoff_s: float = 0.05, answer: float = 50.0, streams: int = 0,
) -> tuple[PrefillWorker, DecodeWorker]:  # fmt: skip
    p: Worker[Any] = Worker("p:1", worker_pb2.ROLE_PREFILL, client=None)
    d: Worker[Any] = Worker("d:1", worker_pb2.ROLE_DECODE, client=None)
    p.pace.tokens_per_s, p.pace.queued_tokens = p_rate, p_queued
    d.pace.tokens_per_s, d.pace.queued_tokens = d_rate, d_queued
    d.steps.step_s, d.steps.handoff_s, d.steps.answer_tokens = step_s, handoff_s, answer
    d.in_flight = streams
    return p, d  # type: ignore[return-value]


def test_an_idle_decode_worker_computes_the_prompt_when_that_is_sooner() -> None:
    # 500 tokens at 1,000/s either way; the hand-off (50 ms) costs more than one step (20 ms).
    split = predict(*workers(), 500, 500, NO_SLO)
    assert (split.where, split.reason) == (DECODE_WORKER, "decode_idle")
    assert split.ttft_prefill_s == 0.55 and split.ttft_local_s == 0.52
    assert split.predicted_ttft_s == 0.52


def test_a_faster_prefill_worker_or_a_queue_on_the_decode_worker_keeps_the_prefill_worker() -> None:
    # The decode worker's own rate is half the prefill worker's.
    split = predict(*workers(d_rate=500.0), 500, 500, NO_SLO)
    assert (split.where, split.reason) == (PREFILL_WORKER, "prefill_sooner")
    split = predict(*workers(d_queued=1000), 500, 500, NO_SLO)
    assert (split.where, split.reason) == (PREFILL_WORKER, "prefill_sooner")


def test_a_queue_on_the_prefill_worker_sends_the_prompt_to_the_decode_worker() -> None:
    # 2,000 tokens queued on P: 2.5 s there against 0.5 s on D, whose rate is half.
    split = predict(*workers(p_queued=2000, d_rate=1000.0, streams=3), 500, 500, TPOT_100MS)
    # stall 0.5 s over 50-token answers: 20 ms + 10 ms per token, within 100 ms
    assert (split.where, split.reason) == (DECODE_WORKER, "within_tpot")
    assert split.stall_s == 0.5 and split.streams == 3


def test_streams_that_would_miss_their_tpot_keep_the_prefill_worker() -> None:
    # A 5 s stall over 50 tokens adds 100 ms a token: 120 ms > 100 ms.
    split = predict(*workers(p_queued=20_000, streams=2), 5000, 5000, TPOT_100MS)
    assert (split.where, split.reason) == (PREFILL_WORKER, "tpot_guard")
    # Without a TPOT objective streams are never stalled.
    split = predict(*workers(p_queued=20_000, streams=2), 500, 500, NO_SLO)
    assert (split.where, split.reason) == (PREFILL_WORKER, "streams_unguarded")


def test_nothing_measured_yet_keeps_the_prefill_worker() -> None:
    split = predict(*workers(p_rate=0.0), 500, 500, NO_SLO)
    assert (split.where, split.reason, split.predicted_ttft_s) == (PREFILL_WORKER, "learning", None)
    split = predict(*workers(p_queued=5000, streams=1, answer=0.0), 500, 500, TPOT_100MS)
    assert (split.where, split.reason) == (PREFILL_WORKER, "learning")


def test_the_cached_part_is_what_each_worker_need_not_compute() -> None:
    # The decode worker holds 900 of 1,000 tokens: 100 to compute there, 1,000 on P.
    p, d = workers(d_rate=500.0, streams=1, step_s=0.01)
    route = Route(p, d, predicted_cached_tokens=0, decode_cached_tokens=900)
    metrics = GatewayMetrics()
    chosen = SplitPolicy("adaptive", metrics).decide(route, 1000, TPOT_100MS)
    assert chosen.prefill is None and chosen.decode is d
    assert chosen.predicted_cached_tokens == 900  # now the decode worker's cache's
    assert chosen.split is not None and chosen.split.reason == "within_tpot"
    metric = 'pdserve_gateway_split_decisions_total{reason="within_tpot",where="decode_worker"}'
    assert counted(metrics.render().decode(), metric) == 1


def test_the_static_policy_keeps_the_pickers_route_and_counts_it() -> None:
    p, d = workers(p_queued=100_000)
    metrics = GatewayMetrics()
    policy = SplitPolicy("static", metrics)
    route = policy.decide(Route(p, d), 500, NO_SLO)
    assert route.prefill is p and route.split is not None and route.split.reason == "static"
    local = Route(None, d)
    assert policy.decide(local, 500, NO_SLO) is local  # the picker's own local choice
    metric = 'pdserve_gateway_split_decisions_total{reason="static",where="prefill_worker"}'
    assert counted(metrics.render().decode(), metric) == 1
