"""The tracing side of ``pdserve bench gateway``: each arm's environment and the on/off
figures computed from phase records."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.bench import gateway_tracing as tb
from pdserve.telemetry import tracing


def phase(r: int, arm: str, path: str, rate: float, cpu: float) -> dict[str, Any]:
    """A 10 s phase at ``rate`` requests/s of 10 tokens each, ``cpu`` gateway seconds."""
    return {"round": r, "arm": arm, "path": path, "wall_s": 10.0, "requests": int(rate * 10),
            "tokens": int(rate * 100), "gateway_cpu_s": cpu, "fakes_cpu_s": cpu / 2}  # fmt: skip


def test_arm_environments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")  # the user's: never reaches an arm
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "1")
    off = tb.arm_env("off", "off", "")
    assert not [k for k in off if k.startswith("OTEL_")]
    assert tracing.exporter_names(off) == []
    on = tb.arm_env("compare", "on", "http://127.0.0.1:4318")
    assert on["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == "http://127.0.0.1:4318/v1/traces"
    assert on["OTEL_TRACES_SAMPLER"] == "always_on" and "OTEL_BSP_SCHEDULE_DELAY" not in on
    assert tracing.exporter_names(on) == ["otlp"]
    assert tracing.service_name("gateway", on) == "bench-on-gateway"
    # The untraced arm of a comparison: the same exporter settings, switched off.
    untraced = tb.arm_env("compare", "off", "http://127.0.0.1:4318")
    assert untraced["OTEL_SDK_DISABLED"] == "true" and tracing.exporter_names(untraced) == []
    sampled = tb.arm_env("on", "on", "http://x", ratio=0.1)
    assert sampled["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio"
    assert sampled["OTEL_TRACES_SAMPLER_ARG"] == "0.1"


def test_compare_pairs_the_arms_round_by_round() -> None:
    phases = [
        phase(1, "off", "gateway_grpc", 50, 5.0), phase(1, "on", "gateway_grpc", 45, 5.5),
        phase(2, "on", "gateway_grpc", 20, 2.2), phase(2, "off", "gateway_grpc", 25, 2.5),
        phase(3, "off", "gateway_grpc", 40, 4.0), phase(3, "on", "gateway_grpc", 40, 4.4),
        phase(1, "off", "gateway_http", 10, 1.0), phase(1, "on", "gateway_http", 10, 1.0),
    ]  # fmt: skip
    got = tb.compare(phases, ("gateway_grpc", "gateway_http"))
    grpc = got["gateway_grpc"]
    assert grpc["ratio_per_round"] == pytest.approx([0.9, 0.8, 1.0])
    assert grpc["ratio_median"] == pytest.approx(0.9)
    assert grpc["arms"]["off"]["requests_per_s"] == [50, 25, 40]
    assert grpc["arms"]["off"]["requests_per_s_median"] == 40
    assert grpc["arms"]["on"]["tokens_per_s_median"] == 400
    # CPU per token over all rounds: off 11.5 s / 11,500 tokens, on 12.1 s / 10,500 tokens.
    assert grpc["arms"]["off"]["gateway_cpu_us_per_token"] == pytest.approx(1000)
    assert grpc["gateway_cpu_ratio"] == pytest.approx((12.1 / 10500) / (11.5 / 11500))
    assert grpc["arms"]["on"]["fakes_cpu_us_per_token"] == pytest.approx(6.05 / 10500 * 1e6)
    assert got["gateway_http"]["ratio_per_round"] == [1.0]
    assert got["all"] == {"ratio_median": pytest.approx(0.95), "pairs": 4}


def test_compare_without_cpu_figures_or_a_pair() -> None:
    lone = phase(1, "on", "gateway_grpc", 10, 1.0) | {"gateway_cpu_s": None}
    got = tb.compare([lone], ("gateway_grpc",))
    assert (
        got["gateway_grpc"]["ratio_per_round"] == [] and got["gateway_grpc"]["ratio_median"] is None
    )
    assert got["gateway_grpc"]["arms"]["on"]["gateway_cpu_us_per_token"] is None
    assert got["gateway_grpc"]["gateway_cpu_ratio"] is None
    assert got["all"] == {"ratio_median": None, "pairs": 0}


def test_span_problems() -> None:
    fine = {"off": {"spans": 0, "services": {}}, "on": {"spans": 8, "services": {"x": 8}}}
    assert tb.span_problems(fine) == []
    assert tb.span_problems({**fine, "off": {"spans": 3, "services": {"y": 3}}}) == [
        "the untraced arm exported 3 spans"
    ]
    assert tb.span_problems({"on": {"spans": 0, "services": {}}}) == [
        "the traced arm exported no spans (see its gateway log)"
    ]


def test_the_arms_environments_are_of_one_size() -> None:
    envs = tb.arm_envs("compare", ("off", "on"), "http://127.0.0.1:4318")
    sizes = {arm: sum(len(f"{k}={v}") + 1 + 8 for k, v in env.items()) for arm, env in envs.items()}
    assert sizes["off"] == sizes["on"], sizes
    assert envs["off"]["OTEL_SDK_DISABLED"] == "true" and "OTEL_SDK_DISABLED" not in envs["on"]
    assert {k for k in envs["on"] if k != tb.PAD} == set(tb.arm_env("compare", "on", "x"))
