"""`pdserve bench gateway` end to end with tiny numbers: fake workers, a real gateway process,
all three paths. Checks the result's shape and sanity, never its speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
