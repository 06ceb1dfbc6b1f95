"""A vLLM general plugin (entry point ``vllm.general_plugins``): loaded by every vLLM process
of this environment, it does something only where a pdserve setting asks for it.

``PDSERVE_ENGINE_SPIN_PAUSE_S``: how long an engine process sleeps between two looks at vLLM's
shared-memory message queue while it waits for the next message (vLLM: none, it calls
``sched_yield`` in a loop for up to 1 s after each message, then sleeps until the next one is
announced). On the CPU the engine-core (scheduler) process and the model-runner process pass
every step through that queue, and each spins while the other works. When every core runs an
engine's OpenMP thread, as pdserve's workers do, the spinning scheduler takes its share of a
core the model needs. (Sleeping until the announcement alone does not work: vLLM's
announcements are dropped while one is still unread, and the reader then sleeps until its
timeout.)

``PDSERVE_ENGINE_SPIN_PAUSE_MAX_S``: the pause grows with the wait, to an eighth of the time
waited so far, up to this (default: no growth). A short wait (the model runner waiting for
the scheduler's next step) is seen within a fraction of a millisecond; a long one (the
scheduler waiting for a model step) costs few wake-ups, each of which would take a core from
an engine's OpenMP thread, and at most this much latency.

``PDSERVE_ENGINE_SCHED``: "idle" puts the engine's processes (every vLLM process but the one
named by ``PDSERVE_ENGINE_OWNER_PID``, the worker that runs the engine) in Linux's SCHED_IDLE
class: any other runnable thread, such as the gateway's or the worker's own, takes a core from
them at once when it wakes (``lower_priority``).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

PAUSE_ENV = "PDSERVE_ENGINE_SPIN_PAUSE_S"
MAX_PAUSE_ENV = "PDSERVE_ENGINE_SPIN_PAUSE_MAX_S"
SCHED_ENV = "PDSERVE_ENGINE_SCHED"
OWNER_ENV = "PDSERVE_ENGINE_OWNER_PID"
# A pause grows to this share of the time the reader has waited so far (up to the longest).
GROWTH = 0.125


def register() -> None:
    lower_priority()
    install_pause()
    install_lending()
    unbind_borrower()


def install_pause() -> None:
    """Make vLLM's message-queue waits pause (``PAUSE_ENV``, ``MAX_PAUSE_ENV``)."""
    value = os.environ.get(PAUSE_ENV, "")
    if not value:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    condition: Any = shm_broadcast.SpinCondition
    first = getattr(condition, "_pdserve_pause_s", None) is None
    shortest = condition._pdserve_pause_s = float(value)
    longest = os.environ.get(MAX_PAUSE_ENV, "")
    condition._pdserve_max_pause_s = max(float(longest), shortest) if longest else shortest
    if not first:
        return
    vllm_wait = condition.wait

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        # Where vLLM would yield the CPU and look again at once, sleep a little first; past
        # its busy period, vLLM's own wait (sleep until announced, or the timeout).
        now = time.monotonic()
        if now > self.last_read + self.busy_loop_s:
            vllm_wait(self, timeout_ms)
            return
        # A wait begins with the first look after a read (reads move last_read).
        if getattr(self, "_pdserve_read", None) != self.last_read:
            self._pdserve_read, self._pdserve_since = self.last_read, now
        waited = now - self._pdserve_since
        pause = min(condition._pdserve_max_pause_s, waited * GROWTH)
        time.sleep(max(condition._pdserve_pause_s, pause))

    condition.wait = wait


def lower_priority() -> None:
    """Move every thread of this engine process to the SCHED_IDLE class (``SCHED_ENV`` "idle";
    not in the process named by ``OWNER_ENV``). Threads and processes it starts later inherit
    the class. On 2 cores, with both engines computing, the threads that carry tokens from the
    decode engine to the client (the worker's, the gateway's, gRPC's) waited behind the
    engines for a core, and tokens reached the client in bunches. A normal thread that wakes
    takes a core from a SCHED_IDLE one at once. The engines share the cores between themselves
    as before; a process that keeps a core busy for a long time (another job on the machine)
    leaves them almost none."""
    if os.environ.get(SCHED_ENV) != "idle" or os.environ.get(OWNER_ENV) == str(os.getpid()):
        return
    to_idle_class(os.getpid())


def to_idle_class(pid: int) -> None:
    """Move every thread of process ``pid`` to the SCHED_IDLE class."""
    for_each_thread(pid, lambda tid: os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0)))


def for_each_thread(pid: int, act: Callable[[int], Any]) -> None:
    """``act(tid)`` for every thread of process ``pid``; a thread that ends meanwhile (or any
    other OSError from ``act``) is skipped."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            act(int(tid))


# Core lending (pdserve.worker.core_lending), set by the worker for its engine's processes
# (pdserve.worker.engine.lending_env): the table's path; the cores this engine owns and lends
# (a prefill engine); or its own cores and those it may borrow (a decode engine).
LENDING_ENV = "PDSERVE_CPU_LENDING"
LEND_ENV = "PDSERVE_CPU_LEND"
OWN_ENV = "PDSERVE_CPU_OWN"
BORROW_ENV = "PDSERVE_CPU_BORROW"


def install_lending() -> None:
    """Wrap the CPU model runner's step (``execute_model``, then ``sample_tokens``) in the
    engine's part of the core lending: an owner waits for its cores before it computes, a
    borrower computes with the threads it may use now."""
    if not os.environ.get(LENDING_ENV):
        return
    from vllm.v1.worker.cpu_worker import CPUWorker

    wrap_steps(CPUWorker, LendingStep())


def unbind_borrower() -> None:
    """In a borrowing engine's processes, let the calling thread run on all the engine's cores.

    A borrower binds its OpenMP threads with ``GOMP_CPU_AFFINITY`` (own cores first), and
    libgomp binds the thread that loads it to the first of them: in the engine-core process
    too, whose thread then spawns the model-runner process, which inherits that one core.
    libgomp there counts the CPUs it may use from that mask, finds fewer than its threads and
    throttles their spinning (100 spins instead of ~300,000): the threads then sleep and are
    woken at each of the hundreds of parallel regions of a step, which measured 56 ms decode
    steps where the same engine with its whole mask took 45 ms. Plugins load in the engine
    core before it spawns the model runner; the model runner binds its own thread back at its
    first step (``LendingStep``). A thread bound to more (the worker's own process) is left
    as it is."""
    if not os.environ.get(BORROW_ENV):
        return
    from pdserve.placement.engines import parse_cores

    cores = set(parse_cores(os.environ[OWN_ENV]) + parse_cores(os.environ[BORROW_ENV]))
    if os.sched_getaffinity(0) < cores:
        os.sched_setaffinity(0, cores)


def wrap_steps(worker: Any, step: Any) -> None:
    """Make ``worker`` (a vLLM worker class) call ``step.begins()`` before each forward pass
    and ``step.ends()`` once the pass and its sampling are over (or failed); once."""
    if getattr(worker, "_pdserve_lending", False):
        return
    worker._pdserve_lending = True
    execute, sample = worker.execute_model, worker.sample_tokens

    def execute_model(self: Any, scheduler_output: Any) -> Any:
        # A forward pass; not a poll (a prefill engine polls its KV transfers while blocks
        # are pinned, every few milliseconds: such a "step" must not count as computing).
        forward = scheduler_output.total_num_scheduled_tokens > 0
        if forward:
            step.begins()
        try:
            output = execute(self, scheduler_output)
        except BaseException:
            if forward:
                step.ends()
            raise
        if forward and output is not None:  # nothing left to sample: the step is over
            step.ends()
        return output

    def sample_tokens(self: Any, grammar_output: Any) -> Any:
        try:
            return sample(self, grammar_output)
        finally:
            step.ends()

    worker.execute_model, worker.sample_tokens = execute_model, sample_tokens


class LendingStep:
    """The model runner's part of the lending, made at its first step (in that process, from
    the environment above)."""

    def __init__(self, set_threads: Any = None) -> None:
        self._set_threads = set_threads
        self._part: Any = None
        self._borrows = False
        self._threads = 0
        self._active = False

    def begins(self) -> None:
        part = self._part or self._start()
        self._active = True
        threads = part.step_begins()
        # A borrower: the OpenMP threads of this step (each bound to its core).
        if self._borrows and threads != self._threads:
            self._set_threads(threads)
            self._threads = threads

    def ends(self) -> None:
        """The step is over (only one that began: an owner's idle time runs from here)."""
        if self._active:
            self._active = False
            self._part.step_ends()

    def _start(self) -> Any:
        from pdserve.placement.engines import parse_cores
        from pdserve.worker import core_lending

        table = core_lending.CoreTable(os.environ[LENDING_ENV])
        self._borrows = bool(os.environ.get(BORROW_ENV))
        if self._borrows:
            own = parse_cores(os.environ[OWN_ENV])
            # The model runner's thread is the OpenMP threads' first, on the engine's own
            # first core, as GOMP_CPU_AFFINITY has it (unbind_borrower freed it).
            os.sched_setaffinity(0, own[:1])
            self._part = core_lending.Borrower(table, len(own), parse_cores(os.environ[BORROW_ENV]))
            if self._set_threads is None:
                import torch

                # vLLM's CPU worker replaces torch.set_num_threads by a no-op once it has
                # bound its threads; the threads' binding stays as it is.
                self._set_threads = torch._C.set_num_threads
        else:
            self._part = core_lending.Lender(table, parse_cores(os.environ[LEND_ENV]))
        return self._part
