"""``pdserve bench gpu`` without a GPU: what it would start and how it reads its results.
The run itself needs an NVIDIA GPU with vLLM's CUDA build and NIXL (never run here)."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gateway.worker_metrics import WorkerCollector
from pdserve.bench import gpu as bench_gpu
from pdserve.bench import systems as bench_systems
from pdserve.cli.main import build_parser


def test_it_refuses_to_run_without_a_gpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("pdserve.placement.engines.detect_gpus", lambda: [])
    args = build_parser("bench").parse_args(["bench", "gpu", "--gpu", "0"])
    assert bench_gpu.run(args) == 2
    assert "no NVIDIA GPU 0" in capsys.readouterr().err


def test_it_refuses_to_run_without_nixl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pdserve.placement.engines.detect_gpus", lambda: ["0"])
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert "pip install nixl" in str(bench_gpu.preflight("0"))


def test_the_cluster_it_starts_is_1p1d_on_the_chosen_gpu(tmp_path: Path) -> None:
    args = argparse.Namespace(port=8700, prefill=1, decode=1, model="/m/Llama",
                              gpus="1", engine_args="--max-model-len 4096")  # fmt: skip
    argv = bench_systems.pdserve_up_argv(args, tmp_path)
    up = argv[argv.index("up") + 1 :]
    assert up[:4] == ["--prefill", "1", "--decode", "1"]
    assert up[up.index("--gpus") + 1] == "1" and up[up.index("--model") + 1] == "/m/Llama"
    assert up[up.index("--nixl-port") + 1] == "8770"
    assert "--prefill-engine-args=--max-model-len 4096" in up
    assert "--kv-connector" not in up, "GPU detection picks NIXL (pdserve up's default)"
    parsed = build_parser("up").parse_args(argv[argv.index("up") :])
    assert (parsed.gpus, parsed.nixl_port) == ("1", 8770)


def test_the_monolith_on_a_gpu_has_no_cpu_arguments() -> None:
    gpu = bench_systems.monolith_argv("/m", "m", 9000, gpu=True, engine_args="--max-model-len 64")
    assert "--gpu-memory-utilization" not in gpu and "--dtype" not in gpu
    assert gpu[-3:] == ["--max-model-len", "64", "--disable-uvicorn-access-log"]
    assert "--enable-prefix-caching" in gpu, "the same common settings as pdserve's engines"
    cpu = bench_systems.monolith_argv("/m", "m", 9000)
    assert "--gpu-memory-utilization" in cpu and "--dtype" in cpu


def metrics_text(decode_counters: dict[str, float]) -> str:
    """/metrics as the gateway renders its per-worker counters."""
    worker = SimpleNamespace(healthy=True, in_flight=0, role_name="decode", worker_id="decode-0",
                             reported=lambda name: decode_counters.get(name, 0.0))  # fmt: skip
    registry = CollectorRegistry()
    registry.register(WorkerCollector(lambda: [worker]))
    return generate_latest(registry).decode()


def test_kv_throughput_comes_from_the_decode_workers_nixl_counters() -> None:
    text = metrics_text({"kv_transfers": 8, "kv_bytes": 4e9, "kv_transfer_seconds": 0.5})
    counters = bench_gpu.kv_counters(text)
    assert counters == {"transfers": 8, "transfer_bytes": 4e9, "transfer_seconds": 0.5}
    assert bench_gpu.gb_per_s(counters) == 8.0
    assert bench_gpu.gb_per_s(bench_gpu.kv_counters(metrics_text({}))) == 0.0


def test_parity_compares_the_leading_tokens() -> None:
    rows = bench_gpu.parity([[1, 2, 3, 4], [1, 2, 3], [5, 6]], [[1, 2, 3, 9], [1, 2, 3], [5, 7]], 3)
    assert [r["equal"] for r in rows] == [True, True, False]
    assert [r["first_difference"] for r in rows] == [3, None, 1]
    assert bench_gpu.parity([[1, 2]], [[1, 2, 3]], 3)[0] == {
        "prompt": 0, "equal": False, "first_difference": 2
    }  # fmt: skip


def test_the_prompts_are_long_and_distinct() -> None:
    texts = bench_gpu.prompts(8)
    assert len(set(texts)) == 8 and min(len(t.split()) for t in texts) > 200
