"""pdserve.cluster.supervisor with real processes: small Python children that serve HTTP and spawn a
sleeping grandchild, supervised by tests/integration/supervisor_driver.py in its own process."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.supervisor_driver import READY_LINE

DRIVER = Path(__file__).with_name("supervisor_driver.py")

# argv: port pid_file mode delay_s. Appends "<pid> <grandchild pid>" to pid_file (a line per
# run), then by mode: serve: answer HTTP GET with 200 after delay_s; ignore-term: the same, deaf
# to SIGTERM; fail: print a last words line and exit 3 after delay_s; sleep: never serve;
# serve-then-exit: serve at once, exit 3 after delay_s; slow-restart: serve at once on the
# first run, never on later ones (a restart that is still loading).
CHILD = r"""
import http.server, os, signal, subprocess, sys, threading, time
port, pid_file, mode, delay = int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])
if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
first_run = not os.path.exists(pid_file)
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(pid_file, "a") as f:
    f.write(f"{os.getpid()} {grandchild.pid}\n")
print("child started", flush=True)
class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
class Server(http.server.HTTPServer):
    allow_reuse_port = True  # joins the test's reservation of the port (see reserved_port)
def serve():
    Server(("127.0.0.1", port), Ok).serve_forever()
if mode == "serve-then-exit":
    threading.Thread(target=serve, daemon=True).start()
    time.sleep(delay)
    print("crashing: the last words of a flaky child", flush=True)
    sys.exit(3)
if mode == "slow-restart" and not first_run:
    time.sleep(600)
time.sleep(delay)
if mode == "fail":
    print("boom: the last words of a failing child", flush=True)
    sys.exit(3)
if mode == "sleep":
    time.sleep(600)
serve()
"""


_RESERVED: list[socket.socket] = []


def reserved_port() -> int:
    """A port the child will bind, held by this process until then and after: bound with
    SO_REUSEPORT and never listened on, so only a socket that also sets SO_REUSEPORT (the
    child's; same user) can bind it too, and connections go to the child's listener."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", 0))
    _RESERVED.append(sock)
    return int(sock.getsockname()[1])


def pid_gone(pid: int) -> bool:
    """Gone or a zombie (an orphan's zombie waits for init, which may be slow to reap)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    except OSError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 0)
            return False
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


class Driver:
    """The supervisor under test, in its own process; its output is collected line by line."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(DRIVER), json.dumps(config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, text: str, timeout_s: float = 15.0) -> None:
        if not wait_until(lambda: any(text in line for line in self.lines), timeout_s):
            pytest.fail(f"no line with {text!r} within {timeout_s} s; output:\n{self.output}")

    def wait_exit(self, timeout_s: float = 15.0) -> int:
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"supervisor still running after {timeout_s} s; output:\n{self.output}")
        self._reader.join(5)
        return code


class Cluster:
    """Builds driver configs with children in tmp_path; remembers every pid to check and clean."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.children: list[dict[str, Any]] = []
        self.drivers: list[Driver] = []
        self.ports: dict[str, int] = {}

    def child(
        self,
        name: str,
        mode: str = "serve",
        delay_s: float = 0.0,
        stage: int = 0,
        after: tuple[str, ...] = (),
    ) -> None:
        port = self.ports[name] = reserved_port()
        pid_file = self.tmp_path / f"{name}.pids"
        argv = [sys.executable, "-c", CHILD, str(port), str(pid_file), mode, str(delay_s)]
        url = None if mode == "sleep" else f"http://127.0.0.1:{port}/health"
        self.children.append(
            {"name": name, "argv": argv, "url": url, "stage": stage, "after": list(after)}
        )

    def start(
        self,
        grace_s: float = 5.0,
        startup_timeout_s: float = 20.0,
        on_child_exit: str = "restart",
        backoff: tuple[float, float, float] = (0.2, 1.0, 60.0),
    ) -> Driver:
        config = {
            "log_dir": str(self.tmp_path / "logs"),
            "grace_s": grace_s,
            "startup_timeout_s": startup_timeout_s,
            "on_child_exit": on_child_exit,
            "backoff": backoff,
            "children": self.children,
        }
        self.drivers.append(Driver(config))
        return self.drivers[-1]

    def runs(self, name: str) -> list[list[int]]:
        """The child's and its grandchild's pid, per run so far (complete lines only)."""
        pid_file = self.tmp_path / f"{name}.pids"
        text = pid_file.read_text() if pid_file.exists() else ""
        return [[int(p) for p in line.split()] for line in text.splitlines(keepends=True)
                if line.endswith("\n")]  # fmt: skip

    def pids(self, name: str) -> list[int]:
        """The pids of the child's latest run, once it has written them."""
        assert wait_until(lambda: bool(self.runs(name))), f"{name} never wrote its pids"
        return self.runs(name)[-1]

    def all_pids(self) -> list[int]:
        return [p for c in self.children for run in self.runs(c["name"]) for p in run]

    def assert_all_gone(self) -> None:
        pids = self.all_pids()
        assert pids, "no child wrote its pids"
        assert wait_until(lambda: all(pid_gone(p) for p in pids), 5.0), (
            f"left behind: {[p for p in pids if not pid_gone(p)]}"
        )

    def cleanup(self) -> None:
        for driver in self.drivers:
            if driver.proc.poll() is None:
                driver.proc.kill()
                driver.proc.wait()
        for pid in self.all_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    made = Cluster(tmp_path)
    yield made
    made.cleanup()


def test_waits_for_readiness_then_sigterm_stops_children_and_grandchildren(
    cluster: Cluster,
) -> None:
    cluster.child("front", stage=0)
    cluster.child("slow", delay_s=1.5, stage=1)
    started = time.monotonic()
    driver = cluster.start()

    driver.wait_for(READY_LINE)
    assert time.monotonic() - started >= 1.5, "declared ready before the slow child served"
    assert "waiting: front ready, slow (loading" in driver.output
    assert driver.output.index("slow ready after") < driver.output.index(READY_LINE)
    pids = cluster.pids("front") + cluster.pids("slow")
    assert not any(pid_gone(p) for p in pids)

    driver.proc.send_signal(signal.SIGTERM)
    assert driver.wait_exit() == 0, driver.output
    cluster.assert_all_gone()
    # SIGTERM stopped them, not the SIGKILL after the grace period (which says so)
    assert "still running after" not in driver.output
    # stage 0 is stopped before stage 1 (the gateway before the workers)
    assert driver.output.index("stopping front") < driver.output.index("stopping slow")
    assert "all processes stopped" in driver.output


def test_a_child_waiting_for_another_starts_once_that_one_is_ready(cluster: Cluster) -> None:
    """Engines sharing a GPU: the second starts only after the first has loaded."""
    cluster.child("first", delay_s=1.0)
    cluster.child("second", after=("first",))
    driver = cluster.start()

    driver.wait_for(READY_LINE)
    assert "second (starts after first)" in driver.output
    lines = driver.output
    assert lines.index("first ready after") < lines.index("started second"), lines
    assert (
        lines.index("started second") < lines.index("second ready after") < lines.index(READY_LINE)
    )
    driver.proc.send_signal(signal.SIGTERM)
    assert driver.wait_exit() == 0, driver.output
    cluster.assert_all_gone()


def test_child_exiting_during_startup_fails_with_its_log_tail(cluster: Cluster) -> None:
    logs = cluster.tmp_path / "logs"
    logs.mkdir()
    (logs / "broken.log").write_text("a line from an earlier run\n")
    cluster.child("broken", mode="fail", delay_s=0.3)
    cluster.child("other", mode="sleep")
    driver = cluster.start()

    assert driver.wait_exit() == 1, driver.output
    assert "broken exited with code 3 during startup" in driver.output
    # the restart policy (the driver's default here) does not loop on a configuration error
    assert "was never ready is not restarted" in driver.output
    assert "restarting in" not in driver.output
    assert "  | boom: the last words of a failing child" in driver.output
    assert "  | child started" in driver.output
    assert "earlier run" not in driver.output, "the tail must show only this run's lines"
    assert READY_LINE not in driver.output
    cluster.assert_all_gone()
    log = (logs / "broken.log").read_text()
    assert "pdserve starts:" in log and " fail " in log, "header with the command line"


def test_child_ignoring_sigterm_is_killed_after_grace(cluster: Cluster) -> None:
    cluster.child("deaf", mode="ignore-term")
    driver = cluster.start(grace_s=1.0)
    driver.wait_for(READY_LINE)

    stop_sent = time.monotonic()
    driver.proc.send_signal(signal.SIGTERM)
    assert driver.wait_exit() == 0, driver.output
    assert time.monotonic() - stop_sent >= 1.0, "killed before the grace period ended"
    assert "deaf: still running after 1 s: killing process group" in driver.output
    cluster.assert_all_gone()


def test_second_signal_kills_at_once(cluster: Cluster) -> None:
    cluster.child("deaf", mode="ignore-term")
    driver = cluster.start(grace_s=60.0)
    driver.wait_for(READY_LINE)

    driver.proc.send_signal(signal.SIGINT)
    driver.wait_for("stopping deaf")
    driver.proc.send_signal(signal.SIGINT)
    assert driver.wait_exit(timeout_s=10.0) == 0, driver.output
    assert "SIGINT received again: killing everything now" in driver.output
    cluster.assert_all_gone()


def test_child_dying_after_startup_stops_everything(cluster: Cluster) -> None:
    cluster.child("victim")
    cluster.child("survivor")
    driver = cluster.start(on_child_exit="stop-all")
    driver.wait_for(READY_LINE)

    os.kill(cluster.pids("victim")[0], signal.SIGKILL)
    assert driver.wait_exit() == 1, driver.output
    assert "victim was killed by signal 9" in driver.output
    assert "unexpectedly" in driver.output
    assert "policy stop-all" in driver.output
    cluster.assert_all_gone()


def test_startup_timeout_stops_everything(cluster: Cluster) -> None:
    cluster.child("stuck", mode="serve", delay_s=600)
    # Long enough for the child to start and log even on a loaded machine (its log tail is
    # part of what is checked), short next to its 600 s of "loading".
    driver = cluster.start(startup_timeout_s=10.0)

    assert driver.wait_exit() == 1, driver.output
    assert "startup timed out after 10 s: stuck (loading" in driver.output
    assert "  | child started" in driver.output
    cluster.assert_all_gone()


def test_stop_requested_during_startup_exits_0(cluster: Cluster) -> None:
    cluster.child("loading", delay_s=600)
    driver = cluster.start()
    cluster.pids("loading")

    driver.proc.send_signal(signal.SIGINT)
    assert driver.wait_exit() == 0, driver.output
    assert "stopping loading" in driver.output and READY_LINE not in driver.output
    cluster.assert_all_gone()


def http_status(port: int) -> int | None:
    try:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no env proxy
        with opener.open(f"http://127.0.0.1:{port}/", timeout=5) as reply:
            return int(reply.status)
    except OSError:
        return None


def restart_delays(output: str) -> list[float]:
    return [float(d) for d in re.findall(r"restarting in ([0-9.]+) s", output)]


def test_child_killed_after_ready_is_restarted_while_others_keep_running(
    cluster: Cluster,
) -> None:
    cluster.child("victim", stage=0)
    cluster.child("survivor", stage=1)
    driver = cluster.start(backoff=(0.5, 5.0, 60.0))
    driver.wait_for(READY_LINE)
    victim, survivor = cluster.pids("victim"), cluster.pids("survivor")

    os.kill(victim[0], signal.SIGKILL)  # the child only: its grandchild goes with its group
    driver.wait_for("victim is back: ready")
    out = driver.output
    assert "victim was killed by signal 9 (Killed) after" in out
    assert "restarting in 0.5 s (restart 1)" in out
    assert out.index("restarting in") < out.index("  | child started")  # the log tail
    assert out.index("restarted victim (pid") < out.index("victim is back")
    assert out.count(READY_LINE) == 1, "on_ready is for the first start only"
    runs = cluster.runs("victim")
    assert len(runs) == 2 and runs[1] != victim
    assert wait_until(lambda: all(pid_gone(p) for p in victim)), "the old group is gone"
    assert not any(pid_gone(p) for p in runs[1] + survivor)
    assert cluster.runs("survivor") == [survivor], "the survivor was left alone"
    assert http_status(cluster.ports["victim"]) == 200, "the restart serves on the same port"

    driver.proc.send_signal(signal.SIGTERM)
    assert driver.wait_exit() == 0, driver.output
    assert f"stopping victim (pid {runs[1][0]})" in driver.output
    cluster.assert_all_gone()


def test_crash_loop_backoff_doubles_up_to_the_cap(cluster: Cluster) -> None:
    cluster.child("flaky", mode="serve-then-exit", delay_s=1.0)
    cluster.child("steady")
    driver = cluster.start(backoff=(0.2, 0.8, 60.0))
    driver.wait_for(READY_LINE)

    driver.wait_for("(restart 4)", timeout_s=60.0)
    assert restart_delays(driver.output)[:4] == [0.2, 0.4, 0.8, 0.8]
    assert "flaky exited with code 3 after" in driver.output
    assert "  | crashing: the last words of a flaky child" in driver.output
    assert len(cluster.runs("steady")) == 1

    driver.proc.send_signal(signal.SIGINT)
    assert driver.wait_exit() == 0, driver.output
    cluster.assert_all_gone()


def test_backoff_resets_after_the_child_ran_stably(cluster: Cluster) -> None:
    # ready for ~3 s each run, stable after 0.5 s: every restart is the first in a row
    cluster.child("flaky", mode="serve-then-exit", delay_s=3.0)
    driver = cluster.start(backoff=(0.2, 10.0, 0.5))
    driver.wait_for(READY_LINE)

    driver.wait_for("(restart 3)", timeout_s=60.0)
    assert restart_delays(driver.output)[:3] == [0.2, 0.2, 0.2]

    driver.proc.send_signal(signal.SIGINT)
    assert driver.wait_exit() == 0, driver.output
    cluster.assert_all_gone()


def test_ctrl_c_during_backoff_stops_at_once(cluster: Cluster) -> None:
    cluster.child("victim")
    cluster.child("survivor")
    driver = cluster.start(backoff=(600.0, 600.0, 60.0))
    driver.wait_for(READY_LINE)

    os.kill(cluster.pids("victim")[0], signal.SIGKILL)
    driver.wait_for("restarting in 600 s (restart 1)")
    driver.proc.send_signal(signal.SIGINT)
    assert driver.wait_exit() == 0, driver.output  # within its timeout: not after the backoff
    assert "restarted victim" not in driver.output
    assert len(cluster.runs("victim")) == 1
    cluster.assert_all_gone()


def test_ctrl_c_while_a_restart_is_loading_stops_it(cluster: Cluster) -> None:
    cluster.child("victim", mode="slow-restart")
    cluster.child("survivor")
    driver = cluster.start(backoff=(0.2, 1.0, 60.0))
    driver.wait_for(READY_LINE)

    os.kill(cluster.pids("victim")[0], signal.SIGKILL)
    driver.wait_for("restarted victim (pid")
    assert wait_until(lambda: len(cluster.runs("victim")) == 2), driver.output
    loading = cluster.runs("victim")[1]
    driver.proc.send_signal(signal.SIGINT)
    assert driver.wait_exit() == 0, driver.output
    assert "victim is back" not in driver.output
    assert f"stopping victim (pid {loading[0]})" in driver.output
    cluster.assert_all_gone()
