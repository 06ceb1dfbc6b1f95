"""Cache- and load-aware routing on the Redis prefix index (picker ``prefix``).

For a request it hashes the token ids' full blocks exactly as vLLM does, asks the index in
one round trip how long a prefix each candidate worker, and each shared KV tier of one
(``gateway.routing.kv_tier``), holds, and scores every worker::

    score = prefix_weight * cached_share - load_weight * load / (1 + highest load)
            - kv_usage_weight * KV cache usage

where ``cached_share`` counts the tokens of the worker's own cache fully and those only its
tier adds at ``tier_hit_weight`` each; the worker is predicted to be served the larger of
the two.

The best decode worker is chosen first; if the part of the prompt it does not hold is at
most ``disagg_min_uncached_tokens``, it computes the prompt itself (conditional
disaggregation); otherwise the best compatible prefill worker computes it. Ties go round
robin, from a random start per gateway (``random_turn``); the rotation moves on after a tie,
not after a later turn that sticks to its holder. With the index unreachable every
prefix share is 0: routing by load only. ``load`` counts the requests of every gateway replica
(``gateway.shared_load``) plus what the engine queues (``Worker.load``).
"""

from __future__ import annotations

import itertools
import logging
import math
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from gateway.errors import NoWorkerAvailable
from gateway.offload import Offload
from gateway.pool import DecodeWorker, PrefillWorker, Worker
from gateway.routing.interfaces import CompatibilityCheck, Route, RouteRequest
from gateway.routing.kv_tier import TierFeedback, TierIndex, tier_of, tier_tokens
from gateway.routing.registry import PickerContext, register
from pdserve.kvindex.hashing import block_hashes
from pdserve.kvindex.interfaces import IndexUnavailable

log = logging.getLogger(__name__)

W = TypeVar("W", bound=Worker[Any])
# Prompts up to this long are hashed on the event loop (about 0.1 ms for 1,000 tokens: less
# than a round trip through gateway.offload's threads); longer ones in a thread.
INLINE_HASH_TOKENS = 4096


def cacheable_tokens(blocks: int, block_size: int, prompt_len: int) -> int:
    """Prompt tokens vLLM serves from a cache holding ``blocks`` leading blocks: whole
    blocks only, and never the last prompt token (it is always recomputed)."""
    return min(blocks * block_size, (prompt_len - 1) // block_size * block_size)


@dataclass(frozen=True)
class Cached:
    """Prompt tokens a worker would not compute: served by its own cache, by its tier."""

    own: int = 0
    tier: int = 0

    @property
    def tokens(self) -> int:
        """What vLLM would report: the tier is asked only beyond the local hit."""
        return max(self.own, self.tier)

    def weighted(self, tier_hit_weight: float) -> float:
        return self.own + tier_hit_weight * max(0, self.tier - self.own)


@dataclass(frozen=True)
class Lookup:
    # worker -> its prediction (a worker not named: nothing); keyed by the worker object, not
    # its id: scoring looks every candidate up, and reading 256 ids was a third of its time
    cached: dict[Worker[Any], Cached]
    feedback: TierFeedback | None = None


def random_turn() -> int:
    """Where a gateway replica starts its tie-break rotation: each at its own place, so
    replicas with the same view of the workers do not pick the same one in lock step."""
    return secrets.randbelow(1 << 16)


@register("prefix")
class PrefixPicker:
    name = "prefix"

    def __init__(self, context: PickerContext) -> None:
        self.settings = context.settings
        self.metrics = context.metrics
        self.index = context.index
        self.offload = context.offload or Offload(0)
        self.tiers = (
            None
            if context.index is None
            else TierIndex(context.index, context.metrics, context.settings.tier_index_max_blocks)
        )
        # Ties go round robin from a random start: gateway replicas with the same view of
        # the workers do not all pick the same one at once.
        self._turns = {"prefill": random_turn(), "decode": random_turn()}
        self._index_down = False

    async def close(self) -> None:
        if self.tiers is not None:
            await self.tiers.close()

    async def pick(
        self,
        request: RouteRequest,
        prefill: Sequence[PrefillWorker],
        decode: Sequence[DecodeWorker],
        compatible: CompatibilityCheck,
    ) -> Route:
        if not decode:
            raise NoWorkerAvailable("no healthy decode worker")
        known = await self._lookup(request, [*prefill, *decode])
        cached = known.cached if known else {}
        feedback = known.feedback if known else None
        n = len(request.token_ids)
        lora = request.lora[0] if request.lora else None
        chosen = self._best(decode, cached, n, lora)
        d_cached = cached.get(chosen, Cached()).tokens
        fits = [p for p in prefill if compatible(p, chosen)]
        # Without the index there is no prediction (None), rather than a guess of 0 tokens.
        if not fits or n - d_cached <= self.settings.disagg_min_uncached_tokens:
            predicted = None if known is None else d_cached
            return Route(None, chosen, predicted_cached_tokens=predicted, feedback=feedback)
        p = self._best(fits, cached, n, lora)
        predicted = None if known is None else cached.get(p, Cached()).tokens
        d_predicted = None if known is None else d_cached
        return Route(p, chosen, predicted, feedback, decode_cached_tokens=d_predicted)

    def _best(
        self, workers: Sequence[W], cached: dict[Worker[Any], Cached], n: int, lora: str | None
    ) -> W:
        """The best-scoring worker; ties go to the first from this role's turn on. The turn
        moves on only after a tie, so new prompts go round robin however many later turns
        stick to their holders between them. ``lora``: the request's adapter, which scores
        where it is resident."""
        s = self.settings
        loads = [w.load() for w in workers]
        scale = 1.0 + max(loads)
        role = workers[0].role_name
        turn, count = self._turns[role], len(workers)
        # the few workers that hold something; every other one's share is 0
        shares = {w: c.weighted(s.tier_hit_weight) / max(n, 1) for w, c in cached.items()}
        prefix_weight, load_weight, kv_weight = s.prefix_weight, s.load_weight, s.kv_usage_weight
        best, best_score, tied = workers[0], -math.inf, 0
        first = turn % count
        for i in itertools.chain(range(first, count), range(first)):
            w = workers[i]
            score = (prefix_weight * shares.get(w, 0.0) - load_weight * loads[i] / scale
                     - kv_weight * w.kv_usage())  # fmt: skip
            if lora is not None and w.holds_lora(lora):
                score += s.lora_residency_weight
            if score > best_score:
                best, best_score, tied = w, score, 1
            elif score == best_score:
                tied += 1
        if tied > 1:
            self._turns[role] = turn + 1
        return best

    async def _lookup(
        self, request: RouteRequest, workers: Sequence[PrefillWorker | DecodeWorker]
    ) -> Lookup | None:
        """What each worker's caches would serve of the prompt; None when the index cannot
        tell (no index, or it is unreachable)."""
        sizes = {w.capabilities.block_size for w in workers if w.capabilities}
        if self.index is None or self.tiers is None or len(sizes) != 1 or not request.token_ids:
            return None
        block_size = sizes.pop()
        seed = self.settings.hash_seed
        args = (request.token_ids, block_size, seed, request.cache_salt, request.lora)
        # A short prompt's hashes take less than handing them to a thread and back.
        if len(request.token_ids) <= INLINE_HASH_TOKENS:
            hashes = block_hashes(*args)
        else:
            hashes = await self.offload.run(block_hashes, *args)
        if not hashes:
            return Lookup({})
        ids = [w.worker_id for w in workers]
        tiers = {i: t for i, w in zip(ids, workers, strict=True) if (t := tier_of(w, block_size))}
        holders = sorted({t.holder for t in tiers.values()})
        started = time.monotonic()
        try:
            blocks = await self.index.longest_prefixes(request.model, hashes, [*ids, *holders])
        except IndexUnavailable as exc:
            self.metrics.index_errors.inc()
            if not self._index_down:
                log.warning("prefix index unavailable (%s); routing by load only", exc)
            self._index_down = True
            return None
        self._index_down = False
        self.metrics.index_lookup_seconds.observe(time.monotonic() - started)
        n = len(request.token_ids)
        cached: dict[Worker[Any], Cached] = {}  # only workers that hold something
        pairs = zip(workers, ids, strict=True)
        if not tiers:  # the usual case: a worker's own cache only
            for worker, worker_id in pairs:
                if own := blocks.get(worker_id, 0):
                    cached[worker] = Cached(cacheable_tokens(own, block_size, n))
            return Lookup(cached)
        for worker, worker_id in pairs:
            tier = tiers.get(worker_id)
            own = blocks.get(worker_id, 0)
            from_tier = blocks.get(tier.holder, 0) if tier else 0
            if own or from_tier:
                cached[worker] = Cached(
                    cacheable_tokens(own, block_size, n),
                    tier_tokens(from_tier, block_size, tier.chunk, n) if tier else 0,
                )
        held = {h: blocks.get(h, 0) for h in holders}
        return Lookup(cached, TierFeedback(self.tiers, request.model, hashes, block_size, n, held))
