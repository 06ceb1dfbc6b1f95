"""How many cores prefill and decode need: a DistServe-style balance of the two phases.

A request costs the prefill side ``input_len / prefill_tokens_per_s`` core-seconds (prefill is
compute-bound: its rate grows with the cores an engine gets) and the decode side one engine
slot for ``output_len`` steps. A decode engine of one core running ``batch`` requests at
``decode_tokens_per_s`` (tokens of the whole batch) finishes ``decode_tokens_per_s /
output_len`` requests per second. With ``prefill`` cores for prefill and ``decode`` one-core
decode engines, the cluster serves ``min(prefill * mu_p, decode * mu_d)`` requests/s; the best
split of ``cores`` maximises it, i.e. puts the two phases in the ratio ``mu_d : mu_p``.

The rates are measured, per core, by ``pdserve bench engine`` on the machine at hand; the
figures for this project's development machine are in docs/benchmarks.md.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Split:
    prefill_cores: int
    decode_engines: int
    requests_per_s: float  # what the split sustains (the slower phase's capacity)
    bound: str  # "prefill" or "decode": which phase limits it


def best_split(
    cores: int,
    input_len: int,
    output_len: int,
    prefill_tokens_per_s: float,
    decode_tokens_per_s: float,
) -> Split:
    """The split of ``cores`` (at least one of each) that serves the most requests/s."""
    if cores < 2:
        raise ValueError("disaggregation needs at least 2 cores (one per phase)")
    mu_p = prefill_tokens_per_s / input_len  # requests/s per prefill core
    mu_d = decode_tokens_per_s / output_len  # requests/s per decode engine (one core)
    best: Split | None = None
    for p in range(1, cores):
        d = cores - p
        rate = min(p * mu_p, d * mu_d)
        split = Split(p, d, rate, "prefill" if p * mu_p <= d * mu_d else "decode")
        if best is None or rate > best.requests_per_s:
            best = split
    assert best is not None
    return best
