"""The prefix index's fence (``pdserve.kvindex.epochs``) and layout semantics, on the
in-memory index. ``tests/integration/test_kvindex_redis.py`` runs the same ``CASES`` on a
real redis-server, so both implementations keep one rule."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from pdserve.kvindex.epochs import new_epoch
from pdserve.kvindex.interfaces import BlockOps, PrefixIndex
from pdserve.kvindex.memory import MemoryIndex

M = "model-a"
OLD = new_epoch()
NEW = new_epoch(after=OLD)  # a later life of the same worker


async def held(index: PrefixIndex, holder: str, hashes: list[int]) -> int:
    return (await index.longest_prefixes(M, hashes, [holder]))[holder]


async def late_events_of_an_older_life_are_dropped(index: PrefixIndex) -> None:
    """A worker restarted: the new life rewrote its set; a step the old life sent before it
    died lands afterwards and must not add its blocks (nor remove the new ones)."""
    assert await index.replace_worker(M, "p0", [1, 2], OLD, first_blocks=[1])
    assert await index.apply(M, "p0", [BlockOps(stored=[3])], OLD)
    assert await index.replace_worker(M, "p0", [7, 8], NEW, first_blocks=[7])
    assert not await index.apply(M, "p0", [BlockOps(stored=[1, 2, 3], removed=[7])], OLD)
    assert not await index.apply(M, "p0", [BlockOps(cleared=True)], OLD)
    assert await held(index, "p0", [1, 2, 3]) == 0
    assert await held(index, "p0", [7, 8]) == 2
    assert await index.apply(M, "p0", [BlockOps(stored=[9])], NEW)
    assert await held(index, "p0", [7, 8, 9]) == 3


async def a_rewrite_from_an_older_life_cannot_take_the_fence_back(index: PrefixIndex) -> None:
    assert await index.replace_worker(M, "p0", [7], NEW, first_blocks=[7])
    assert not await index.replace_worker(M, "p0", [1, 2], OLD, first_blocks=[1])
    assert not await index.clear_worker(M, "p0", OLD)
    assert await held(index, "p0", [7]) == 1
    assert await held(index, "p0", [1]) == 0
    # and its events stay dropped after its failed rewrite
    assert not await index.apply(M, "p0", [BlockOps(stored=[1])], OLD)
    assert await index.worker_block_count(M, "p0") == 1


async def a_cleared_holder_is_claimed_again_by_a_rewrite(index: PrefixIndex) -> None:
    """A clear forgets set and fence: the same life's next step is dropped (it does not own
    a fence any more), and its rewrite claims the holder again (what a worker whose entries
    a gateway reaped does)."""
    assert await index.replace_worker(M, "p0", [1, 2], OLD, first_blocks=[1])
    assert await index.clear_worker(M, "p0", OLD)
    assert not await index.apply(M, "p0", [BlockOps(stored=[3])], OLD)
    assert await index.worker_block_count(M, "p0") == 0
    assert await index.replace_worker(M, "p0", [1, 2, 3], OLD, first_blocks=[1])
    assert await held(index, "p0", [1, 2, 3]) == 3


async def unfenced_holders_keep_working(index: PrefixIndex) -> None:
    """A shared KV tier's entries carry no epoch (the gateways write them)."""
    holder = "tier:redis:10.0.0.5:6379/1"
    assert await index.apply(M, holder, [BlockOps(stored=[1, 2, 3])])
    assert await index.apply(M, holder, [BlockOps(removed=[3])])
    assert await held(index, holder, [1, 2, 3]) == 2
    assert await index.clear_worker(M, holder)
    assert await index.worker_block_count(M, holder) == 0
    # an epoch-less write cannot touch a holder a worker life owns
    assert await index.replace_worker(M, "p0", [1], NEW, first_blocks=[1])
    assert not await index.apply(M, "p0", [BlockOps(stored=[2])])
    assert not await index.replace_worker(M, "p0", [])


async def lookups_stop_at_each_holders_first_miss(index: PrefixIndex) -> None:
    """Many holders (all groups): each one's leading run, in the order asked, duplicates
    answered once; large hashes (the full 64 bits) survive the binary encoding."""
    big = [2**64 - 1, 2**63, 1, 0]
    holders = [f"w{i}" for i in range(64)]
    for i, holder in enumerate(holders):
        assert await index.apply(M, holder, [BlockOps(stored=big[: i % 5])])
    await index.apply(M, "w3", [BlockOps(stored=[5])])  # held after a miss: not counted
    asked = [*reversed(holders), "w0", "nobody"]
    got = await index.longest_prefixes(M, [*big, 5], asked)
    assert list(got) == [*reversed(holders), "nobody"]
    assert got == {**{h: i % 5 for i, h in enumerate(holders)}, "nobody": 0}
    assert await index.longest_prefixes("model-b", big, holders[:5]) == dict.fromkeys(
        holders[:5], 0
    )


CASES: list[Callable[[PrefixIndex], Awaitable[None]]] = [
    late_events_of_an_older_life_are_dropped,
    a_rewrite_from_an_older_life_cannot_take_the_fence_back,
    a_cleared_holder_is_claimed_again_by_a_rewrite,
    unfenced_holders_keep_working,
    lookups_stop_at_each_holders_first_miss,
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
async def test_memory_index(case: Callable[[PrefixIndex], Awaitable[None]]) -> None:
    await case(MemoryIndex())


def test_epochs_order_lives_even_against_a_clock_that_ran_ahead() -> None:
    first = new_epoch()
    assert new_epoch(after=first) > first
    ahead = f"{10**19 * 9:020d}-abcdef01"  # a previous life on a machine whose clock is ahead
    assert new_epoch(after=ahead) > ahead
    assert len(new_epoch()) == len(first) == 29
    assert len(new_epoch(after="not-an-epoch")) == 29  # not an epoch: the clock alone
