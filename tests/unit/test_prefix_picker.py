"""The prefix picker's choices, with the in-memory index and stand-in workers."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from gateway.config import GatewaySettings
from gateway.metrics import GatewayMetrics
from gateway.routing.interfaces import RouteRequest
from gateway.routing.prefix import PrefixPicker, cacheable_tokens
from gateway.routing.registry import PickerContext
from pdserve.kvindex.hashing import block_hashes
from pdserve.kvindex.interfaces import BlockOps, IndexUnavailable
from pdserve.kvindex.memory import MemoryIndex

BS = 16


class StandIn:
    """A worker as the picker sees it; ``tier``: the identity of its shared KV tier."""

    def __init__(
        self, name: str, role: str, in_flight: int = 0, tier: str = "", chunk: int = 0
    ) -> None:
        self.worker_id = name
        self.role_name = role
        self.capabilities = SimpleNamespace(block_size=BS, kv_tier=tier, kv_tier_chunk_tokens=chunk)
        self.in_flight = in_flight

    def load(self) -> float:
        return float(self.in_flight)

    def kv_usage(self) -> float:
        return self.usage

    usage = 0.0


def picker(index: Any, **settings: Any) -> PrefixPicker:
    s = GatewaySettings(model="unused", **{"disagg_min_uncached_tokens": 0, **settings})
    return PrefixPicker(PickerContext(s, GatewayMetrics(), index))


def request(n: int) -> RouteRequest:
    return RouteRequest("r", "m", list(range(n)))


def always(p: Any, d: Any) -> bool:
    return True


async def test_cached_tokens_never_include_the_last_prompt_token() -> None:
    assert cacheable_tokens(blocks=4, block_size=16, prompt_len=64) == 48
    assert cacheable_tokens(blocks=2, block_size=16, prompt_len=64) == 32
    assert cacheable_tokens(blocks=0, block_size=16, prompt_len=5) == 0


async def test_prefers_the_longest_prefix_then_the_lighter_load() -> None:
    index = MemoryIndex()
    hashes = block_hashes(list(range(100)), BS, seed=42)
    await index.apply("m", "p1", [BlockOps(stored=hashes[:4])])
    p0, p1, d = (
        StandIn("p0", "prefill"),
        StandIn("p1", "prefill", in_flight=3),
        StandIn("d", "decode"),
    )
    # 64 of 100 tokens cached (2 x 0.64) outweighs 3 queued requests (1 x 3/4)
    route = await picker(index).pick(request(100), [p0, p1], [d], always)
    assert route.prefill is p1 and route.predicted_cached_tokens == 64
    # one block of 100 tokens (2 x 0.16) does not
    await index.clear_worker("m", "p1")
    await index.apply("m", "p1", [BlockOps(stored=hashes[:1])])
    route = await picker(index).pick(request(100), [p0, p1], [d], always)
    assert route.prefill is p0
    # no prefix anywhere: the lighter worker wins
    route = await picker(index).pick(request(10), [p0, p1], [d], always)
    assert route.prefill is p0 and route.predicted_cached_tokens == 0


async def test_new_prompts_spread_over_equal_prefill_workers() -> None:
    workers = [StandIn("p0", "prefill"), StandIn("p1", "prefill")]
    chooser = picker(MemoryIndex())
    chosen = [(await chooser.pick(request(40), workers, [StandIn("d", "decode")], always)).prefill
              for _ in range(4)]  # fmt: skip
    # Round robin, from a random start (each gateway replica its own).
    assert [w.worker_id for w in chosen if w] in (["p0", "p1"] * 2, ["p1", "p0"] * 2)


async def test_a_later_turn_that_sticks_to_its_holder_does_not_turn_the_rotation() -> None:
    """New prompts go round robin however many sticky turns come between them (with every
    decision turning it, new conversations land at random: bench fleet's spread 1.71)."""
    index = MemoryIndex()
    held = [1000 + t for t in range(100)]
    await index.apply("m", "p2", [BlockOps(stored=block_hashes(held, BS, seed=42))])
    workers = [StandIn(f"p{i}", "prefill") for i in range(4)]
    chooser = picker(index)
    chooser._turns["prefill"] = 0
    sticky = RouteRequest("r", "m", held)
    order = []
    for prompt in (request(40), sticky, request(41), sticky, sticky, request(42)):
        route = await chooser.pick(prompt, workers, [StandIn("d", "decode")], always)
        assert route.prefill is not None
        order.append(route.prefill.worker_id)
    assert order == ["p0", "p2", "p1", "p2", "p2", "p2"]


async def test_conditional_disaggregation_uses_the_decode_workers_cache() -> None:
    index = MemoryIndex()
    hashes = block_hashes(list(range(100)), BS, seed=42)
    await index.apply("m", "d", [BlockOps(stored=hashes)])
    chooser = picker(index, disagg_min_uncached_tokens=32)
    route = await chooser.pick(request(100), [StandIn("p0", "prefill")], [StandIn("d", "decode")],
                               always)  # fmt: skip
    assert route.prefill is None and route.predicted_cached_tokens == 96
    route = await chooser.pick(request(300), [StandIn("p0", "prefill")], [StandIn("d", "decode")],
                               always)  # fmt: skip
    assert route.prefill is not None  # 300 - 96 cached > 32


async def test_a_fuller_kv_cache_weighs_against_a_worker() -> None:
    full, empty = StandIn("p0", "prefill"), StandIn("p1", "prefill")
    full.usage = 0.9
    route = await picker(MemoryIndex()).pick(request(40), [full, empty], [StandIn("d", "decode")],
                                             always)  # fmt: skip
    assert route.prefill is empty


async def test_without_an_index_it_routes_by_load_only() -> None:
    p0, p1 = StandIn("p0", "prefill", in_flight=2), StandIn("p1", "prefill")
    route = await picker(None).pick(request(100), [p0, p1], [StandIn("d", "decode")], always)
    # No index, no prediction (a guess of 0 would count every cache hit as "under").
    assert route.prefill is p1 and route.predicted_cached_tokens is None


class DownIndex:
    async def longest_prefixes(self, *args: Any) -> dict[str, int]:
        raise IndexUnavailable("connection refused")


async def test_with_the_index_down_it_predicts_nothing() -> None:
    choose = picker(DownIndex())
    d = StandIn("d", "decode")
    disaggregated = await choose.pick(request(100), [StandIn("p", "prefill")], [d], always)
    local = await choose.pick(request(100), [], [d], always)
    assert disaggregated.prefill is not None and local.prefill is None
    assert disaggregated.predicted_cached_tokens is None
    assert local.predicted_cached_tokens is None
    assert choose.metrics.index_errors._value.get() == 2


async def test_a_salted_prompt_matches_only_its_own_salts_blocks() -> None:
    index = MemoryIndex()
    ids = list(range(100))
    await index.apply("m", "p1", [BlockOps(stored=block_hashes(ids, BS, seed=42))])
    await index.apply("m", "p2", [BlockOps(stored=block_hashes(ids, BS, seed=42, cache_salt="a"))])
    p1, p2, d = StandIn("p1", "prefill"), StandIn("p2", "prefill"), StandIn("d", "decode")
    chooser = picker(index, hash_seed=42)
    plain = await chooser.pick(RouteRequest("r", "m", ids), [p1, p2], [d], always)
    assert plain.prefill is p1 and plain.predicted_cached_tokens == 96
    salted = await chooser.pick(RouteRequest("r", "m", ids, "a"), [p1, p2], [d], always)
    assert salted.prefill is p2 and salted.predicted_cached_tokens == 96
    other = await chooser.pick(RouteRequest("r", "m", ids, "b"), [p1, p2], [d], always)
    assert other.predicted_cached_tokens == 0
