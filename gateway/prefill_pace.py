"""Deadlines of Prefill calls that follow the worker's queue and the prompt's length.

A fixed deadline turns a prefill that is merely queued into a timeout, and the fallback then
computes the same prompt a second time on the decode worker: under load the system amplifies
its own load. Instead each prefill worker keeps, in this gateway, the prompt tokens it has
been sent and not yet answered (``queued_tokens``) and the rate at which it answers them
(``tokens_per_s``, measured): a new prefill's deadline is ``slack`` times the time the worker
needs for everything ahead of it plus its own prompt, and never less than ``floor_s``.

The rate is measured the same way: a prefill that had ``ahead`` tokens in front of it
(its own included) when it was sent and was answered ``seconds`` later is a sample of
``ahead / seconds``; the worker serves its queue in order, so this holds with a queue too.
"""

from __future__ import annotations

from dataclasses import dataclass

EWMA_WEIGHT = 0.3  # weight of a new rate sample


@dataclass
class PrefillPace:
    """One prefill worker's queue and rate, as this gateway sees them."""

    queued_tokens: int = 0
    tokens_per_s: float = 0.0  # 0: not measured yet

    def expected_s(self, tokens: int) -> float:
        """Seconds until a prompt of ``tokens`` sent now is answered (0 when unknown)."""
        if self.tokens_per_s <= 0:
            return 0.0
        return (self.queued_tokens + tokens) / self.tokens_per_s

    def deadline_s(self, tokens: int, floor_s: float, slack: float) -> float:
        return max(floor_s, slack * self.expected_s(tokens))

    def sent(self, tokens: int) -> int:
        """Count a prefill of ``tokens`` as queued; returns the tokens ahead of it (its own
        included), to pass to ``answered``."""
        self.queued_tokens += tokens
        return self.queued_tokens

    def answered(self, tokens: int, ahead: int, seconds: float, ok: bool) -> None:
        """The prefill left the queue; a successful one is a rate sample."""
        self.queued_tokens = max(0, self.queued_tokens - tokens)
        if not ok or seconds <= 0 or ahead <= 0:
            return
        sample = ahead / seconds
        if self.tokens_per_s <= 0:
            self.tokens_per_s = sample
        else:
            self.tokens_per_s += EWMA_WEIGHT * (sample - self.tokens_per_s)
