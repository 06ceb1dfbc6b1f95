"""gateway.metrics.phase_times: where one request's time went (metrics and the request log)."""

from __future__ import annotations

import pytest

from gateway.metrics import GatewayMetrics, phase_times
from protos.v1 import common_pb2

PREFILL = common_pb2.EngineTimes(queue_seconds=0.5, prefill_seconds=2.0)
DECODE = common_pb2.EngineTimes(queue_seconds=1.25, prefill_seconds=0.25, decode_seconds=3.0)
PULLED = common_pb2.TransferStats(kv_blocks_received=4, kv_transfer_seconds=1.0)


def test_disaggregated_the_pull_leaves_the_decode_queue_and_the_prefill_engine_computes() -> None:
    times = phase_times(PREFILL, DECODE, PULLED)
    assert times == pytest.approx({"transfer": 1.0, "queue": 0.75, "prefill": 2.0, "decode": 3.0})


def test_a_prefill_call_that_waited_outside_the_engines_queue_counts_as_queue() -> None:
    # Sent while another prompt's step ran: vLLM's queue time (0.5 s) starts only after that
    # step, so 6 s of call for 2 s of computing means 4 s of waiting.
    times = phase_times(PREFILL, DECODE, PULLED, prefill_call_s=6.0)
    assert times == pytest.approx({"transfer": 1.0, "queue": 4.25, "prefill": 2.0, "decode": 3.0})
    # A call no longer than the engine's own times keeps the engine's queue.
    assert phase_times(PREFILL, DECODE, PULLED, prefill_call_s=2.1)["queue"] == pytest.approx(0.75)


def test_local_the_decode_engine_computes_the_prompt() -> None:
    times = phase_times(None, DECODE, common_pb2.TransferStats())
    assert times == pytest.approx({"queue": 1.25, "prefill": 0.25, "decode": 3.0})


def test_without_engine_times_only_the_transfer_is_known() -> None:
    assert phase_times(PREFILL, None, PULLED) == {"transfer": 1.0}
    assert phase_times(None, None, common_pb2.TransferStats()) == {}


def test_the_metrics_record_what_they_return() -> None:
    metrics = GatewayMetrics()
    times = metrics.phases(PREFILL, DECODE, PULLED)
    for phase, seconds in times.items():
        total = metrics.registry.get_sample_value(
            "pdserve_gateway_phase_seconds_sum", {"phase": phase}
        )
        assert total == pytest.approx(seconds)
