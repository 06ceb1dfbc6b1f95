"""Run a group of child processes: start them, wait until they are ready, watch them, stop them.

Generic (nothing about vLLM) so that it is testable with small Python children. Each child runs
in its own session, so it leads its own process group: a Ctrl-C in the terminal reaches only the
supervisor, which stops the children in order, and killing a child's group also kills what it
spawned (vLLM's EngineCore and workers). A group is never signalled after its leader was reaped:
exits are seen with ``waitid(WNOWAIT)``, which keeps the pid (= group id) from being reused.
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

ReadyCheck = Callable[[], Awaitable[bool]]
"""Answers True once the child serves; must not raise for "not up yet" (refused, timeout)."""


@dataclass(frozen=True)
class ChildSpec:
    name: str  # also the log file name: <log_dir>/<name>.log
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)  # added to the supervisor's environment
    ready_check: ReadyCheck | None = None  # None: ready as soon as it has started
    stop_stage: int = 0  # stopped in ascending stage; children of one stage are stopped together


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
        self.reaped = False

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else -1

    def start(self) -> None:
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

    def age(self) -> float:
        return time.monotonic() - self.started_at

    def status(self) -> str:
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
    """What happens when a child exits on its own after startup."""

    # A cluster half alive is worse than none: stop every other child and exit 1.
    STOP_ALL = "stop-all"


@dataclass(frozen=True)
class SupervisorOptions:
    log_dir: Path
    startup_timeout_s: float = 600.0
    grace_s: float = 20.0  # how long a child may take to exit after SIGTERM
    status_interval_s: float = 5.0
    poll_interval_s: float = 0.5
    probe_timeout_s: float = 2.0
    tail_lines: int = 40
    on_child_exit: ChildExitPolicy = ChildExitPolicy.STOP_ALL


@dataclass(frozen=True)
class _Outcome:
    kind: Literal["ready", "stopped", "exited", "timeout"]
    children: tuple[Child, ...] = ()  # the one that exited, or those not ready in time


class Supervisor:
    """Starts ``specs`` in order, calls ``on_ready`` once all are ready, and stops them all when
    the user asks (exit code 0) or when one fails (exit code 1)."""

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

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            outcome = await self._start_all()
            if outcome.kind == "ready":
                self._on_ready()
                outcome = await self._monitor()
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

    async def _start_all(self) -> _Outcome:
        for child in self._children:
            try:
                child.start()
            except OSError as exc:
                self._say(f"cannot start {child.name}: {exc}")
                return _Outcome("exited", (child,))
            self._say(f"started {child.name} (pid {child.pid}), log: {child.log_path}")
        return await self._wait_ready()

    async def _wait_ready(self) -> _Outcome:
        deadline = time.monotonic() + self.options.startup_timeout_s
        next_status = time.monotonic() + self.options.status_interval_s
        while not self._stop.is_set():
            exited = self._first_exited()
            if exited is not None:
                return _Outcome("exited", (exited,))
            pending = [c for c in self._children if not c.ready]
            await asyncio.gather(*(self._probe(c) for c in pending))
            pending = [c for c in pending if not c.ready]
            if not pending:
                return _Outcome("ready")
            if time.monotonic() >= deadline:
                return _Outcome("timeout", tuple(pending))
            if time.monotonic() >= next_status:
                self._say("waiting: " + ", ".join(c.status() for c in self._children))
                next_status = time.monotonic() + self.options.status_interval_s
            await self._sleep(self._stop, self.options.poll_interval_s)
        return _Outcome("stopped")

    async def _probe(self, child: Child) -> None:
        check = child.spec.ready_check
        if check is None:
            child.ready = True
            return
        try:
            child.ready = await asyncio.wait_for(check(), self.options.probe_timeout_s)
        except TimeoutError:
            child.ready = False
        if child.ready:
            self._say(f"{child.name} ready after {child.age():.0f} s")

    async def _monitor(self) -> _Outcome:
        while not self._stop.is_set():
            exited = self._first_exited()
            if exited is not None:
                return _Outcome("exited", (exited,))
            await self._sleep(self._stop, self.options.poll_interval_s)
        return _Outcome("stopped")

    def _first_exited(self) -> Child | None:
        for child in self._children:
            if child.reap_if_exited():
                return child
        return None

    def _report(self, outcome: _Outcome) -> int:
        if outcome.kind == "exited":
            child = outcome.children[0]
            when = "unexpectedly" if all(c.ready for c in self._children) else "during startup"
            self._say(f"{child.name} {child.exit_description()} {when}")
            self._show_tail(child)
            # ChildExitPolicy.STOP_ALL is the only policy: the caller stops everything next.
            self._say(f"policy {self.options.on_child_exit.value}: stopping everything else")
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
