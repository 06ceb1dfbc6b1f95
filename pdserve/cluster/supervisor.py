"""Run a group of child processes: start them, wait until they are ready, watch them, restart
one that exits (``ChildExitPolicy``), stop them all when asked.

Generic (nothing about vLLM) so that it is testable with small Python children. Each child runs
in its own session, so it leads its own process group: a Ctrl-C in the terminal reaches only the
supervisor, which stops the children in order, and killing a child's group also kills what it
spawned (vLLM's EngineCore and workers). A group is never signalled after its leader was reaped:
exits are seen with ``waitid(WNOWAIT)``, which keeps the pid (= group id) from being reused.

A child that fails before it was ever ready is a configuration error (a bad argument, a port in
use): restarting it would only loop, so everything stops with its log tail. A child that exits
after it was ready once is restarted after a backoff (``pdserve.cluster.backoff``), with the same
command and environment, while the others keep running.

A child may wait for others (``after``): it is started once they are all ready for the first
time, e.g. engines that share one GPU, which measure their memory use while they start.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pdserve.cluster.backoff import Backoff

ReadyCheck = Callable[[], Awaitable[bool]]
"""Answers True once the child serves; must not raise for "not up yet" (refused, timeout)."""


@dataclass(frozen=True)
class ChildSpec:
    name: str  # also the log file name: <log_dir>/<name>.log
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)  # added to the supervisor's environment
    ready_check: ReadyCheck | None = None  # None: ready as soon as it has started
    stop_stage: int = 0  # stopped in ascending stage; children of one stage are stopped together
    after: tuple[str, ...] = ()  # started once these children (by name) have been ready


# A day of vLLM logging can be many MB; the tail needs only the end of the file.
_TAIL_BYTES = 256 * 1024


class Child:
    """One child of the supervisor: its process, its log file and whether it is ready."""

    def __init__(self, spec: ChildSpec, log_dir: Path) -> None:
        self.spec = spec
        self.name = spec.name
        self.log_path = log_dir / f"{spec.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_offset = 0  # where this run's output starts (the log is appended to)
        self.started_at = 0.0
        self.ready = False
        self.ready_at: float | None = None  # when this run became ready
        self.ever_ready = False  # any run: from then on an exit means a restart
        self.reaped = False
        self.restarts = 0  # in all
        self.in_a_row = 0  # restarts since the child last ran stably (drives the backoff)
        self.restart_at: float | None = None  # set while it waits to be restarted
        self.slow_warned = False

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else -1

    def start(self) -> None:
        """Start (again): a new process on the same command line, appending to the same log."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env_text = "".join(f"{k}={shlex.quote(v)} " for k, v in self.spec.env.items())
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        header = f"=== {stamp} pdserve starts: {env_text}{shlex.join(self.spec.argv)}\n"
        with self.log_path.open("ab") as log:
            log.write(header.encode())
            log.flush()
            self.log_offset = log.tell()
            self.proc = subprocess.Popen(
                self.spec.argv,
                env={**os.environ, **self.spec.env},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own session and process group: see module docstring
            )
        self.started_at = time.monotonic()
        self.ready, self.ready_at, self.reaped, self.slow_warned = False, None, False, False

    def mark_ready(self) -> None:
        self.ready, self.ready_at, self.ever_ready = True, time.monotonic(), True

    def ready_for(self) -> float | None:
        return None if self.ready_at is None else time.monotonic() - self.ready_at

    def age(self) -> float:
        return time.monotonic() - self.started_at

    def status(self) -> str:
        if self.proc is None:
            return f"{self.name} (starts after {', '.join(self.spec.after)})"
        if self.restart_at is not None:
            return (
                f"{self.name} (restarting in {max(0.0, self.restart_at - time.monotonic()):.0f} s)"
            )
        return f"{self.name} ready" if self.ready else f"{self.name} (loading, {self.age():.0f} s)"

    def _has_exited(self) -> bool:
        """True once the process has exited, without reaping it (its pid stays reserved)."""
        assert self.proc is not None
        if not hasattr(os, "waitid"):  # macOS: poll() reaps; a tiny pid-reuse window remains
            return self.proc.poll() is not None
        try:
            flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
            return os.waitid(os.P_PID, self.proc.pid, flags) is not None
        except ChildProcessError:
            return True

    def reap_if_exited(self) -> bool:
        """If the process has exited: kill what is left of its group, reap it; True then."""
        if self.reaped:
            return True
        if self.proc is None or not self._has_exited():
            return False
        self.kill_group()
        self.proc.wait()
        self.reaped = True
        return True

    def send(self, sig: signal.Signals) -> None:
        if self.proc is not None and not self.reaped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)

    def kill_group(self) -> None:
        if self.proc is not None and not self.reaped:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    def wait_reaped(self, timeout_s: float = 5.0) -> None:
        if self.proc is None or self.reaped:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout_s)
            self.reaped = True

    def exit_description(self) -> str:
        code = self.proc.returncode if self.proc is not None else None
        if code is None:
            return "did not start"
        if code < 0:
            return f"was killed by signal {-code} ({signal.strsignal(-code)})"
        return f"exited with code {code}"

    def log_tail(self, lines: int) -> list[str]:
        """The last ``lines`` lines this run wrote to the log."""
        try:
            with self.log_path.open("rb") as log:
                size = log.seek(0, os.SEEK_END)
                log.seek(max(self.log_offset, size - _TAIL_BYTES))
                text = log.read().decode(errors="replace")
        except OSError:
            return []
        return text.splitlines()[-lines:]


class ChildExitPolicy(enum.Enum):
    """What happens when a child that was ready once exits (a child that never was ready always
    stops everything: see the module docstring)."""

    # Restart it after a backoff; the others keep running (the gateway routes around a worker).
    RESTART = "restart"
    # A cluster half alive is worse than none: stop every other child and exit 1.
    STOP_ALL = "stop-all"


@dataclass(frozen=True)
class SupervisorOptions:
    log_dir: Path
    startup_timeout_s: float = 600.0  # all ready by then, or stop (after: a restart only warns)
    grace_s: float = 20.0  # how long a child may take to exit after SIGTERM
    status_interval_s: float = 5.0
    poll_interval_s: float = 0.5
    probe_timeout_s: float = 2.0
    tail_lines: int = 40
    on_child_exit: ChildExitPolicy = ChildExitPolicy.RESTART
    backoff: Backoff = field(default_factory=Backoff)


@dataclass(frozen=True)
class _Outcome:
    kind: Literal["stopped", "exited", "timeout"]
    children: tuple[Child, ...] = ()  # the one that exited, or those not ready in time


class Supervisor:
    """Starts ``specs`` in order, calls ``on_ready`` once all are ready, restarts a child that
    exits (by ``options.on_child_exit``), and stops them all when the user asks (exit code 0)
    or when one fails for good (exit code 1)."""

    def __init__(
        self,
        specs: Iterable[ChildSpec],
        options: SupervisorOptions,
        on_ready: Callable[[], None] = lambda: None,
        say: Callable[[str], None] = lambda line: print(line, flush=True),
    ) -> None:
        self.options = options
        self._on_ready = on_ready
        self._say = say
        self._children = [Child(spec, options.log_dir) for spec in specs]
        self._stop = asyncio.Event()
        self._force = asyncio.Event()
        self._all_ready_once = False

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            outcome = self._start_all() or await self._supervise()
            code = self._report(outcome)
            await self._stop_all()
            return code
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            for child in self._children:  # safety net if anything above raised
                child.kill_group()
                child.wait_reaped()

    def _on_signal(self, sig: signal.Signals) -> None:
        if not self._stop.is_set():
            self._say(f"{sig.name} received: stopping (press Ctrl-C again to kill at once)")
            self._stop.set()
            return
        self._say(f"{sig.name} received again: killing everything now")
        self._force.set()
        for child in self._children:
            child.kill_group()

    def _start_all(self) -> _Outcome | None:
        """Start every child that waits for none, and those whose predecessors are ready."""
        ready = {c.name for c in self._children if c.ever_ready}
        for child in self._children:
            if child.proc is not None or not set(child.spec.after) <= ready:
                continue
            try:
                child.start()
            except OSError as exc:
                self._say(f"cannot start {child.name}: {exc}")
                return _Outcome("exited", (child,))
            self._say(f"started {child.name} (pid {child.pid}), log: {child.log_path}")
        return None

    async def _supervise(self) -> _Outcome:
        """Until the user stops: handle exits, restart when due, probe who is not ready yet."""
        deadline = time.monotonic() + self.options.startup_timeout_s
        next_status = time.monotonic() + self.options.status_interval_s
        while not self._stop.is_set():
            failed = self._handle_exits()
            if failed is not None:
                return _Outcome("exited", (failed,))
            not_started = self._start_all()
            if not_started is not None:
                return not_started
            self._restart_due()
            pending = [
                c
                for c in self._children
                if c.proc is not None and c.restart_at is None and not c.ready
            ]
            await asyncio.gather(*(self._probe(c) for c in pending))
            if not self._all_ready_once:
                if all(c.ready for c in self._children):
                    self._all_ready_once = True
                    self._on_ready()
                elif time.monotonic() >= deadline:
                    return _Outcome("timeout", tuple(c for c in self._children if not c.ready))
            if self._stop.is_set():
                break
            self._warn_slow_restarts()
            # "waiting: ..." every status_interval_s while any child is not ready
            if all(c.ready for c in self._children):
                next_status = time.monotonic() + self.options.status_interval_s
            elif time.monotonic() >= next_status:
                self._say("waiting: " + ", ".join(c.status() for c in self._children))
                next_status = time.monotonic() + self.options.status_interval_s
            await self._sleep(self._stop, self.options.poll_interval_s)
        return _Outcome("stopped")

    def _handle_exits(self) -> Child | None:
        """Schedule a restart of every child that has exited; the first that the policy does
        not restart is returned."""
        for child in self._children:
            running = child.restart_at is None
            if running and child.reap_if_exited() and not self._restart_later(child):
                return child
        return None

    def _restart_later(self, child: Child) -> bool:
        """Schedule a restart of ``child``, which has exited; False if the policy says stop."""
        if not child.ever_ready or self.options.on_child_exit is ChildExitPolicy.STOP_ALL:
            return False
        backoff = self.options.backoff
        if backoff.is_stable(child.ready_for()):
            child.in_a_row = 0
        child.in_a_row += 1
        child.restarts += 1
        delay = backoff.delay(child.in_a_row)
        child.restart_at = time.monotonic() + delay
        self._say(
            f"{child.name} {child.exit_description()} after {child.age():.0f} s; "
            f"restarting in {delay:g} s (restart {child.restarts})"
        )
        self._show_tail(child)
        return True

    def _restart_due(self) -> None:
        for child in self._children:
            if child.restart_at is None or time.monotonic() < child.restart_at:
                continue
            try:
                child.start()
            except OSError as exc:  # e.g. the program was removed: try again, later
                child.in_a_row += 1
                delay = self.options.backoff.delay(child.in_a_row)
                child.restart_at = time.monotonic() + delay
                self._say(f"cannot restart {child.name}: {exc}; trying again in {delay:g} s")
                continue
            child.restart_at = None
            self._say(f"restarted {child.name} (pid {child.pid}, restart {child.restarts})")

    def _warn_slow_restarts(self) -> None:
        """A restarted child has no deadline (stopping everything for it would undo the point
        of restarting), but the user hears once that it is taking too long."""
        for child in self._children:
            late = child.age() >= self.options.startup_timeout_s
            loading = child.restarts and child.restart_at is None and not child.ready
            if loading and late and not child.slow_warned:
                child.slow_warned = True
                self._say(
                    f"{child.name} is not ready {child.age():.0f} s after restart "
                    f"{child.restarts}; still waiting (log: {child.log_path})"
                )

    async def _probe(self, child: Child) -> None:
        check = child.spec.ready_check
        ready = True
        if check is not None:
            try:
                ready = await asyncio.wait_for(check(), self.options.probe_timeout_s)
            except TimeoutError:
                ready = False
        if not ready:
            return
        child.mark_ready()
        if child.restarts:
            self._say(
                f"{child.name} is back: ready {child.age():.0f} s after restart {child.restarts}"
            )
        else:
            self._say(f"{child.name} ready after {child.age():.0f} s")

    def _report(self, outcome: _Outcome) -> int:
        if outcome.kind == "exited":
            child = outcome.children[0]
            if child.ever_ready:
                self._say(f"{child.name} {child.exit_description()} unexpectedly")
                self._show_tail(child)
                self._say(f"policy {self.options.on_child_exit.value}: stopping everything else")
            else:
                self._say(f"{child.name} {child.exit_description()} during startup")
                self._show_tail(child)
                self._say("a child that was never ready is not restarted: stopping everything else")
            return 1
        if outcome.kind == "timeout":
            names = ", ".join(c.status() for c in outcome.children)
            self._say(f"startup timed out after {self.options.startup_timeout_s:.0f} s: {names}")
            for child in outcome.children:
                self._show_tail(child)
            return 1
        return 0

    def _show_tail(self, child: Child) -> None:
        lines = child.log_tail(self.options.tail_lines)
        self._say(f"--- last {len(lines)} lines of {child.log_path} ---")
        for line in lines:
            self._say(f"  | {line}")
        self._say(f"--- end of {child.name} log ---")

    async def _stop_all(self) -> None:
        for stage in sorted({c.spec.stop_stage for c in self._children}):
            await self._stop_stage([c for c in self._children if c.spec.stop_stage == stage])
        self._say("all processes stopped")

    async def _stop_stage(self, group: list[Child]) -> None:
        # A child waiting for its restart was reaped: reap_if_exited is True, nothing to stop.
        running = [c for c in group if c.proc is not None and not c.reap_if_exited()]
        if not running:
            return
        self._say("stopping " + ", ".join(f"{c.name} (pid {c.pid})" for c in running))
        for child in running:
            child.send(signal.SIGTERM)
        await self._wait_exit(running, self.options.grace_s)
        late = [c for c in running if not c.reaped]
        if late and not self._force.is_set():
            names = ", ".join(c.name for c in late)
            grace = self.options.grace_s
            self._say(f"{names}: still running after {grace:.0f} s: killing process group")
        for child in late:  # SIGKILL cannot be ignored
            child.kill_group()
            child.wait_reaped()

    async def _wait_exit(self, children: list[Child], timeout_s: float) -> None:
        """Until all have exited, ``timeout_s`` has passed, or the user forces the stop."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self._force.is_set():
            if all([c.reap_if_exited() for c in children]):  # a list: reap every one now
                return
            await self._sleep(self._force, min(0.05, self.options.poll_interval_s))

    @staticmethod
    async def _sleep(wake: asyncio.Event, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), seconds)
