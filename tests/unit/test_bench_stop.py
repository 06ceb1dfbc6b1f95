"""A benchmark stopped with SIGTERM stops what it started, as with Ctrl-C."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import sys, time
from pathlib import Path
from pdserve.bench.main import stop_on_sigterm
from pdserve.bench.systems import child_process

stop_on_sigterm()
with child_process([sys.argv[1], "600"], {}, Path(sys.argv[2])) as server:
    print(server.pid, flush=True)
    time.sleep(600)
"""


def test_sigterm_stops_the_servers_a_benchmark_started(tmp_path: Path) -> None:
    bench = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(shutil.which("sleep")), str(tmp_path / "log")],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert bench.stdout is not None
    server = int(bench.stdout.readline())  # started, in its own process group
    try:
        bench.send_signal(signal.SIGTERM)
        code = bench.wait(timeout=60)
        outlived = _alive(server)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server, signal.SIGKILL)
    assert code == 128 + signal.SIGTERM  # ended through its finally blocks, as on Ctrl-C
    assert not outlived, "the server outlived the benchmark"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
