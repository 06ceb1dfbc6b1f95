"""The shared KV tier in routing: read, weighed, written after a prompt was computed, and
corrected when the tier served less; with the in-memory index and stand-in workers."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.metrics import GatewayMetrics
from gateway.routing.kv_tier import TierIndex, tier_of, tier_tokens
from gateway.routing.prefix import PrefixPicker
from pdserve.kvindex.hashing import block_hashes
from pdserve.kvindex.interfaces import BlockOps, IndexUnavailable
from pdserve.kvindex.memory import MemoryIndex
from tests.unit.test_prefix_picker import BS, StandIn, always, picker, request

TIER = "redis:10.0.0.5:6379/1"
HOLDER = "tier:" + TIER
CHUNK = 2 * BS  # two blocks per tier chunk
N = 100  # prompt tokens: 6 whole blocks, 3 whole chunks (96 tokens)
HASHES = block_hashes(list(range(N)), BS, seed=42)


def prefill(name: str, tier: str = TIER, in_flight: int = 0) -> StandIn:
    return StandIn(name, "prefill", in_flight=in_flight, tier=tier, chunk=CHUNK if tier else 0)


def decode(tier: str = TIER) -> StandIn:
    return StandIn("d", "decode", tier=tier, chunk=CHUNK if tier else 0)


async def held(index: MemoryIndex, holder: str = HOLDER) -> int:
    return (await index.longest_prefixes("m", HASHES, [holder]))[holder]


async def predicted(chooser: PrefixPicker, worker: StandIn, n: int = N) -> int | None:
    route = await chooser.pick(request(n), [worker], [decode()], always)
    assert route.prefill is worker
    return route.predicted_cached_tokens


def test_tier_tokens_are_whole_chunks_and_never_the_last_prompt_token() -> None:
    assert tier_tokens(blocks=3, block_size=BS, chunk=CHUNK, prompt_len=N) == 32
    assert tier_tokens(blocks=6, block_size=BS, chunk=CHUNK, prompt_len=N) == 96
    # a prompt held in full: LMCache serves all but its last token
    assert tier_tokens(blocks=4, block_size=BS, chunk=CHUNK, prompt_len=64) == 63
    assert tier_tokens(blocks=0, block_size=BS, chunk=CHUNK, prompt_len=1) == 0


def test_only_shared_tiers_of_whole_blocks_are_indexed() -> None:
    tier = tier_of(prefill("p"), BS)
    assert tier is not None and tier.holder == HOLDER and tier.chunk == CHUNK
    assert tier_of(prefill("p", tier=""), BS) is None
    odd = StandIn("p", "prefill", tier=TIER, chunk=24)  # 1.5 blocks: no hash names a chunk
    assert tier_of(odd, BS) is None


async def test_a_tier_hit_counts_for_every_worker_sharing_the_tier() -> None:
    index = MemoryIndex()
    await index.apply("m", HOLDER, [BlockOps(stored=HASHES[:5])])  # 2.5 chunks: 2 count
    chooser = picker(index)
    assert await predicted(chooser, prefill("p0")) == 64
    assert await predicted(chooser, prefill("p1")) == 64
    assert await predicted(chooser, prefill("p2", tier="redis:10.0.0.6:6379/1")) == 0
    assert await predicted(chooser, prefill("p3", tier="")) == 0


async def test_a_worker_is_predicted_the_larger_of_its_own_and_its_tiers_hit() -> None:
    index = MemoryIndex()
    await index.apply("m", HOLDER, [BlockOps(stored=HASHES[:4])])  # 64 tokens
    await index.apply("m", "p0", [BlockOps(stored=HASHES[:5])])  # 80 tokens of its own
    await index.apply("m", "p1", [BlockOps(stored=HASHES[:1])])
    chooser = picker(index)
    assert await predicted(chooser, prefill("p0")) == 80
    assert await predicted(chooser, prefill("p1")) == 64


async def test_a_local_hit_beats_a_tier_hit_of_the_same_length() -> None:
    index = MemoryIndex()
    await index.apply("m", HOLDER, [BlockOps(stored=HASHES[:4])])
    await index.apply("m", "p0", [BlockOps(stored=HASHES[:4])])
    workers = [prefill("p0"), prefill("p1")]
    chooser = picker(index)
    for _ in range(2):  # whichever worker the round robin offers first
        route = await chooser.pick(request(N), workers, [decode()], always)
        assert route.prefill is workers[0] and route.predicted_cached_tokens == 64
    # At full weight a tier hit is as good as a local one: the two tie and take turns.
    chooser = picker(index, tier_hit_weight=1.0)
    chosen = {(await chooser.pick(request(N), workers, [decode()], always)).prefill
              for _ in range(2)}  # fmt: skip
    assert chosen == set(workers)


async def test_a_tier_hit_outweighs_a_little_load() -> None:
    index = MemoryIndex()
    await index.apply("m", HOLDER, [BlockOps(stored=HASHES)])
    busy, idle = prefill("p0", in_flight=1), prefill("p1", tier="")
    route = await picker(index).pick(request(N), [busy, idle], [decode()], always)
    # 2 x 0.8 x 96/100 for the tier hit against 1 x 1/2 for the load
    assert route.prefill is busy and route.predicted_cached_tokens == 96


async def test_conditional_disaggregation_counts_the_decode_workers_tier() -> None:
    index = MemoryIndex()
    await index.apply("m", HOLDER, [BlockOps(stored=HASHES)])
    chooser = picker(index, disagg_min_uncached_tokens=8)
    route = await chooser.pick(request(N), [prefill("p0")], [decode()], always)
    assert route.prefill is None and route.predicted_cached_tokens == 96  # 4 left to compute


async def test_a_computed_prompt_puts_its_whole_chunks_in_the_tier() -> None:
    index = MemoryIndex()
    chooser = picker(index)
    worker = prefill("p0")
    route = await chooser.pick(request(N), [worker], [decode()], always)
    assert route.predicted_cached_tokens == 0 and route.feedback is not None
    route.feedback.computed(worker, 0)
    await chooser.close()
    assert await held(index) == 6  # 96 of 100 tokens: three chunks
    assert index.by_worker[("m", HOLDER)] == set(HASHES[:6])
    # now every worker with the tier is predicted the chunks; one without it is not
    assert await predicted(chooser, prefill("p1")) == 96
    assert await predicted(chooser, prefill("p2", tier="")) == 0
    # a prompt shorter than a chunk leaves nothing in the tier
    short = await chooser.pick(request(CHUNK - 1), [prefill("p3", tier="fs:/x")], [decode()],
                               always)  # fmt: skip
    assert short.feedback is not None
    short.feedback.computed(prefill("p3", tier="fs:/x"), 0)
    await chooser.close()
    assert not index.by_worker.get(("m", "tier:fs:/x"))


async def test_a_worker_without_a_shared_tier_writes_nothing() -> None:
    index = MemoryIndex()
    chooser = picker(index)
    plain = prefill("p0", tier="")
    route = await chooser.pick(request(N), [plain], [decode(tier="")], always)
    assert route.feedback is None  # no candidate has a tier: no tier work at all
    route = await chooser.pick(request(N), [plain], [decode()], always)
    assert route.feedback is not None
    route.feedback.computed(plain, 0)
    await chooser.close()
    assert not index.by_worker


async def test_a_tier_that_served_less_loses_its_entries_from_the_first_chunk_not_served() -> None:
    index = MemoryIndex()
    await index.apply("m", HOLDER, [BlockOps(stored=HASHES[:6])])
    chooser = picker(index)
    worker = prefill("p0")
    route = await chooser.pick(request(N), [worker], [decode()], always)
    assert route.predicted_cached_tokens == 96 and route.feedback is not None
    route.feedback.computed(worker, 40)  # one chunk (and a block of its own cache) served
    await chooser.close()
    assert index.by_worker[("m", HOLDER)] == set(HASHES[:2])  # not written back either
    assert chooser.metrics.tier_corrections._value.get() == 1
    assert await predicted(chooser, prefill("p1")) == 32
    # served as predicted: nothing to correct, and the chunks the worker computed (and
    # LMCache stored again) are written
    route = await chooser.pick(request(N), [worker], [decode()], always)
    assert route.feedback is not None
    route.feedback.computed(worker, 32)
    await chooser.close()
    assert chooser.metrics.tier_corrections._value.get() == 1
    assert await held(index) == 6


async def test_a_worker_served_more_than_predicted_writes_the_rest() -> None:
    index = MemoryIndex()
    await index.apply("m", HOLDER, [BlockOps(stored=HASHES[:2])])
    chooser = picker(index)
    worker = prefill("p0")
    route = await chooser.pick(request(N), [worker], [decode()], always)
    assert route.predicted_cached_tokens == 32 and route.feedback is not None
    route.feedback.computed(worker, 96)
    await chooser.close()
    assert await held(index) == 6
    assert chooser.metrics.tier_corrections._value.get() == 0


class DownWrites(MemoryIndex):
    async def apply(self, model: str, worker: str, ops: Sequence[BlockOps]) -> None:
        raise IndexUnavailable("connection refused")


async def test_a_failed_write_is_counted_and_the_request_unaffected() -> None:
    index = DownWrites()
    chooser = picker(index)
    worker = prefill("p0")
    route = await chooser.pick(request(N), [worker], [decode()], always)
    assert route.feedback is not None
    route.feedback.computed(worker, 0)
    await chooser.close()
    assert chooser.metrics.tier_index_errors._value.get() == 1


async def test_a_tier_past_its_bound_is_dropped_and_relearned() -> None:
    index = MemoryIndex()
    metrics = GatewayMetrics()
    tiers = TierIndex(index, metrics, max_blocks=4, check_every=2)
    tiers.store("m", HOLDER, HASHES[:2])
    tiers.store("m", HOLDER, HASHES[2:4])
    await tiers.close()
    assert await held(index) == 4  # at the bound: kept
    tiers.store("m", HOLDER, HASHES[4:6])
    tiers.store("m", HOLDER, HASHES[:2])
    await tiers.close()
    assert await held(index) == 0 and metrics.tier_index_resets._value.get() == 1
    tiers.store("m", HOLDER, HASHES[:2])
    await tiers.close()
    assert await held(index) == 2
