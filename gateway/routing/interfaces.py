"""What a picker sees and returns, and the protocols of routing plugins.

- ``Picker``: chooses the prefill and decode worker of one request (registered by name in
  ``gateway.routing.registry``).
- ``RouteFeedback``: what a picker learns once a routed prompt was computed (the prefix
  picker keeps the shared KV tier's index entries with it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.pool import DecodeWorker, PrefillWorker, Worker


@dataclass(frozen=True)
class RouteRequest:
    """What a picker may base its choice on."""

    request_id: str
    model: str
    token_ids: Sequence[int]
    cache_salt: str | None = None  # its KV is shared only with requests of the same salt
    lora: tuple[str, str] | None = None  # its LoRA adapter (name, path): its KV is the adapter's


class RouteFeedback(Protocol):
    """Carried by a ``Route`` (``feedback``) back to its picker, about the routed prompt only
    (not a migration's longer one)."""

    def computed(self, worker: Worker[Any], cached_tokens: int) -> None:
        """``worker`` computed the prompt and reported ``cached_tokens`` of it served from its
        caches (vLLM's own and its KV tier). Called once per computation (a prefill worker's
        answer; the decode worker's finish on the local path); must not block: any I/O goes
        to the background."""
        ...


PREFILL_WORKER = "prefill_worker"
DECODE_WORKER = "decode_worker"


@dataclass(frozen=True)
class Split:
    """A choice and what it was based on (seconds; None: not predicted)."""

    where: str  # PREFILL_WORKER or DECODE_WORKER
    reason: str
    ttft_prefill_s: float | None = None
    ttft_local_s: float | None = None
    stall_s: float | None = None
    streams: int = 0

    @property
    def predicted_ttft_s(self) -> float | None:
        return self.ttft_local_s if self.where == DECODE_WORKER else self.ttft_prefill_s

    def __str__(self) -> str:
        return f"{self.where}:{self.reason}"


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
    # What the decode worker's caches would serve (None: no prediction): for the choice of
    # where the prompt is computed (gateway.routing.split), which it records here.
    decode_cached_tokens: int | None = None
    split: Split | None = None


class CompatibilityCheck(Protocol):
    def __call__(self, prefill: PrefillWorker, decode: DecodeWorker) -> bool: ...


class Picker(Protocol):
    """Chooses workers for one request.

    ``pick`` gets only healthy workers (the pool filters first) and a ``compatible(p, d)``
    predicate that is False when the two workers' ``kv_compat`` differ: a picker must never
    return such a pair. It returns a ``Route``: ``prefill`` None means the decode worker
    computes the prompt itself ("local" path, e.g. no prefill worker fits or the uncached part
    is short). ``decode`` is never empty in the input; raising ``NoWorkerAvailable`` is how a
    picker refuses. ``pick`` may await (e.g. a Redis lookup) but should not take long: it runs
    before every request's first token.
    """

    name: str

    async def pick(
        self,
        request: RouteRequest,
        prefill: Sequence[PrefillWorker],
        decode: Sequence[DecodeWorker],
        compatible: CompatibilityCheck,
    ) -> Route: ...

    async def close(self) -> None:
        """Let background work (index writes) finish; called once when the gateway stops."""
        ...
