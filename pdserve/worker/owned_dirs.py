"""Private temporary directories of a worker (its engine's IPC sockets) that outlive no worker.

A worker removes its directories when it exits, but a worker that is killed (SIGKILL, the
OOM killer, a lost container) cannot. Each directory therefore names its owner's process id
in a file, and making a new one first removes those of the same kind whose owner is gone.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

OWNER_FILE = "owner-pid"


def make(prefix: str, base: str | None = None) -> Path:
    """A new directory (mode 0700) in ``base`` (default: the system's temporary directory),
    owned by this process; stale ones with the same prefix are removed first."""
    base = base or tempfile.gettempdir()
    sweep(base, prefix)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    (path / OWNER_FILE).write_text(str(os.getpid()))
    return path


def sweep(base: str, prefix: str) -> list[Path]:
    """Remove this user's ``prefix*`` directories in ``base`` whose owner process is gone;
    the removed ones. A directory naming no owner (made by something else) is left alone."""
    removed = []
    for path in Path(base).glob(f"{prefix}*"):
        try:
            if path.stat().st_uid != os.getuid():
                continue
            pid = int((path / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        if not alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def alive(pid: int) -> bool:
    """Whether a process with this id exists (another user's counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
