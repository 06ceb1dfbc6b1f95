"""Routing: what a picker sees and returns, the built-in pickers, and their registry."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.config import GatewaySettings
from gateway.errors import NoWorkerAvailable
from gateway.interfaces import CompatibilityCheck, Picker, RouteFeedback
from gateway.metrics import GatewayMetrics
from gateway.offload import Offload
from gateway.pool import DecodeWorker, PrefillWorker
from pdserve.kvindex.interfaces import PrefixIndex


@dataclass(frozen=True)
class RouteRequest:
    """What a picker may base its choice on."""

    request_id: str
    model: str
    token_ids: Sequence[int]


@dataclass(frozen=True)
class Route:
    """The chosen workers; ``prefill`` None: the decode worker computes the prompt.

    ``predicted_cached_tokens``: what the picker expects the computing worker's caches (its
    own and its shared KV tier) to serve (None: no prediction); compared with what the worker
    reports. ``feedback``: told what computing the prompt showed (None: the picker learns
    nothing from it).
    """

    prefill: PrefillWorker | None
    decode: DecodeWorker
    predicted_cached_tokens: int | None = None
    feedback: RouteFeedback | None = None


@dataclass(frozen=True)
class PickerContext:
    """What a picker factory may use."""

    settings: GatewaySettings
    metrics: GatewayMetrics
    index: PrefixIndex | None = None
    # Where CPU-heavy steps (block hashing) run, off the event loop; None: inline.
    offload: Offload | None = None


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


def _prefix_picker(context: PickerContext) -> Picker:
    from gateway.prefix_routing import PrefixPicker

    return PrefixPicker(context)


# Name -> factory; GatewaySettings.picker selects one.
PICKERS: dict[str, Callable[[PickerContext], Picker]] = {
    RoundRobinPicker.name: RoundRobinPicker,
    "prefix": _prefix_picker,
}


def make_picker(name: str, context: PickerContext) -> Picker:
    return PICKERS[name](context)
