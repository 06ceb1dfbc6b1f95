"""pdserve's own threads on the prefill engines' cores (pdserve.placement.front_cores)."""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys

import pytest

from pdserve.cluster.up import UpSettings, front_cores_env
from pdserve.placement import front_cores
from pdserve.placement.engines import Placement
from pdserve.placement.front_cores import FRONT_ENV
from pdserve.worker.vllm_plugin import SCHED_ENV

ONE_EACH = [Placement(cpu_cores="0"), Placement(cpu_cores="1")]


def test_the_front_ends_go_to_the_prefill_engines_cores_where_the_engines_give_way() -> None:
    assert front_cores.front_cores(ONE_EACH, 1, {}) == "0"  # the CPU default: engines idle
    assert front_cores.front_cores(ONE_EACH, 1, {SCHED_ENV: "idle"}) == "0"
    four = [Placement(cpu_cores=c) for c in ("0-1", "2", "3")]
    assert front_cores.front_cores(four, 2, {}) == "0-2"  # every prefill engine's cores


@pytest.mark.parametrize(
    ("placements", "prefill", "environ"),
    [
        (ONE_EACH, 1, {SCHED_ENV: ""}),  # engines in the normal class: equal shares
        (ONE_EACH, 1, {SCHED_ENV: "normal"}),
        (ONE_EACH, 0, {}),  # no prefill engine
        (ONE_EACH, 2, {}),  # no decode engine
        ([Placement(cpu_cores="nobind")] * 3, 1, {}),  # engines sharing every core
        ([Placement(), Placement()], 1, {}),  # GPUs
    ],
)
def test_nowhere_to_bind_them(
    placements: list[Placement], prefill: int, environ: dict[str, str]
) -> None:
    assert front_cores.front_cores(placements, prefill, environ) == ""


def test_the_users_setting_wins() -> None:
    assert front_cores.front_cores(ONE_EACH, 1, {FRONT_ENV: ""}) == ""
    assert front_cores.front_cores(ONE_EACH, 1, {FRONT_ENV: "1"}) == "1"
    assert front_cores.front_cores([Placement()] * 2, 1, {FRONT_ENV: "0"}) == "0"


def test_up_passes_them_to_the_gateway_and_the_workers(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(FRONT_ENV, raising=False)
    monkeypatch.delenv(SCHED_ENV, raising=False)
    s = UpSettings()
    assert front_cores_env(s, [], [0, 1]) == {FRONT_ENV: "0"}
    assert "own threads run on the prefill engines' cores 0 (" in capsys.readouterr().out
    assert front_cores_env(s, ["0"], [0, 1]) == {FRONT_ENV: ""}  # GPUs
    assert capsys.readouterr().out == ""
    monkeypatch.setenv(FRONT_ENV, "")
    assert front_cores_env(s, [], [0, 1]) == {FRONT_ENV: ""}


# A process that starts a thread, binds itself, then starts another, and prints the cores of
# every thread and what bind_this_process returned. A joined thread may still be listed in
# /proc while it exits: its mask is taken inside it, and threads gone meanwhile are skipped
# (unskipped, the error left the first thread waiting and the probe hung).
PROBE = """
import os, threading
from pdserve.placement import front_cores
from pdserve.worker.vllm_plugin import for_each_thread
before, stop = threading.Event(), threading.Event()
threading.Thread(target=lambda: (before.set(), stop.wait()), daemon=True).start()
before.wait()
bound = front_cores.bind_this_process("probe")
late = []
t = threading.Thread(target=lambda: late.append(sorted(os.sched_getaffinity(0))))
t.start(); t.join()
masks = set()
for_each_thread(os.getpid(), lambda tid: masks.add(tuple(sorted(os.sched_getaffinity(tid)))))
stop.set()
print((bound, sorted(masks), late[0]))
"""


def _probe(value: str | None) -> tuple[list[int], list[tuple[int, ...]], list[int]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    if value is not None:
        env[FRONT_ENV] = value
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         check=True, timeout=120)  # fmt: skip
    return ast.literal_eval(out.stdout.strip())  # type: ignore[no-any-return]


def test_every_thread_of_the_process_is_bound_and_later_ones_too() -> None:
    core = min(os.sched_getaffinity(0))
    bound, masks, late = _probe(str(core))
    assert bound == [core]
    assert masks == [(core,)]
    assert late == [core]


@pytest.mark.parametrize("value", [None, "", "zero", "4096"])
def test_without_a_usable_core_list_the_process_keeps_its_cores(value: str | None) -> None:
    mine = tuple(sorted(os.sched_getaffinity(0)))
    bound, masks, late = _probe(value)
    assert bound == []
    assert masks == [mine]
    assert late == list(mine)


def test_up_refuses_a_setting_that_is_no_core_list(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pdserve.cluster import up

    monkeypatch.setenv(FRONT_ENV, "first")
    assert up.run(argparse.Namespace()) == 2  # before anything starts
    err = capsys.readouterr().err
    assert "PDSERVE_FRONT_CORES: not a list of CPU cores: 'first'" in err
    assert front_cores.setting_problem({FRONT_ENV: ""}) == ""
    assert front_cores.setting_problem({FRONT_ENV: "0-1,3"}) == ""
