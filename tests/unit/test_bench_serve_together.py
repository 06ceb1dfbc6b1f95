"""``pdserve bench serve --together``: both systems held up, each round its own prompts, the
idle system's CPU time measured over every run."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pdserve.bench import serve as bench_serve
from pdserve.bench import serve_together as together
from pdserve.bench import systems as bench_systems

# A child that starts a grandchild listening on a port, then burns CPU until its own CPU time
# reaches 0.4 s and says so.
TREE = """
import socket, subprocess, sys, time
listener = subprocess.Popen([sys.executable, "-c", '''
import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
print(s.getsockname()[1], flush=True)
time.sleep(600)
'''], stdout=subprocess.PIPE, text=True)
port = listener.stdout.readline().strip()
while time.process_time() < 0.4:
    pass
print(port, flush=True)
time.sleep(600)
"""


def _args(**extra: Any) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    args = parser.parse_args([])
    for key, value in extra.items():
        setattr(args, key, value)
    return args


def test_each_round_has_its_own_seed_only_when_held() -> None:
    held = _args(together=True, seed=3)
    assert [together.round_args(held, r).seed for r in (1, 2, 3)] == [3, 13, 23]
    assert held.seed == 3  # the settings themselves are left alone
    apart = _args(seed=3)
    assert together.round_args(apart, 2) is apart


def test_the_root_of_a_server_and_its_cpu_time() -> None:
    tree = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    try:
        assert tree.stdout is not None
        port = int(tree.stdout.readline())  # the grandchild listens; the child has burnt 0.4 s
        root = together.server_root(port)
        assert root == tree.pid  # the child this process started, not the listener
        held = together.Held(f"http://127.0.0.1:{port}", root)
        # /proc counts CPU time in clock ticks, split between user and system time by
        # sampling, so it may read a few ticks below the child's own clock (0.29 for 0.3).
        assert held.cpu_seconds() >= 0.3
        with together.idle_cpu({"vllm": held}, "pdserve") as spent:
            assert spent == {}  # filled in when the block ends
        assert list(spent) == ["vllm while pdserve ran"]
        assert 0 <= spent["vllm while pdserve ran"] < 1  # it sleeps now
        assert together.meanwhile(spent).startswith("; vllm while pdserve ran: ")
    finally:
        tree.kill()
        tree.wait()


def test_a_port_nobody_here_started_has_no_root() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(LookupError, match="no process started by this benchmark"):
            together.server_root(s.getsockname()[1])  # this process itself: not a child


def test_settings_that_cannot_hold_both_up() -> None:
    assert together.settings_problem(_args()) == ""
    assert together.settings_problem(_args(together=True, gpus="")) in ("", _gpu_problem())
    assert "--tracing" in together.settings_problem(_args(together=True, tracing="compare"))
    assert "CPU only" in together.settings_problem(_args(together=True, gpus="0"))
    assert bench_serve.run(_args(together=True, gpus="0")) == 2  # refused before starting


def _gpu_problem() -> str:
    return "--together runs on the CPU only: on a GPU both systems would not fit at once"


def test_a_round_runs_on_the_held_servers_with_the_rounds_prompts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[tuple[str, str, int]] = []

    def run_workload(workload: str, system: str, url: str, args: argparse.Namespace,
                     *_: Any) -> dict[str, Any]:  # fmt: skip
        calls.append((system, url, args.seed))
        return {workload: {"system": system}}

    def no_server(*_: Any) -> None:
        raise AssertionError("a held system was started again")

    monkeypatch.setattr(bench_systems, "run_workload", run_workload)
    monkeypatch.setattr(bench_systems, "gateway_counters", lambda url: {"c": 1.0})
    monkeypatch.setattr(bench_systems, "server", no_server)
    held = {"pdserve": together.Held("http://p", -1), "vllm": together.Held("http://v", -1)}
    args = _args(together=True, rounds=2, seed=0)
    raw, counters = bench_serve.run_round(
        2, ["vllm", "pdserve"], ["random"], args, "/m", "m", tmp_path, held
    )
    assert calls == [("vllm-r2", "http://v", 10), ("pdserve-r2", "http://p", 10)]
    assert raw == {"random": {"vllm": {"system": "vllm-r2"}, "pdserve": {"system": "pdserve-r2"}}}
    # a gone process counts no CPU time; each run records the other system's
    assert counters["random"]["idle_cpu_s"] == {
        "pdserve while vllm ran": 0.0, "vllm while pdserve ran": 0.0
    }  # fmt: skip


# ---- --vllm-engine-sched idle: the monolith's engine processes in pdserve's class ---------
# A server that starts an engine process (named VLLM::... on its command line, as vLLM's are)
# and another child; each prints its pid when it runs.
SERVER = """
import subprocess, sys, time
code = "import os, time; print(os.getpid(), flush=True); time.sleep(600)"
for name in ("VLLM::EngineCore", "helper"):
    subprocess.Popen([sys.executable, "-c", code, name])
time.sleep(600)
"""


def test_the_monolith_engine_processes_move_to_the_idle_class() -> None:
    import os

    import psutil

    server = subprocess.Popen([sys.executable, "-c", SERVER])
    try:
        children: list[psutil.Process] = []
        for _ in range(600):  # both children started (at most a minute)
            children = psutil.Process(server.pid).children()
            if len(children) == 2 and all(len(c.cmdline()) == 4 for c in children):
                break
            time.sleep(0.1)
        engine = next(c for c in children if "VLLM::EngineCore" in c.cmdline())
        helper = next(c for c in children if "helper" in c.cmdline())
        assert bench_systems.engines_to_idle_class(server.pid) == [engine.pid]
        assert {os.sched_getscheduler(t.id) for t in engine.threads()} == {os.SCHED_IDLE}
        assert os.sched_getscheduler(helper.pid) == os.SCHED_OTHER
        assert os.sched_getscheduler(server.pid) == os.SCHED_OTHER
    finally:
        for process in psutil.Process(server.pid).children():
            process.kill()
        server.kill()
        server.wait()


def test_the_idle_class_for_vllm_serve_is_refused_on_gpus(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pdserve.placement import engines as placement

    monkeypatch.setattr(placement, "gpus_to_use", lambda gpus: ["0"])
    args = _args(vllm_engine_sched="idle", workloads="random")
    assert bench_serve.run(args) == 2
    assert "--vllm-engine-sched idle is for the CPU" in capsys.readouterr().err
