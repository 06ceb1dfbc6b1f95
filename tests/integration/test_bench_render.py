"""`pdserve bench render` with tiny numbers: both arms render the same token ids and the report
has its figures and the machine. Checks the result's shape, never its speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import model_dir


def test_bench_render_smoke(tmp_path: Path) -> None:
    out = tmp_path / "render.json"
    command = [
        sys.executable, "-m", "pdserve", "bench", "render", "--requests", "3", "--rounds", "1",
        "--prompt-words", "40", "--model", model_dir(), "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["machine"] and report["vllm_front_end_start_s"] > 0
    assert set(report["results"]) == {"chat", "completion"}
    for result in report["results"].values():
        assert result["same_token_ids"] is True  # the two renderings agree
        assert result["prompt_tokens"] > 40
        assert all(v > 0 for v in result["cpu_ms_per_request"].values())
    assert "ratio x" in done.stdout
