"""pdserve.cluster.backoff: the wait before a child's restart."""

from __future__ import annotations

import pytest

from pdserve.cluster.backoff import Backoff


def test_default_schedule_doubles_from_one_second_to_the_30_s_cap() -> None:
    delays = [Backoff().delay(n) for n in range(1, 9)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]


def test_custom_schedule_and_a_huge_count_stay_at_the_cap() -> None:
    backoff = Backoff(initial_s=0.25, max_s=1.0)
    assert [backoff.delay(n) for n in (1, 2, 3, 4)] == [0.25, 0.5, 1.0, 1.0]
    assert backoff.delay(10_000) == 1.0  # no float overflow in a long crash loop


def test_stable_only_after_being_ready_long_enough() -> None:
    backoff = Backoff(reset_after_s=60.0)
    assert not backoff.is_stable(None)  # never ready in this run
    assert not backoff.is_stable(59.9)
    assert backoff.is_stable(60.0)


@pytest.mark.parametrize(
    "kwargs",
    [{"initial_s": 0.0}, {"initial_s": 5.0, "max_s": 2.0}, {"reset_after_s": -1.0}],
)
def test_invalid_schedules_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Backoff(**kwargs)


def test_restart_counts_from_one() -> None:
    with pytest.raises(ValueError):
        Backoff().delay(0)
