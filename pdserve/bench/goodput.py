"""Goodput under SLOs, as DistServe measures it: vllm serve, static and adaptive pdserve.

Three systems, each started in turn on the same cores (``pdserve.bench.systems``): the
monolith ``vllm serve`` (``vllm``), pdserve with its gateway's static disaggregation policy
(``pdserve-static``: ``PDSERVE_GATEWAY_DISAGG_POLICY=static``) and with its adaptive one
(``pdserve``: ``adaptive``); both pdserve gateways also get the base SLO
(``PDSERVE_GATEWAY_SLO_TTFT_MS`` / ``_TPOT_MS``), which the adaptive policy steers by.

Each system gets one ``vllm bench serve`` run per request rate: ``random`` prompts of
``--input-len`` / ``--output-len`` tokens varied by ``--range-ratio``, arriving as a Poisson
process (vLLM's ``--request-rate``; ``--burstiness`` 1) with no cap on requests in flight
unless ``--concurrency`` sets one. Every run is then scored against the SLO pair multiplied by
each of ``--slo-scales`` (``pdserve.bench.goodput_report``: vLLM's ``--goodput`` rule).

The base SLO pair is ``--slo-ttft-ms`` / ``--slo-tpot-ms``, or else derived before the first
round as the issue defines it (TTFT: twice the bare engine's prefill of the mean prompt; TPOT:
1.5 times its decode step at batch 4) from a calibration of the monolith started on its own:
4 mean-length prompts one at a time (their median TTFT is the prefill) and then 4 at once
(the median gap between their tokens is the decode step at batch 4).

``--rounds`` repeat every system, the order alternating; figures are the medians over rounds.
Writes results.json (machine, settings, SLO, every run, the medians), prints a goodput table
and a latency table, and plots goodput against the rate and against the SLO scale.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pdserve.bench import goodput_report as report
from pdserve.bench import systems as bench_systems
from pdserve.bench.report import Slo
from pdserve.placement import machine

# name -> (the server bench serve starts, the gateway's disaggregation policy)
SYSTEMS = {"vllm": ("vllm", ""), "pdserve-static": ("pdserve", "static"),
           "pdserve": ("pdserve", "adaptive")}  # fmt: skip
SCALES = "0.5,0.75,1,1.5,2,3,4"
CALIBRATION_PROMPTS = 4  # the "decode step at batch 4"
CALIBRATION_SEED = 1000  # added to --seed: prompts no rate point sends (no prefix-cache hits)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="", help="model directory (default: prepared)")
    parser.add_argument("--gpus", default="", help="GPUs to use, e.g. '0' (default: all)")
    parser.add_argument("--engine-args", default="", help="vLLM engine arguments of all")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, in order")
    parser.add_argument(
        "--prefill", type=int, default=0, help="pdserve prefill workers (0: up's default)"
    )
    parser.add_argument(
        "--decode", type=int, default=0, help="pdserve decode workers (0: up's default)"
    )
    parser.add_argument("--request-rates", default="0.2,0.35,0.5", help="requests/s, comma list")
    parser.add_argument("--burstiness", type=float, default=1.0, help="vLLM's; 1: Poisson")
    parser.add_argument("--num-prompts", type=int, default=32, help="requests per rate point")
    parser.add_argument("--concurrency", type=int, default=0, help="cap in flight (0: none)")
    parser.add_argument("--input-len", type=int, default=512, help="mean prompt tokens")
    parser.add_argument("--output-len", type=int, default=64, help="mean answer tokens")
    parser.add_argument(
        "--range-ratio", type=float, default=0.5,
        help="lengths drawn from len*(1-r) to len*(1+r), in and out (vLLM's --random-range-ratio)",
    )  # fmt: skip
    parser.add_argument("--slo-ttft-ms", type=float, default=0, help="0: derived (calibration)")
    parser.add_argument("--slo-tpot-ms", type=float, default=0, help="0: derived (calibration)")
    parser.add_argument("--slo-scales", default=SCALES, help="multiples of the SLO pair scored")
    parser.add_argument("--rounds", type=int, default=1, help="each system in turn, alternating")
    parser.add_argument(
        "--vllm-engine-sched", choices=("normal", "idle"), default="normal",
        help="idle: vllm serve's engine processes in the SCHED_IDLE class, as pdserve's are",
    )  # fmt: skip
    parser.add_argument("--port", type=int, default=8700, help="first of the ports used")
    parser.add_argument("--out", default="", help="result directory (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=0)


def floats(text: str, flag: str) -> list[float]:
    """A comma list of numbers, each above 0 and finite; ValueError naming ``flag`` else."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be numbers separated by commas, not {text!r}") from None
    if not values:
        raise ValueError(f"{flag} is empty")
    if not all(v > 0 and math.isfinite(v) for v in values):
        raise ValueError(f"{flag} must all be above 0 and finite: {text}")
    return values


def settings_problem(args: argparse.Namespace) -> str:
    """What is wrong with the settings, before anything starts ("" when nothing)."""
    try:
        floats(args.request_rates, "--request-rates")
        floats(args.slo_scales, "--slo-scales")
    except ValueError as exc:
        return str(exc)
    systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems or len(set(systems)) != len(systems):
        return f"--systems must name each of {', '.join(SYSTEMS)} at most once: {args.systems!r}"
    checks = (
        (args.rounds < 1, "--rounds must be at least 1"),
        (args.num_prompts < 1, "--num-prompts must be at least 1"),
        (args.input_len < 1 or args.output_len < 1, "--input-len and --output-len must be >= 1"),
        (args.concurrency < 0, "--concurrency must be 0 (no cap) or more"),
        (not args.burstiness > 0, "--burstiness must be above 0"),
        (not 0 <= args.range_ratio < 1, "--range-ratio must be in [0, 1)"),
        (args.slo_ttft_ms < 0 or args.slo_tpot_ms < 0, "--slo-ttft-ms/--slo-tpot-ms must be >= 0"),
        ((args.slo_ttft_ms > 0) != (args.slo_tpot_ms > 0),
         "give both --slo-ttft-ms and --slo-tpot-ms, or neither (both derived)"),
    )  # fmt: skip
    return next((problem for bad, problem in checks if bad), "")


def derive_slo(alone: dict[str, Any], batched: dict[str, Any]) -> tuple[Slo, dict[str, float]]:
    """The base SLO from the calibration's two runs (vLLM's saved results): TTFT 2 x the
    median TTFT of the prompts sent one at a time (the prefill of a mean-length prompt), TPOT
    1.5 x the median gap between tokens of the prompts sent at once (the decode step at batch
    4). Also those two measurements in ms. RuntimeError when a run has nothing to measure."""
    ttfts = [alone["ttfts"][i] for i in report.ok(alone)]
    gaps = [gap for i in report.ok(batched) for gap in batched["itls"][i]]
    if not ttfts or not gaps:
        raise RuntimeError("the calibration's requests failed: no SLO can be derived from them")
    prefill, step = report.median(ttfts), report.median(gaps)
    return Slo(ttft_s=2 * prefill, tpot_s=1.5 * step), {
        "prefill_ms": prefill * 1000, "decode_step_batch4_ms": step * 1000}  # fmt: skip


def calibrate(
    args: argparse.Namespace, model: str, name: str, out: Path
) -> tuple[Slo, dict[str, float]]:
    """The monolith started on its own, ``derive_slo``'s two runs through it, stopped."""
    runs = {}
    with bench_systems.server("vllm", args, model, name, out) as url:
        for label, concurrency in (("alone", 1), ("batch", CALIBRATION_PROMPTS)):
            settings = argparse.Namespace(**{
                **vars(args), "concurrency": concurrency, "num_prompts": CALIBRATION_PROMPTS,
                "range_ratio": 0.0, "request_rate": 0.0,
                "seed": args.seed + CALIBRATION_SEED + concurrency})  # fmt: skip
            print(f"  [calibration] {CALIBRATION_PROMPTS} prompts, {concurrency} at a time ...",
                  flush=True)  # fmt: skip
            got = bench_systems.run_workload(
                "random", f"calibrate-{label}", url, settings, model, name, out
            )
            runs[label] = got["random"]
    return derive_slo(runs["alone"], runs["batch"])


def gateway_env(policy: str, slo: Slo) -> dict[str, str]:
    """What ``pdserve up`` passes on to its gateway: the policy and the base SLO."""
    return {"PDSERVE_GATEWAY_DISAGG_POLICY": policy,
            "PDSERVE_GATEWAY_SLO_TTFT_MS": f"{slo.ttft_s * 1000:.3f}",
            "PDSERVE_GATEWAY_SLO_TPOT_MS": f"{slo.tpot_s * 1000:.3f}"}  # fmt: skip


def policy_setting_known() -> bool:
    """Whether this gateway has the ``disagg_policy`` setting. pydantic-settings ignores an
    environment variable no setting reads, so without it both pdserve systems are alike."""
    from gateway.config import GatewaySettings

    return "disagg_policy" in GatewaySettings.model_fields


def run_system(
    system: str, round_no: int, args: argparse.Namespace, slo: Slo, model: str, name: str,
    out: Path,
) -> list[dict[str, Any]]:  # fmt: skip
    """``system`` started, one run per request rate through it (each rate its own prompts:
    the server keeps its prefix cache), stopped. Each run's summary."""
    kind, policy = SYSTEMS[system]
    env = gateway_env(policy, slo) if kind == "pdserve" else None
    rates, scales = floats(args.request_rates, ""), floats(args.slo_scales, "")
    runs = []
    with bench_systems.server(kind, args, model, name, out, env) as url:
        for i, rate in enumerate(rates):
            where = f"[{system}, round {round_no}] rate {rate:g} req/s"
            print(f"  {where}: {args.num_prompts} requests ...", flush=True)
            settings = argparse.Namespace(**{**vars(args), "request_rate": rate,
                                             "seed": args.seed + i})  # fmt: skip
            before = bench_systems.gateway_counters(url) if kind == "pdserve" else {}
            started = time.monotonic()
            raw = bench_systems.run_workload(
                "random", f"{system}-rate{rate:g}-r{round_no}", url, settings, model, name, out
            )["random"]
            row = report.summarize_run(raw, slo, scales)
            if kind == "pdserve":
                after = bench_systems.gateway_counters(url)
                row["pdserve_counters"] = {k: v - before.get(k, 0.0) for k, v in after.items()
                                           if v != before.get(k, 0.0)}  # fmt: skip
            at_1 = row["goodput"].get("1", math.nan)
            print(f"  {where}: done in {time.monotonic() - started:.0f} s, {row['failed']} "
                  f"failed, goodput at SLO scale 1 {at_1:.3f} req/s")  # fmt: skip
            runs.append({"system": system, "rate": rate, "round": round_no, **row})
    return runs


def base_slo(
    args: argparse.Namespace, model: str, name: str, out: Path
) -> tuple[Slo, dict[str, float]]:
    """The SLO pair given, else the one ``calibrate`` derives (with its measurements)."""
    calibration: dict[str, float] = {}
    if args.slo_ttft_ms:
        slo = Slo(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)
    else:
        slo, calibration = calibrate(args, model, name, out)
    derived = (
        " (derived: 2 x prefill {prefill_ms:.0f} ms, 1.5 x decode step at batch 4 "
        "{decode_step_batch4_ms:.1f} ms)".format(**calibration)
        if calibration
        else " (given)"
    )
    print(f"  SLO: TTFT {slo.ttft_s * 1000:.0f} ms, TPOT {slo.tpot_s * 1000:.1f} ms{derived}")
    return slo, calibration


def run(args: argparse.Namespace) -> int:
    from pdserve.cluster.up import served_model_name
    from pdserve.model import resolve_model

    problem = settings_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    systems = [s for s in args.systems.split(",") if s]
    rates, scales = floats(args.request_rates, ""), floats(args.slo_scales, "")
    out = Path(args.out or tempfile.mkdtemp(prefix="pdserve-bench-goodput-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model, name = resolve_model(args.model or None), served_model_name(args.model)
    info = machine.cpu_info()
    print(f"bench goodput: {machine.describe(info)}")
    print(f"  systems {', '.join(systems)}; rates {args.request_rates} req/s; SLO scales "
          f"{args.slo_scales}; {args.rounds} round(s); results in {out}")  # fmt: skip
    known = policy_setting_known()
    if not known and any(SYSTEMS[s][0] == "pdserve" for s in systems):
        print("  warning: this gateway has no disagg_policy setting: pdserve-static and "
              "pdserve run the same gateway")  # fmt: skip
    slo, calibration = base_slo(args, model, name, out)
    runs = []
    for r in range(1, args.rounds + 1):
        for system in systems if r % 2 else systems[::-1]:
            runs += run_system(system, r, args, slo, model, name, out)
    results = report.medians(runs)
    (out / "results.json").write_text(json.dumps({
        "machine": info,
        "settings": {k: v for k, v in vars(args).items() if isinstance(v, str | int | float)},
        "gateway_has_disagg_policy": known, "rates": rates, "scales": scales,
        "slo": {"ttft_ms": slo.ttft_s * 1000, "tpot_ms": slo.tpot_s * 1000,
                "derived": bool(calibration), **calibration},
        "runs": runs, "results": results}, indent=2))  # fmt: skip
    try:
        plots = report.plot(results, rates, scales, out)
    except ImportError:
        plots = []
        print("  (matplotlib is not installed: no plots)")
    print(report.goodput_table(results, rates, scales) + "\n")
    print(report.latency_table(results, rates))
    print(f"results: {out / 'results.json'}; plots: {', '.join(p.name for p in plots) or '-'}")
    return 0
