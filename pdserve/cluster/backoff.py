"""The wait before restarting a child that exited: exponential, capped, and forgiven once the
child has run well for a while (so that one crash a day never waits the cap)."""

from __future__ import annotations

from dataclasses import dataclass

# 2**64 times any sane initial wait is past every cap; a larger exponent would overflow a float.
_MAX_DOUBLINGS = 64


@dataclass(frozen=True)
class Backoff:
    initial_s: float = 1.0  # before the first restart in a row
    max_s: float = 30.0  # the cap
    reset_after_s: float = 60.0  # ready this long: the next exit counts as the first in a row

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError(f"need 0 < initial_s <= max_s, got {self.initial_s}, {self.max_s}")
        if self.reset_after_s < 0:
            raise ValueError(f"reset_after_s must be >= 0, got {self.reset_after_s}")

    def delay(self, in_a_row: int) -> float:
        """Seconds before restart number ``in_a_row`` (1 = the first since the child was stable):
        ``initial_s`` doubled ``in_a_row - 1`` times, at most ``max_s``."""
        if in_a_row < 1:
            raise ValueError(f"in_a_row counts from 1, got {in_a_row}")
        doublings = min(in_a_row - 1, _MAX_DOUBLINGS)
        return float(min(self.max_s, self.initial_s * 2.0**doublings))

    def is_stable(self, ready_for_s: float | None) -> bool:
        """Whether a child that was ready for ``ready_for_s`` (None: never) resets the count."""
        return ready_for_s is not None and ready_for_s >= self.reset_after_s
