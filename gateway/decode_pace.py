"""What this gateway has measured of one decode worker, for the choice of where a prompt is
computed (``gateway.routing.split``): the time of one decode step as its streams see it (the
gap between their tokens), how long a hand-off takes (from the prefill worker's answer to the
decode worker's first token: the KV pull and a first step), and how long answers are.
Each is an exponentially weighted mean of this gateway's own observations; 0 until the first.
How fast the worker computes a prompt itself is its ``PrefillPace`` (``Worker.pace``).
"""

from __future__ import annotations

from dataclasses import dataclass

EWMA_WEIGHT = 0.1  # weight of a new sample: a step time is noisy, one per token


def _mean(old: float, sample: float) -> float:
    return sample if old <= 0 else old + EWMA_WEIGHT * (sample - old)


@dataclass
class DecodePace:
    step_s: float = 0.0  # seconds between two tokens of one stream
    handoff_s: float = 0.0  # prefill answered -> first token on this worker
    answer_tokens: float = 0.0  # tokens of a finished answer

    def stepped(self, seconds: float) -> None:
        if seconds > 0:
            self.step_s = _mean(self.step_s, seconds)

    def handed_off(self, seconds: float) -> None:
        if seconds > 0:
            self.handoff_s = _mean(self.handoff_s, seconds)

    def answered(self, tokens: int) -> None:
        if tokens > 0:
            self.answer_tokens = _mean(self.answer_tokens, float(tokens))
