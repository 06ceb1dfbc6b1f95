"""pdserve.supervisor with real processes: small Python children that serve HTTP and spawn a
sleeping grandchild, supervised by tests/integration/supervisor_driver.py in its own process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.supervisor_driver import READY_LINE

DRIVER = Path(__file__).with_name("supervisor_driver.py")

# argv: port pid_file mode delay_s. Writes "<pid> <grandchild pid>" to pid_file, then by mode:
# serve: answer HTTP GET with 200 after delay_s; ignore-term: the same, deaf to SIGTERM;
# fail: print a last words line and exit 3 after delay_s; sleep: never serve.
CHILD = r"""
import http.server, os, signal, subprocess, sys, time
port, pid_file, mode, delay = int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])
if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(pid_file + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {grandchild.pid}")
os.replace(pid_file + ".tmp", pid_file)
print("child started", flush=True)
time.sleep(delay)
if mode == "fail":
    print("boom: the last words of a failing child", flush=True)
    sys.exit(3)
if mode == "sleep":
    time.sleep(600)
class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
class Server(http.server.HTTPServer):
    allow_reuse_port = True  # joins the test's reservation of the port (see reserved_port)
Server(("127.0.0.1", port), Ok).serve_forever()
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

    def child(self, name: str, mode: str = "serve", delay_s: float = 0.0, stage: int = 0) -> None:
        port = reserved_port()
        pid_file = self.tmp_path / f"{name}.pids"
        argv = [sys.executable, "-c", CHILD, str(port), str(pid_file), mode, str(delay_s)]
        url = None if mode == "sleep" else f"http://127.0.0.1:{port}/health"
        self.children.append({"name": name, "argv": argv, "url": url, "stage": stage})

    def start(self, grace_s: float = 5.0, startup_timeout_s: float = 20.0) -> Driver:
        config = {
            "log_dir": str(self.tmp_path / "logs"),
            "grace_s": grace_s,
            "startup_timeout_s": startup_timeout_s,
            "children": self.children,
        }
        self.drivers.append(Driver(config))
        return self.drivers[-1]

    def pids(self, name: str) -> list[int]:
        """The child's and its grandchild's pid, once the child has written them."""
        pid_file = self.tmp_path / f"{name}.pids"
        assert wait_until(pid_file.exists), f"{name} never wrote its pids"
        return [int(p) for p in pid_file.read_text().split()]

    def all_pids(self) -> list[int]:
        files = [self.tmp_path / f"{c['name']}.pids" for c in self.children]
        return [int(p) for f in files if f.exists() for p in f.read_text().split()]

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

    stop_sent = time.monotonic()
    driver.proc.send_signal(signal.SIGTERM)
    assert driver.wait_exit() == 0, driver.output
    cluster.assert_all_gone()
    assert time.monotonic() - stop_sent < 4.0, "SIGTERM should stop them, not the grace SIGKILL"
    assert "still running after" not in driver.output
    # stage 0 is stopped before stage 1 (the gateway before the workers)
    assert driver.output.index("stopping front") < driver.output.index("stopping slow")
    assert "all processes stopped" in driver.output


def test_child_exiting_during_startup_fails_with_its_log_tail(cluster: Cluster) -> None:
    logs = cluster.tmp_path / "logs"
    logs.mkdir()
    (logs / "broken.log").write_text("a line from an earlier run\n")
    cluster.child("broken", mode="fail", delay_s=0.3)
    cluster.child("other", mode="sleep")
    driver = cluster.start()

    assert driver.wait_exit() == 1, driver.output
    assert "broken exited with code 3 during startup" in driver.output
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
    driver = cluster.start()
    driver.wait_for(READY_LINE)

    os.kill(cluster.pids("victim")[0], signal.SIGKILL)
    assert driver.wait_exit() == 1, driver.output
    assert "victim was killed by signal 9" in driver.output
    assert "unexpectedly" in driver.output
    assert "policy stop-all" in driver.output
    cluster.assert_all_gone()


def test_startup_timeout_stops_everything(cluster: Cluster) -> None:
    cluster.child("stuck", mode="serve", delay_s=600)
    driver = cluster.start(startup_timeout_s=1.0)

    assert driver.wait_exit() == 1, driver.output
    assert "startup timed out after 1 s: stuck (loading" in driver.output
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
