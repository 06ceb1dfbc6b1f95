"""``pdserve bench serve --tracing compare``: the arms' order and the on/off figures computed
from hand-made vLLM results."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from pdserve.bench import serve as bench_serve
from pdserve.bench import serve_tracing as bench_serve_tracing
from pdserve.bench import systems as bench_systems


def result(rate: float, ttft: float, itl: float) -> dict[str, Any]:
    """A vLLM result of four requests at ``rate`` requests/s."""
    return {
        "duration": 4 / rate, "completed": 4, "failed": 0, "request_throughput": rate,
        "output_throughput": rate * 8, "ttfts": [ttft] * 4, "itls": [[itl] * 7] * 4,
        "latencies": [ttft + 7 * itl] * 4, "errors": [""] * 4,
    }  # fmt: skip


def test_the_arms_alternate_their_order_round_by_round() -> None:
    assert [bench_serve_tracing.arm_order(r) for r in (1, 2, 3)] == [
        ("off", "on"), ("on", "off"), ("off", "on"),
    ]  # fmt: skip


def test_compare_pairs_the_arms_round_by_round() -> None:
    results = {
        1: {"off": {"random": result(1.0, 2.0, 0.05)}, "on": {"random": result(0.9, 2.2, 0.05)}},
        2: {"on": {"random": result(0.8, 2.0, 0.06)}, "off": {"random": result(1.0, 2.0, 0.05)}},
        3: {"off": {"random": result(0.5, 2.0, 0.05)}, "on": {"random": result(0.5, 2.0, 0.04)}},
        4: {"off": {"random": result(1.0, 2.0, 0.05)}},  # the traced arm's run is missing
    }
    got = bench_serve_tracing.compare(results)
    random = got["random"]
    assert random["ratio_per_round"] == pytest.approx([0.9, 0.8, 1.0])
    assert random["ratio_median"] == pytest.approx(0.9)
    assert random["arms"]["off"]["requests_per_s_median"] == pytest.approx(1.0)
    assert random["arms"]["on"]["ttft_p50_ms_median"] == pytest.approx(2000.0)
    assert random["arms"]["on"]["itl_p50_ms_median"] == pytest.approx(50.0)
    assert random["arms"]["on"]["failed"] == 0
    assert got["all"] == {"ratio_median": pytest.approx(0.9), "pairs": 3, "failed": 0}


def test_failed_requests_are_counted_per_arm() -> None:
    broken = result(1.0, 2.0, 0.05) | {"completed": 1, "failed": 3, "errors": ["", "x", "x", "x"]}
    got = bench_serve_tracing.compare({1: {"off": {"random": result(1.0, 2.0, 0.05)},
                                           "on": {"random": broken}}})  # fmt: skip
    assert got["random"]["arms"]["on"]["failed"] == 3
    assert got["random"]["arms"]["off"]["failed"] == 0
    assert got["all"]["failed"] == 3


def test_bad_settings_are_refused_before_anything_starts(capsys: pytest.CaptureFixture) -> None:
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    for argv, message in (
        (["--tracing", "compare", "--rounds", "0"], "--rounds must be at least 1"),
        (["--trace-ratio", "0"], "--trace-ratio must be in (0, 1]"),
        (["--workloads", "nope"], "unknown workload 'nope'"),
    ):
        assert bench_serve.run(parser.parse_args(argv)) == 2
        assert message in capsys.readouterr().err


def test_a_second_cluster_waits_for_its_own_banner(tmp_path: Any) -> None:
    """The log is shared by the clusters of a run: an earlier cluster's banner must not pass
    for the next one's."""
    import subprocess
    import sys

    log = tmp_path / "pdserve-up.log"
    log.write_text("... pdserve is up ...\n")
    start = log.stat().st_size
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    with pytest.raises(RuntimeError, match="exited with 0"):
        bench_systems._wait_for_banner(log, done, start, timeout_s=30)
    with open(log, "a") as f:
        f.write("pdserve is up\n")
    bench_systems._wait_for_banner(log, done, start, timeout_s=30)


def test_a_control_runs_both_arms_untraced_with_environments_of_one_size() -> None:
    from pdserve.bench import gateway_tracing as tb
    from pdserve.telemetry import tracing

    compare = bench_serve_tracing.arm_envs("compare", "http://127.0.0.1:4318", 1.0)
    assert tracing.exporter_names(compare["on"]) == ["otlp"]
    assert tracing.exporter_names(compare["off"]) == []
    control = bench_serve_tracing.arm_envs("control", "http://127.0.0.1:4318", 1.0)
    assert [tracing.exporter_names(env) for env in control.values()] == [[], []]
    assert tracing.service_name("gateway", control["on"]) == "bench-on-gateway"
    assert tb._size(control["on"]) == tb._size(control["off"])
    assert tb._size(compare["on"]) == tb._size(compare["off"])
