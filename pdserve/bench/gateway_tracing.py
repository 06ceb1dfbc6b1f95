"""Tracing in ``pdserve bench gateway --tracing {off,on,compare}``: each arm's environment,
the OTLP receiver the traced arm exports to, and the on/off comparison.

An arm is one gateway with its own fake workers. Its environment is this process's without
any ``OTEL_*`` variable, plus, while tracing is asked for, what production would set: OTLP
over HTTP/protobuf to a receiver this benchmark starts in its own process (as a collector
runs), sampler ``always_on`` (every request; ``--trace-ratio`` below 1:
``parentbased_traceidratio``, that share of them), pdserve's batch span processor. In
``compare`` the "off" arm gets the same variables plus ``OTEL_SDK_DISABLED=true``: off
exactly as a deployment turns it off, and any span that leaked would still reach the
receiver, under the arm's own service names (``OTEL_SERVICE_NAME=bench-<arm>``), and show in
its count.

The figure of ``compare`` is the median, over rounds, of each round's throughput ratio on/off
of the same path: the two arms' phases run back to back within a round, in alternating order,
so that a noisy machine's slow spell lands on both arms alike.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from typing import Any

# --tracing -> the arms, in their order within the first round.
ARMS = {"off": ("off",), "on": ("on",), "compare": ("off", "on")}
PROTOCOL = "http/protobuf"


def sampler(ratio: float) -> dict[str, str]:
    """The sampler variables that trace ``ratio`` of the requests (0 < ratio <= 1)."""
    if ratio >= 1:
        return {"OTEL_TRACES_SAMPLER": "always_on"}
    return {
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": f"{ratio:g}",
    }


def arm_env(mode: str, arm: str, endpoint: str, ratio: float = 1.0) -> dict[str, str]:
    """The environment of one arm's processes (gateway and fake workers)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    if mode == "off":
        return env
    env |= {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{endpoint}/v1/traces",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": PROTOCOL,
        "OTEL_SERVICE_NAME": f"bench-{arm}",
        **sampler(ratio),
    }
    if arm == "off":
        env["OTEL_SDK_DISABLED"] = "true"
    return env


# Pads each arm's environment to the same size in bytes (see ``arm_envs``).
PAD = "PDSERVE_BENCH_ENV_PAD"


def _size(env: dict[str, str]) -> int:
    """The bytes ``env`` takes on a new process's stack: "k=v\\0" and a pointer per variable."""
    return sum(len(k.encode()) + len(v.encode()) + 2 + 8 for k, v in env.items())


def arm_envs(
    mode: str, arms: tuple[str, ...], endpoint: str, ratio: float = 1.0
) -> dict[str, dict[str, str]]:
    """Every arm's environment (``arm_env``), padded to one size in bytes. The environment's
    size shifts where a process's stack starts, and with it the process's speed: two untraced
    arms whose environments differed by one byte ("bench-on" / "bench-off") differed in
    throughput by 6-7 % in three runs out of three, the smaller one ahead; with equal sizes,
    by 1-5 % either way in four."""
    return padded({arm: arm_env(mode, arm, endpoint, ratio) for arm in arms})


def padded(envs: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """``envs`` with each padded (``PAD``) to the size in bytes of the largest."""
    envs = {arm: {k: v for k, v in env.items() if k != PAD} for arm, env in envs.items()}
    largest = max(_size(env) for env in envs.values())
    return {arm: env | {PAD: "x" * (largest - _size(env))} for arm, env in envs.items()}


class ReceiverProcess:
    """``python -m pdserve.telemetry.otlp_receiver`` in its own process; counts spans per
    service."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pdserve.telemetry.otlp_receiver"],
            stdout=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        assert self.process.stdout is not None
        line = self.process.stdout.readline()  # {"port": N} once it listens
        if not line:
            raise RuntimeError(f"the OTLP receiver did not start (exit {self.process.wait()})")
        self.endpoint = f"http://127.0.0.1:{json.loads(line)['port']}"

    def close(self) -> dict[str, Any]:
        """Stop it; returns what it counted (``otlp_receiver.Receiver.stats``)."""
        try:
            with urllib.request.urlopen(self.endpoint + "/stats", timeout=10) as response:
                return dict(json.loads(response.read()))
        except OSError as exc:
            raise RuntimeError(f"the OTLP receiver did not answer: {exc}") from exc
        finally:
            self.process.terminate()
            self.process.wait(timeout=30)


def spans_by_arm(stats: dict[str, Any], arms: tuple[str, ...]) -> dict[str, Any]:
    """Per arm: the spans the receiver got from its processes, in all and per service."""
    out: dict[str, Any] = {}
    for arm in arms:
        services = {name: n for name, n in stats["services"].items()
                    if name.startswith(f"bench-{arm}-")}  # fmt: skip
        out[arm] = {"spans": sum(services.values()), "services": services}
    return out


def span_problems(spans: dict[str, Any]) -> list[str]:
    """Why a run's tracing figures would not mean what they say (empty: none)."""
    problems = []
    if "on" in spans and not spans["on"]["spans"]:
        problems.append("the traced arm exported no spans (see its gateway log)")
    if "off" in spans and spans["off"]["spans"]:
        problems.append(f"the untraced arm exported {spans['off']['spans']} spans")
    return problems


def describe_tracing(
    mode: str, ratio: float, spans: dict[str, Any], receiver_cpu_s: float | None
) -> dict[str, Any]:
    """The report's ``tracing`` entry (``compare`` adds ``throughput``). ``receiver_cpu_s``:
    what the receiver cost the machine, all of the run (it shares the cores)."""
    if mode == "off":
        return {"mode": mode}
    return {"mode": mode, "exporter": "otlp", "protocol": PROTOCOL, "sampler": sampler(ratio),
            "span_processor": "batch", "spans": spans,
            "receiver_cpu_s": receiver_cpu_s}  # fmt: skip


def print_spans(traced: dict[str, Any]) -> None:
    """The spans each arm exported and what receiving them cost (a report's ``tracing``)."""
    if traced["mode"] == "off":
        return
    spans = traced["spans"]
    for arm, got in spans.items():
        services = ", ".join(f"{name} {n}" for name, n in sorted(got["services"].items()))
        print(f"spans received from the tracing-{arm} processes: {got['spans']}"
              + (f" ({services})" if services else ""))  # fmt: skip
    cpu = traced["receiver_cpu_s"]
    if cpu is not None:
        print(f"the OTLP receiver used {cpu:.1f} CPU seconds (it shares the machine's cores)")
    for problem in span_problems(spans):
        print(f"error: {problem}")


def median(values: list[float]) -> float | None:
    """The median of ``values``, None when there are none."""
    return statistics.median(values) if values else None


def _ratio(on: float | None, off: float | None) -> float | None:
    return None if on is None or not off else on / off


def _per_token(phases: list[dict[str, Any]], key: str) -> float | None:
    """CPU microseconds per streamed token over ``phases`` (None without CPU figures)."""
    tokens = sum(p["tokens"] for p in phases)
    cpu = [p[key] for p in phases]
    return sum(cpu) / tokens * 1e6 if tokens and None not in cpu else None


def compare(phases: list[dict[str, Any]], paths: tuple[str, ...]) -> dict[str, Any]:
    """The on/off figures from the phases of a ``compare`` run.

    ``phases``: one dict per timed phase: round, arm, path, wall_s, requests (measured),
    tokens, gateway_cpu_s and fakes_cpu_s (None off Linux). Per path: each arm's median
    requests/s over rounds, each round's ratio on/off and their median, and the CPU per token
    of the gateway and of the fake workers per arm (all rounds together); ``"all"``: the
    median of every round's ratio of every path."""
    by = {(p["round"], p["arm"], p["path"]): p for p in phases}
    rounds = sorted({p["round"] for p in phases})
    out: dict[str, Any] = {}
    every: list[float] = []
    for path in paths:
        per_arm: dict[str, Any] = {}
        for arm in ("off", "on"):
            mine = [p for p in phases if p["arm"] == arm and p["path"] == path]
            rates = [p["requests"] / p["wall_s"] for p in mine if p["wall_s"]]
            per_arm[arm] = {
                "requests_per_s": rates,
                "requests_per_s_median": median(rates),
                "tokens_per_s_median": median(
                    [p["tokens"] / p["wall_s"] for p in mine if p["wall_s"]]
                ),
                "gateway_cpu_us_per_token": _per_token(mine, "gateway_cpu_s"),
                "fakes_cpu_us_per_token": _per_token(mine, "fakes_cpu_s"),
            }
        ratios = []
        for r in rounds:
            off, on = by.get((r, "off", path)), by.get((r, "on", path))
            if off and on and off["wall_s"] and on["wall_s"] and off["requests"]:
                ratios.append((on["requests"] / on["wall_s"]) / (off["requests"] / off["wall_s"]))
        every += ratios
        out[path] = {
            "arms": per_arm,
            "ratio_per_round": ratios,
            "ratio_median": median(ratios),
            "gateway_cpu_ratio": _ratio(
                per_arm["on"]["gateway_cpu_us_per_token"],
                per_arm["off"]["gateway_cpu_us_per_token"],
            ),
        }
    out["all"] = {"ratio_median": median(every), "pairs": len(every)}
    return out


def num(value: float | None, fmt: str) -> str:
    """``value`` formatted, "-" when there is none."""
    return "-" if value is None else format(value, fmt)


def compared(figures: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], str]]:
    """(path or workload, its figures, its rounds' on/off ratios as text) of a comparison's
    figures, without the summary of them all."""
    for name, f in figures.items():
        if name != "all":
            yield name, f, " ".join(f"{r:.3f}" for r in f["ratio_per_round"])


def print_compare(report: dict[str, Any]) -> None:
    figures = report["tracing"]["throughput"]
    print("throughput, tracing off vs on (median over rounds of each round's on/off ratio):")
    for path, f, per_round in compared(figures):
        off, on = f["arms"]["off"], f["arms"]["on"]
        print(f"  {path}: {num(off['requests_per_s_median'], '.1f')} -> "
              f"{num(on['requests_per_s_median'], '.1f')} requests/s (medians), on/off "
              f"{num(f['ratio_median'], '.3f')} (rounds: {per_round}); gateway CPU/token "
              f"{num(off['gateway_cpu_us_per_token'], '.0f')} -> "
              f"{num(on['gateway_cpu_us_per_token'], '.0f')} us, fake workers' "
              f"{num(off['fakes_cpu_us_per_token'], '.0f')} -> "
              f"{num(on['fakes_cpu_us_per_token'], '.0f')} us")  # fmt: skip
    print(f"  all paths: on/off {num(figures['all']['ratio_median'], '.3f')} "
          f"(median of {figures['all']['pairs']} pairs)")  # fmt: skip
    print_spans(report["tracing"])
