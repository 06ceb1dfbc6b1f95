"""`pdserve bench derender` with tiny numbers: both arms build the same stream's chunks and the
report has a figure per parser and length."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import model_dir


def test_bench_derender_smoke(tmp_path: Path) -> None:
    out = tmp_path / "derender.json"
    command = [sys.executable, "-m", "pdserve", "bench", "derender", "--tokens", "3,5"]
    command += ["--model", model_dir(), "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert "CPUs" in report["machine"]  # the machine is named
    rows = {(r["parser"], r["tokens"]): r for r in report["rows"]}
    assert set(rows) == {("none", 3), ("none", 5), ("hermes", 3), ("hermes", 5)}
    for row in rows.values():
        assert row["vllm_us_per_token"] > 0 and row["gateway_us_per_token"] > 0
    assert "vLLM / gateway" in result.stdout
