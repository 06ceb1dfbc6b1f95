"""The ``round_robin`` picker: no index, no load; the default without Redis."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from gateway.errors import NoWorkerAvailable
from gateway.pool import DecodeWorker, PrefillWorker
from gateway.routing.interfaces import CompatibilityCheck, Route, RouteRequest
from gateway.routing.registry import PickerContext, register


@register("round_robin")
class RoundRobinPicker:
    """Decode workers in turn; for the chosen one, the compatible prefill workers in turn."""

    name = "round_robin"

    def __init__(self, context: PickerContext | None = None) -> None:
        self._decode_turn = itertools.count()
        self._prefill_turn = itertools.count()

    async def pick(
        self,
        request: RouteRequest,
        prefill: Sequence[PrefillWorker],
        decode: Sequence[DecodeWorker],
        compatible: CompatibilityCheck,
    ) -> Route:
        if not decode:
            raise NoWorkerAvailable("no healthy decode worker")
        chosen = decode[next(self._decode_turn) % len(decode)]
        fits = [p for p in prefill if compatible(p, chosen)]
        if not fits:
            return Route(prefill=None, decode=chosen)
        return Route(prefill=fits[next(self._prefill_turn) % len(fits)], decode=chosen)

    async def close(self) -> None:
        """Nothing runs in the background."""
