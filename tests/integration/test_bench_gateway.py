"""`pdserve bench gateway` end to end with tiny numbers: fake workers, a real gateway process,
all three paths. Checks the result's shape and sanity, never its speed."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from pdserve.bench import gateway as bench_gateway
from pdserve.cluster.redis_server import free_ports
from tests.helpers import model_dir

PATHS = ("direct_grpc", "gateway_http", "gateway_grpc")


def test_bench_gateway_smoke(tmp_path: Path) -> None:
    out = tmp_path / "gateway.json"
    command = [
        sys.executable, "-m", "pdserve", "bench", "gateway", "--streams", "8", "--tokens", "4",
        "--requests", "2", "--interval-ms", "5", "--rounds", "2", "--prompt-words", "40",
        "--model", model_dir(), "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["bench"] == "gateway"
    assert report["machine"]["model_name"] and set(report["machine"]["isa"]) == {
        "avx2", "avx512f", "avx512_bf16", "amx"
    }  # fmt: skip
    assert report["config"]["streams"] == 8 and report["config"]["prompt_tokens_mean"] > 40
    for name in PATHS:
        path = report["paths"][name]
        assert path["requests"] == 8 * 2 * 2, name  # streams x requests x rounds
        assert path["failed"] == 0 and path["errors"] == [], (name, path["errors"])
        assert path["tokens"] == 8 * 2 * 2 * 4, name
        for metric in ("ttft_ms", "itl_ms"):
            p50, p99 = path[metric]["p50"], path[metric]["p99"]
            assert 0 < p50 <= p99, (name, metric, p50, p99)
    for name in ("gateway_http", "gateway_grpc"):
        added = report["added_by_gateway_ms"][name]
        assert added["ttft_ms"]["p50"] == (
            report["paths"][name]["ttft_ms"]["p50"]
            - report["paths"]["direct_grpc"]["ttft_ms"]["p50"]
        )
    assert "direct_grpc" in done.stdout and "added by the gateway" in done.stdout


def test_bench_gateway_tracing_compare(tmp_path: Path) -> None:
    """Both arms, their phases interleaved; spans reach the receiver from the traced arm's
    gateway and fake workers only; a throughput ratio per path and over all."""
    out = tmp_path / "compare.json"
    command = [
        sys.executable, "-m", "pdserve", "bench", "gateway", "--streams", "4", "--tokens", "4",
        "--requests", "2", "--interval-ms", "5", "--rounds", "2", "--prompt-words", "40",
        "--model", model_dir(), "--tracing", "compare", "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["config"]["tracing"] == "compare"
    assert report["command"].endswith("--tracing compare")
    assert report["machine"]["model_name"] and "avx2" in report["machine"]["isa"]
    tracing = report["tracing"]
    assert tracing["sampler"] == {"OTEL_TRACES_SAMPLER": "always_on"}
    assert tracing["span_processor"] == "batch" and tracing["protocol"] == "http/protobuf"
    # Each arm ran each gateway path once per round, the two arms of a path back to back.
    phases = report["phases"]
    assert sorted((p["round"], p["path"], p["arm"]) for p in phases) == sorted(
        (r, path, arm) for r in (1, 2) for path in PATHS[1:] for arm in ("off", "on")
    )
    for first, second in zip(phases[::2], phases[1::2], strict=True):
        assert (first["round"], first["path"]) == (second["round"], second["path"])
        assert {first["arm"], second["arm"]} == {"off", "on"}
    assert [p["arm"] for p in phases if p["path"] == "gateway_grpc"] == ["off", "on", "on", "off"]
    kinds = [(p["arm"], p["path"]) for p in phases]
    assert all(a != b for a, b in itertools.pairwise(kinds)), kinds  # no phase after its twin
    for arm in ("off", "on"):
        assert set(report["arms"][arm]) == set(PATHS[1:])
        for name, path in report["arms"][arm].items():
            assert path["requests"] == 4 * 2 * 2 and path["failed"] == 0, (arm, name)
            assert path["requests_per_s"] > 0, (arm, name)
    throughput = tracing["throughput"]
    for name in PATHS[1:]:
        figures = throughput[name]
        assert len(figures["ratio_per_round"]) == 2 and figures["ratio_median"] > 0
        assert figures["arms"]["on"]["requests_per_s_median"] > 0
    assert throughput["all"]["pairs"] == 4 and throughput["all"]["ratio_median"] > 0
    # Spans: none from the untraced arm (its environment names the receiver too); from the
    # traced one, the gateway's six per generation request and a server span per worker call.
    spans = tracing["spans"]
    assert spans["off"] == {"spans": 0, "services": {}}
    requests = 2 * 2 * 4 * (1 + 2)  # paths x rounds x streams x (ramp-up + measured)
    assert spans["on"]["services"] == {
        "bench-on-gateway": 6 * requests, "bench-on-fake-workers": 2 * requests
    }  # fmt: skip
    assert "on/off" in done.stdout and "spans received from the tracing-on" in done.stdout


def test_a_gateway_port_taken_before_it_binds_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race a make test run once lost: the gateway's port was taken between the choice
    and its bind; the gateway exits, and the stack starts it again on fresh ports."""
    parser = argparse.ArgumentParser()
    bench_gateway.add_arguments(parser)
    args = parser.parse_args(["--model", model_dir(), "--tokens", "2", "--interval-ms", "5"])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        taken_port = taken.getsockname()[1]
        picks = iter([[free_ports(1)[0], taken_port]])  # first: gRPC on a taken port
        monkeypatch.setattr(
            bench_gateway, "free_ports", lambda n: next(picks, None) or free_ports(n)
        )
        stack = bench_gateway.start_stack(args, "off", dict(os.environ), "", str(tmp_path))
    try:
        assert stack.targets["grpc"] != f"127.0.0.1:{taken_port}"
        assert len(stack.processes) == 2, "the fake workers and the one gateway that runs"
        log = (tmp_path / "gateway.log").read_text()
        assert "cannot bind gRPC server" in log and "Traceback" not in log, "the first one exited"
        with urllib.request.urlopen(stack.targets["http"] + "/health", timeout=10) as answer:
            assert json.loads(answer.read())["healthy_decode_workers"] == 1
    finally:
        bench_gateway.stop_processes(list(reversed(stack.processes)))
