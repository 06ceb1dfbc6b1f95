"""Prefill deadlines follow the worker's queue and its measured rate (gateway.prefill_pace)."""

from __future__ import annotations

import pytest

from gateway.prefill_pace import PrefillPace


def test_unmeasured_worker_gets_the_floor() -> None:
    assert PrefillPace().deadline_s(10_000, floor_s=60, slack=4) == 60


def test_first_answer_sets_the_rate_and_deadline_grows_with_queue_and_prompt() -> None:
    pace = PrefillPace()
    ahead = pace.sent(1000)
    assert ahead == 1000
    pace.answered(1000, ahead, seconds=2.0, ok=True)
    assert pace.tokens_per_s == pytest.approx(500)
    assert pace.queued_tokens == 0
    # Nothing queued: 4 x 1000/500 s, but never below the floor.
    assert pace.deadline_s(1000, floor_s=1, slack=4) == pytest.approx(8)
    assert pace.deadline_s(1000, floor_s=60, slack=4) == 60
    # 3,000 tokens already queued ahead: the same prompt gets four times the time.
    pace.sent(3000)
    assert pace.deadline_s(1000, floor_s=1, slack=4) == pytest.approx(32)


def test_queued_samples_measure_throughput_not_latency() -> None:
    """Two prompts sent together on a worker doing 500 tokens/s: the second is answered after
    4 s with 2,000 tokens ahead of it, which is still a rate of 500 tokens/s."""
    pace = PrefillPace(tokens_per_s=500)
    first, second = pace.sent(1000), pace.sent(1000)
    pace.answered(1000, first, seconds=2.0, ok=True)
    pace.answered(1000, second, seconds=4.0, ok=True)
    assert pace.tokens_per_s == pytest.approx(500)
    assert pace.queued_tokens == 0


def test_failed_prefills_leave_the_queue_but_are_no_sample() -> None:
    pace = PrefillPace(tokens_per_s=500)
    ahead = pace.sent(1000)
    pace.answered(1000, ahead, seconds=0.001, ok=False)
    assert pace.tokens_per_s == 500 and pace.queued_tokens == 0
