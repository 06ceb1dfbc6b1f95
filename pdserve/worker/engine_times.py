"""Where a request's time went inside the engine: vLLM's request statistics as phases.

vLLM records, per request, when it entered the engine core's queue, when it was first
scheduled, and when its first and last tokens came out (``RequestOutput.metrics``, monotonic
engine-core clock). A worker turns them into ``EngineTimes`` (sent back to the gateway for
its per-phase histograms) and, while tracing is on, into child spans of its RPC's span.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.telemetry import tracing
from protos.v1 import common_pb2


@dataclass(frozen=True)
class EnginePhases:
    """Monotonic timestamps (seconds); 0: not recorded (vLLM's stats off, or not reached)."""

    queued: float = 0.0
    scheduled: float = 0.0
    first_token: float = 0.0
    last_token: float = 0.0

    @classmethod
    def of(cls, output: Any) -> EnginePhases:
        stats = getattr(output, "metrics", None)
        if stats is None or not hasattr(stats, "queued_ts"):
            return cls()
        return cls(
            float(stats.queued_ts),
            float(stats.scheduled_ts),
            float(stats.first_token_ts),
            float(stats.last_token_ts),
        )

    @property
    def recorded(self) -> bool:
        return bool(self.queued and self.scheduled)

    def _spans(self) -> list[tuple[str, float, float]]:
        phases = [
            ("engine.queue", self.queued, self.scheduled),
            ("engine.prefill", self.scheduled, self.first_token),
            ("engine.decode", self.first_token, self.last_token),
        ]
        return [(name, a, b) for name, a, b in phases if a and b > a]

    def message(self) -> common_pb2.EngineTimes | None:
        """The phases for the gateway; None when vLLM recorded none."""
        if not self.recorded:
            return None
        seconds = {name: b - a for name, a, b in self._spans()}
        return common_pb2.EngineTimes(
            queue_seconds=seconds.get("engine.queue", 0.0),
            prefill_seconds=seconds.get("engine.prefill", 0.0),
            decode_seconds=seconds.get("engine.decode", 0.0),
        )

    def trace(self) -> None:
        """Child spans of the current span, one per phase the engine went through."""
        if not tracing.enabled():
            return
        for name, start, end in self._spans():
            span = tracing.start_span(name, start_time=tracing.monotonic_to_epoch(start))
            tracing.end_at(span, tracing.monotonic_to_epoch(end))
