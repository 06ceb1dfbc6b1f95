"""`pdserve bench fleet` end to end with tiny numbers: 4 fake workers in one process, a private
Redis, 2 real gateway processes. Checks that the report has every figure and that each is
sane, never its speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import model_dir

FIGURES = (
    "route_p50_ms", "route_p99_ms", "redis_commands_per_request", "redis_cpu_ms_per_request",
    "index_bytes_per_pair", "idle_commands_per_s", "holder_share", "hit_share", "spread",
    "gateway_cpu_ms_per_request",
)  # fmt: skip
GATEWAY_FIGURES = ("route_p50_ms", "route_p99_ms", "holder_share", "spread",
                   "gateway_cpu_ms_per_request")  # fmt: skip


def test_bench_fleet_smoke(tmp_path: Path) -> None:
    model_dir()  # the gateways' tokenizer: prepared
    command = [
        sys.executable, "-m", "pdserve", "bench", "fleet", "--workers", "4", "--gateways", "2",
        "--blocks", "400", "--cache-blocks", "2000", "--rate", "8", "--duration", "4",
        "--turns", "3", "--think-s", "0.2", "--prompt-words", "60", "--idle-s", "2",
        "--out", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "fleet.json").read_text())
    assert result["bench"] == "fleet" and result["command"].startswith("pdserve bench fleet")
    assert result["machine"]["model_name"] and set(result["machine"]["isa"]) == {
        "avx2", "avx512f", "avx512_bf16", "amx"
    }  # fmt: skip
    (point,) = result["points"]
    total = point["total"]
    assert point["workers"] == 4 and point["prefill_workers"] == point["decode_workers"] == 2
    assert point["index_pairs"] == 400
    assert total["requests"] > 0 and total["failed"] == 0, point["errors"]
    assert total["later_turns"] > 0
    for name in FIGURES:
        assert total[name] is not None and total[name] > 0, name
    # every request was routed once, by one of the two gateways
    assert total["routing_decisions"] == total["requests"]
    assert 0 < total["route_p50_ms"] <= total["route_p99_ms"] <= 100
    # the fakes hold what they served, the index says so, and the gateways route by it
    assert total["holder_share"] >= 0.9 and total["hit_share"] >= 0.9
    assert total["index_writes_dropped"] == 0
    assert total["gateway_idle_cpu_share"] is not None and total["cpu_share"]["gateways"] > 0
    assert 1 <= total["spread"] <= 2  # 2 workers per role: at worst one got all
    assert 16 < total["index_bytes_per_pair"] < 10_000
    assert point["redis_calls"]["evalsha"] >= total["requests"]  # one lookup per request at least
    assert len(point["gateways"]) == 2
    for g in point["gateways"]:
        assert g["requests"] > 0 and g["failed"] == 0
        for name in GATEWAY_FIGURES:
            assert g[name] is not None, name
    assert sum(g["requests"] for g in point["gateways"]) == total["requests"]
    assert (tmp_path / "fleet.png").stat().st_size > 0
    assert "| 4 | 400 |" in (tmp_path / "fleet.md").read_text()
