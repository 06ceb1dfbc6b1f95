"""How many cores prefill and decode need: a DistServe-style balance of the two phases.

A request costs the prefill side ``input_len / prefill_tokens_per_s`` core-seconds (prefill is
compute-bound: its rate grows with the cores an engine gets) and the decode side one engine
slot for ``output_len`` steps. A decode engine of one core running ``batch`` requests at
``decode_tokens_per_s`` (tokens of the whole batch) finishes ``decode_tokens_per_s /
output_len`` requests per second. With ``prefill`` cores for prefill and ``decode`` one-core
decode engines, the cluster serves ``min(prefill * mu_p, decode * mu_d)`` requests/s; the best
split of ``cores`` maximises it, i.e. puts the two phases in the ratio ``mu_d : mu_p``.

The rates are measured, per core, by ``pdserve bench engine`` on the machine at hand (its
``--json`` report: ``load_rates``); without one, the figures measured on a CPU of the same
class (``MEASURED``). ``pdserve up`` gives its prefill engines ``prefill_cores`` of the
machine's cores and its decode engines the rest (``--cpu-split``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.placement.engines import format_cores, parse_cores


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


@dataclass(frozen=True)
class Rates:
    """One core's prefill tokens/s and one one-core decode engine's tokens/s (the whole batch),
    and where the figures come from."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    source: str


# pdserve bench engine --cores 1 on the machines of docs/benchmarks.md ("Engine speed"), the bare
# engine: with native bf16 kernels (AMD EPYC, AVX-512 BF16, bfloat16, 2026-11-27) and without
# (AMD EPYC, AVX2 only, float32, 2026-11-24). Decode at batch 4.
MEASURED = {
    True: Rates(640.0, 122.0, "measured on an AVX-512 BF16 EPYC core (docs/benchmarks.md)"),
    False: Rates(279.0, 48.0, "measured on an AVX2-only EPYC core (docs/benchmarks.md)"),
}


def rates_from_report(report: dict[str, Any], source: str) -> Rates:
    """The rates of a ``pdserve bench engine --json`` report: its bare engines' (the prefill
    role's prefill, the decode role's decode, each the other's where only one ran), prefill per
    core of the report's ``--cores``, decode as measured. ValueError when it has neither."""
    results = report.get("results", {})
    prefill = results.get("vllm_prefill") or results.get("vllm_decode") or {}
    decode = results.get("vllm_decode") or prefill
    try:
        cores = len(parse_cores(str(report.get("cores", "0"))))
        return Rates(
            float(prefill["prefill_tokens_per_s"]) / cores,
            float(decode["decode_tokens_per_s"]),
            source,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(
            f"{source}: not a pdserve bench engine --json report with a bare engine's prefill "
            "and decode tokens/s"
        ) from exc


def load_rates(path: str, native_bf16: bool) -> Rates:
    """The rates in the report at ``path``, or (``path`` empty) those measured on a CPU like
    this one (``MEASURED``). ValueError when the file cannot be used."""
    if not path:
        return MEASURED[native_bf16]
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the engine rates in {path}: {exc}") from exc
    return rates_from_report(report if isinstance(report, dict) else {}, path)


def prefill_cores(
    cores: int, prefill_engines: int, decode_engines: int, workload: tuple[int, int], rates: Rates
) -> int:
    """How many of ``cores`` the prefill engines get: ``best_split``'s for ``workload``
    (prompt tokens, output tokens), with at least one core for every engine of either role;
    all or none without engines of both roles. ValueError with fewer cores than engines."""
    if cores < prefill_engines + decode_engines:
        raise ValueError(f"{prefill_engines + decode_engines} engines need {cores}+ cores")
    if not prefill_engines or not decode_engines:
        return cores if prefill_engines else 0
    best = best_split(cores, *workload, rates.prefill_tokens_per_s, rates.decode_tokens_per_s)
    return max(prefill_engines, min(best.prefill_cores, cores - decode_engines))


def parse_workload(text: str) -> tuple[int, int]:
    """``"512:64"`` -> (512, 64): prompt and output tokens; ValueError otherwise."""
    first, colon, second = text.partition(":")
    if not (colon and first.strip().isdigit() and second.strip().isdigit()):
        raise ValueError(f"not a workload: {text!r} (prompt tokens:output tokens, e.g. 512:64)")
    prompt, output = int(first), int(second)
    if prompt < 1 or output < 1:
        raise ValueError(f"not a workload: {text!r} (both counts must be at least 1)")
    return prompt, output


def describe(cores: Sequence[int], to_prefill: int, workload: str, rates: Rates) -> str:
    """One line on a split of ``cores``: the first ``to_prefill`` to prefill, the rest to decode."""
    ordered = sorted(cores)
    prompt, output = parse_workload(workload)
    return (
        f"cores {format_cores(ordered[:to_prefill])} for the prefill engines, "
        f"{format_cores(ordered[to_prefill:])} for the decode engines: the split that serves "
        f"the most {prompt}-in/{output}-out requests (a core per engine at least), from prefill "
        f"at {rates.prefill_tokens_per_s:g} tokens/s a core and decode at "
        f"{rates.decode_tokens_per_s:g}, {rates.source} (--cpu-split even: as many per engine)"
    )
