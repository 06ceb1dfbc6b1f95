"""Cache- and load-aware routing on the Redis prefix index (picker ``prefix``).

For a request it hashes the token ids' full blocks exactly as vLLM does, asks the index in
one round trip how long a prefix each candidate worker holds, and scores every worker::

    score = prefix_weight * cached_share - load_weight * load / (1 + highest load)
            - kv_usage_weight * KV cache usage

The best decode worker is chosen first; if the part of the prompt it does not hold is at
most ``disagg_min_uncached_tokens``, it computes the prompt itself (conditional
disaggregation); otherwise the best compatible prefill worker computes it. Ties go round
robin. With the index unreachable every prefix share is 0: routing by load only.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any, TypeVar

from gateway.errors import NoWorkerAvailable
from gateway.interfaces import CompatibilityCheck
from gateway.offload import Offload
from gateway.pool import DecodeWorker, PrefillWorker, Worker
from gateway.routing import PickerContext, Route, RouteRequest
from pdserve.kvindex.hashing import block_hashes
from pdserve.kvindex.interfaces import IndexUnavailable

log = logging.getLogger(__name__)

W = TypeVar("W", bound=Worker[Any])


def cacheable_tokens(blocks: int, block_size: int, prompt_len: int) -> int:
    """Prompt tokens vLLM serves from a cache holding ``blocks`` leading blocks: whole
    blocks only, and never the last prompt token (it is always recomputed)."""
    return min(blocks * block_size, (prompt_len - 1) // block_size * block_size)


class PrefixPicker:
    name = "prefix"

    def __init__(self, context: PickerContext) -> None:
        self.settings = context.settings
        self.metrics = context.metrics
        self.index = context.index
        self.offload = context.offload or Offload(0)
        self._turns = {"prefill": itertools.count(), "decode": itertools.count()}
        self._index_down = False

    async def pick(
        self,
        request: RouteRequest,
        prefill: Sequence[PrefillWorker],
        decode: Sequence[DecodeWorker],
        compatible: CompatibilityCheck,
    ) -> Route:
        if not decode:
            raise NoWorkerAvailable("no healthy decode worker")
        known = await self._cached_tokens(request, [*prefill, *decode])
        cached = known or {}
        n = len(request.token_ids)
        chosen = self._best(decode, cached, n)
        d_cached = cached.get(chosen.worker_id, 0)
        fits = [p for p in prefill if compatible(p, chosen)]
        # Without the index there is no prediction (None), rather than a guess of 0 tokens.
        if not fits or n - d_cached <= self.settings.disagg_min_uncached_tokens:
            return Route(None, chosen, predicted_cached_tokens=None if known is None else d_cached)
        p = self._best(fits, cached, n)
        predicted = None if known is None else cached.get(p.worker_id, 0)
        return Route(p, chosen, predicted_cached_tokens=predicted)

    def _best(self, workers: Sequence[W], cached: dict[str, int], n: int) -> W:
        top_load = max(w.load() for w in workers)
        s = self.settings

        def score(w: W) -> float:
            share = cached.get(w.worker_id, 0) / max(n, 1)
            busy = w.load() / (1.0 + top_load)
            return s.prefix_weight * share - s.load_weight * busy - s.kv_usage_weight * w.kv_usage()

        start = next(self._turns[workers[0].role_name]) % len(workers)  # ties: round robin
        rotated = [*workers[start:], *workers[:start]]
        return max(rotated, key=score)

    async def _cached_tokens(
        self, request: RouteRequest, workers: Sequence[PrefillWorker | DecodeWorker]
    ) -> dict[str, int] | None:
        """worker id -> prompt tokens its cache would serve (a worker not named: none);
        None when the index cannot tell (no index, or it is unreachable)."""
        sizes = {w.capabilities.block_size for w in workers if w.capabilities}
        if self.index is None or len(sizes) != 1 or not request.token_ids:
            return None
        block_size = sizes.pop()
        hashes = await self.offload.run(
            block_hashes, request.token_ids, block_size, self.settings.hash_seed
        )
        if not hashes:
            return {}
        started = time.monotonic()
        try:
            blocks = await self.index.longest_prefixes(
                request.model, hashes, [w.worker_id for w in workers]
            )
        except IndexUnavailable as exc:
            self.metrics.index_errors.inc()
            if not self._index_down:
                log.warning("prefix index unavailable (%s); routing by load only", exc)
            self._index_down = True
            return None
        self._index_down = False
        self.metrics.index_lookup_seconds.observe(time.monotonic() - started)
        n = len(request.token_ids)
        return {w: cacheable_tokens(b, block_size, n) for w, b in blocks.items()}
