"""pdserve.runtime.heap: start-up objects leave the collector's generations; later ones do not."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from pdserve.runtime.heap import freeze_startup_objects


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()  # the rest of the test session collects as before


def test_start_up_objects_are_frozen_and_later_garbage_still_collected(unfrozen: None) -> None:
    kept = [[i] for i in range(1000)]
    frozen = freeze_startup_objects()
    assert frozen >= len(kept)
    # Only ever lower from here: a frozen object freed by its last reference (another thread
    # of the session may drop one at any moment) leaves the count; nothing else joins it.
    assert 0 < gc.get_freeze_count() <= frozen
    assert not any(o is kept for o in gc.get_objects())  # no generation holds it

    class Cycle:
        def __init__(self) -> None:
            self.me = self

    cycles = [Cycle() for _ in range(10)]
    del cycles
    assert gc.collect() >= 10  # made after the freeze: collected as ever
    assert gc.get_freeze_count() <= frozen  # and the collection froze nothing new
