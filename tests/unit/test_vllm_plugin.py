"""pdserve's vLLM plugin: engine processes pause instead of spinning on the message queue."""

from __future__ import annotations

import time
from typing import Any

import pytest
from vllm.distributed.device_communicators import shm_broadcast

from pdserve.worker import vllm_plugin


class _Reader:
    """The state SpinCondition.wait reads (a real one needs zmq sockets)."""

    _pdserve_since: float  # the plugin's: when the current wait began

    def __init__(self, last_read: float, busy_loop_s: float = 1.0) -> None:
        self.last_read, self.busy_loop_s = last_read, busy_loop_s


@pytest.fixture
def condition(monkeypatch: pytest.MonkeyPatch) -> Any:
    """SpinCondition with vLLM's wait replaced by a recorder, restored after the test."""
    calls: list[int | None] = []
    monkeypatch.setattr(shm_broadcast.SpinCondition, "wait", lambda self, t=None: calls.append(t))
    monkeypatch.delattr(shm_broadcast.SpinCondition, "_pdserve_pause_s", raising=False)
    monkeypatch.delenv(vllm_plugin.MAX_PAUSE_ENV, raising=False)
    shm_broadcast.SpinCondition.vllm_calls = calls  # type: ignore[attr-defined]
    yield shm_broadcast.SpinCondition
    monkeypatch.delattr(shm_broadcast.SpinCondition, "_pdserve_pause_s", raising=False)
    del shm_broadcast.SpinCondition.vllm_calls  # type: ignore[attr-defined]


def test_without_the_setting_vllm_is_left_as_it_is(
    condition: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    for value in (None, ""):
        if value is None:
            monkeypatch.delenv(vllm_plugin.PAUSE_ENV, raising=False)
        else:
            monkeypatch.setenv(vllm_plugin.PAUSE_ENV, value)
        wait = condition.wait
        vllm_plugin.register()
        assert condition.wait is wait
        assert not hasattr(condition, "_pdserve_pause_s")


def test_in_the_busy_period_a_reader_sleeps_instead_of_spinning(
    condition: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(vllm_plugin.PAUSE_ENV, "0.02")
    vllm_plugin.register()
    pauses: list[float] = []
    monkeypatch.setattr(vllm_plugin.time, "sleep", pauses.append)
    condition.wait(_Reader(last_read=time.monotonic()), 100)
    assert pauses == [0.02]  # slept, instead of yielding and returning
    assert condition.vllm_calls == []


def test_the_pause_grows_with_the_wait_up_to_the_longest(
    condition: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(vllm_plugin.PAUSE_ENV, "0.0002")
    monkeypatch.setenv(vllm_plugin.MAX_PAUSE_ENV, "0.002")
    vllm_plugin.register()
    pauses: list[float] = []
    monkeypatch.setattr(vllm_plugin.time, "sleep", pauses.append)
    reader = _Reader(last_read=time.monotonic())
    condition.wait(reader, 100)  # the first look after a read: the shortest pause
    reader._pdserve_since -= 0.008  # 8 ms into the same wait: an eighth of it
    condition.wait(reader, 100)
    reader._pdserve_since -= 1.0  # a long wait: no more than the longest pause
    condition.wait(reader, 100)
    reader.last_read = time.monotonic()  # a read: the next wait starts short again
    condition.wait(reader, 100)
    assert pauses[0] == pauses[3] == 0.0002
    assert pauses[1] == pytest.approx(0.001, rel=0.2)
    assert pauses[2] == 0.002
    assert condition.vllm_calls == []


def test_without_a_longest_pause_it_stays_the_same(
    condition: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(vllm_plugin.PAUSE_ENV, "0.0002")
    vllm_plugin.register()
    pauses: list[float] = []
    monkeypatch.setattr(vllm_plugin.time, "sleep", pauses.append)
    reader = _Reader(last_read=time.monotonic())
    condition.wait(reader, 100)
    reader._pdserve_since -= 0.5
    condition.wait(reader, 100)
    assert pauses == [0.0002, 0.0002]


def test_past_the_busy_period_vllms_own_wait_runs(
    condition: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(vllm_plugin.PAUSE_ENV, "5")
    vllm_plugin.register()
    pauses: list[float] = []
    monkeypatch.setattr(vllm_plugin.time, "sleep", pauses.append)
    condition.wait(_Reader(last_read=time.monotonic() - 2.0), 100)
    assert pauses == []  # no 5 s pause
    assert condition.vllm_calls == [100]


def test_the_plugin_is_registered_with_vllm() -> None:
    from importlib.metadata import entry_points

    names = {e.value for e in entry_points(group="vllm.general_plugins")}
    assert "pdserve.worker.vllm_plugin:register" in names


def test_a_cpu_worker_gives_its_engine_the_pauses_and_the_idle_class_and_the_users_stand(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os

    from decode_service.config import DecodeSettings
    from pdserve.worker import engine

    monkeypatch.setattr(engine, "has_gpu", lambda: False)
    names = (vllm_plugin.PAUSE_ENV, vllm_plugin.MAX_PAUSE_ENV, vllm_plugin.SCHED_ENV)
    for user in ({}, dict(zip(names, ["", "0.01", ""], strict=True))):
        monkeypatch.setattr(os, "environ", {**os.environ, **user})
        for name in names:
            if name not in user:
                os.environ.pop(name, None)
        engine.apply_environment(DecodeSettings(worker_id="d"))
        expected = user or {
            vllm_plugin.PAUSE_ENV: engine.ENGINE_SPIN_PAUSE_S,
            vllm_plugin.MAX_PAUSE_ENV: engine.ENGINE_SPIN_PAUSE_MAX_S,
            vllm_plugin.SCHED_ENV: "idle",
        }
        assert {name: os.environ[name] for name in expected} == expected
        assert os.environ[vllm_plugin.OWNER_ENV] == str(os.getpid())


def test_an_unknown_scheduling_class_is_reported(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import os

    from decode_service.config import DecodeSettings
    from pdserve.worker import engine

    monkeypatch.setattr(engine, "has_gpu", lambda: False)
    monkeypatch.setattr(os, "environ", {**os.environ, vllm_plugin.SCHED_ENV: "batch"})
    with caplog.at_level("WARNING"):
        engine.apply_environment(DecodeSettings(worker_id="d"))
    assert "PDSERVE_ENGINE_SCHED=batch is neither 'idle' nor empty" in caplog.text


# ---- the engine processes' scheduling class ----------------------------------------------
# lower_priority changes the scheduling class of the process that calls it, so each case runs
# in a process of its own: the process's threads, one started before and one after, report it.
PRIORITY_PROBE = """
import os, sys, threading
from pdserve.worker import vllm_plugin
before = threading.Event()
early = threading.Thread(target=before.wait)
early.start()
vllm_plugin.lower_priority()
classes = {os.sched_getscheduler(int(tid)) for tid in os.listdir("/proc/self/task")}
late = []
thread = threading.Thread(target=lambda: late.append(os.sched_getscheduler(0)))
thread.start()
thread.join()
before.set()
print(sorted(classes | set(late)))
"""


def _classes(env: dict[str, str], probe: str = PRIORITY_PROBE) -> list[int]:
    import ast
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if k not in env and not k.startswith("PDSERVE_")}
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env=base | env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return list(ast.literal_eval(out.stdout.strip()))


def test_an_engine_process_gives_way_with_all_its_threads() -> None:
    import os

    env = {vllm_plugin.SCHED_ENV: "idle", vllm_plugin.OWNER_ENV: str(os.getpid())}
    assert _classes(env) == [os.SCHED_IDLE]


@pytest.mark.parametrize("value", ["", "normal"])
def test_without_idle_the_engine_keeps_the_normal_class(value: str) -> None:
    import os

    env = {vllm_plugin.SCHED_ENV: value, vllm_plugin.OWNER_ENV: str(os.getpid())}
    assert _classes(env) == [os.SCHED_OTHER]


def test_the_worker_that_runs_the_engine_keeps_the_normal_class() -> None:
    import os

    # The probe names itself the owner: the worker's own process loads the plugin too.
    probe = PRIORITY_PROBE.replace(
        "vllm_plugin.lower_priority()",
        "os.environ[vllm_plugin.OWNER_ENV] = str(os.getpid()); vllm_plugin.lower_priority()",
    )
    assert _classes({vllm_plugin.SCHED_ENV: "idle"}, probe) == [os.SCHED_OTHER]


# ---- core lending: the model runner's step ------------------------------------------------
class _Output:
    """A scheduler's output: how many tokens the step computes (0: a poll, no forward pass)."""

    def __init__(self, tokens: int) -> None:
        self.total_num_scheduled_tokens = tokens


class _Worker:
    """vLLM's worker class as the wrapper sees it: execute_model returns None when sampling
    follows, an output when the step is over."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def execute_model(self, scheduler_output: Any) -> Any:
        self.log.append("execute")
        if scheduler_output.total_num_scheduled_tokens == 999:
            raise RuntimeError("the forward pass failed")
        return None if scheduler_output.total_num_scheduled_tokens else "polled"

    def sample_tokens(self, grammar_output: Any) -> Any:
        self.log.append("sample")
        return "sampled"


class _Step:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def begins(self) -> None:
        self.log.append("begins")

    def ends(self) -> None:
        self.log.append("ends")


def test_a_step_is_wrapped_from_its_forward_pass_to_its_sampling() -> None:
    log: list[str] = []
    worker = type("Worker", (_Worker,), {})
    vllm_plugin.wrap_steps(worker, _Step(log))
    vllm_plugin.wrap_steps(worker, _Step(log))  # once only
    runner = worker(log)
    assert runner.execute_model(_Output(4)) is None
    assert runner.sample_tokens(None) == "sampled"
    assert log == ["begins", "execute", "sample", "ends"]
    log.clear()
    assert runner.execute_model(_Output(0)) == "polled"  # a poll neither begins nor ends one
    assert log == ["execute"]
    log.clear()
    with pytest.raises(RuntimeError):
        runner.execute_model(_Output(999))
    assert log == ["begins", "execute", "ends"]


def _lending_table(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    """A new table of two cores, named to the engine's processes as the worker does."""
    from pdserve.worker.core_lending import CoreTable

    path = str(tmp_path / "cpu-lending")
    CoreTable.create(path, 2)
    monkeypatch.setenv(vllm_plugin.LENDING_ENV, path)
    return path


def test_a_borrower_step_sets_the_threads_it_may_use(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdserve.worker.core_lending import CoreTable, Lender

    path = _lending_table(tmp_path, monkeypatch)
    monkeypatch.setenv(vllm_plugin.OWN_ENV, "1")
    monkeypatch.setenv(vllm_plugin.BORROW_ENV, "0")
    bound = _bindings(monkeypatch, {1})
    threads: list[int] = []
    step = vllm_plugin.LendingStep(set_threads=threads.append)
    step.ends()  # no step began: nothing to end
    step.begins()  # core 0's owner has never computed: it may be borrowed
    step.ends()
    owner = Lender(CoreTable(path), [0])
    owner.step_begins()
    step.begins()
    step.ends()
    step.begins()  # the same count again: not set again
    step.ends()
    owner.step_ends()
    assert threads == [2, 1]
    assert bound == [[1]]  # the model runner's thread, on its own core once


def test_an_owner_step_that_never_began_does_not_reset_its_idle_time(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdserve.worker.core_lending import CoreTable

    path = _lending_table(tmp_path, monkeypatch)
    monkeypatch.setenv(vllm_plugin.LEND_ENV, "0")
    monkeypatch.delenv(vllm_plugin.BORROW_ENV, raising=False)
    step = vllm_plugin.LendingStep()
    step.begins()
    step.ends()
    ended = CoreTable(path).read(0).idle_since
    assert ended > 0
    step.ends()  # a second end (e.g. sampling after a step already over) changes nothing
    assert CoreTable(path).read(0).idle_since == ended


def _bindings(monkeypatch: pytest.MonkeyPatch, mask: set[int]) -> list[Any]:
    """Record the calling thread's bindings instead of making them; its mask is ``mask``."""
    bound: list[Any] = []
    monkeypatch.setattr(vllm_plugin.os, "sched_getaffinity", lambda pid: set(mask))
    monkeypatch.setattr(vllm_plugin.os, "sched_setaffinity", lambda pid, cores: bound.append(cores))
    return bound


@pytest.mark.parametrize(
    ("mask", "expected"),
    [
        ({2}, [{0, 1, 2, 3}]),  # bound by libgomp to the first core: freed for the model runner
        ({0, 1, 2, 3}, []),  # already all of them
        (set(range(8)), []),  # the worker's own process, bound to more: left as it is
    ],
)
def test_a_borrowing_engine_frees_the_thread_libgomp_bound_to_one_core(
    monkeypatch: pytest.MonkeyPatch, mask: set[int], expected: list[set[int]]
) -> None:
    monkeypatch.setenv(vllm_plugin.OWN_ENV, "2-3")
    monkeypatch.setenv(vllm_plugin.BORROW_ENV, "0-1")
    bound = _bindings(monkeypatch, mask)
    vllm_plugin.unbind_borrower()
    assert bound == expected


def test_an_engine_that_does_not_borrow_keeps_its_binding(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(vllm_plugin.BORROW_ENV, raising=False)
    bound = _bindings(monkeypatch, {1})
    vllm_plugin.unbind_borrower()
    assert bound == []
