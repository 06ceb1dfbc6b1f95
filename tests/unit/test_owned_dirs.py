"""A killed worker's private directories are removed by the next worker that makes one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pdserve.worker import owned_dirs


def _dead_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return int(done.stdout)


def test_a_new_directory_names_its_owner_and_is_private(tmp_path: Path) -> None:
    made = owned_dirs.make("pdserve-kv-", str(tmp_path))
    assert made.parent == tmp_path and made.name.startswith("pdserve-kv-")
    assert (made / owned_dirs.OWNER_FILE).read_text() == str(os.getpid())
    assert made.stat().st_mode & 0o777 == 0o700


def test_making_one_removes_those_of_dead_owners_only(tmp_path: Path) -> None:
    stale = owned_dirs.make("pdserve-kv-", str(tmp_path))
    (stale / "events").write_text("socket")
    (stale / owned_dirs.OWNER_FILE).write_text(str(_dead_pid()))
    live = owned_dirs.make("pdserve-kv-", str(tmp_path))
    unowned = tmp_path / "pdserve-kv-unowned"  # made by something else: not ours to judge
    unowned.mkdir()
    other_kind = owned_dirs.make("pdserve-rpc-", str(tmp_path))
    (other_kind / owned_dirs.OWNER_FILE).write_text(str(_dead_pid()))

    fresh = owned_dirs.make("pdserve-kv-", str(tmp_path))

    assert not stale.exists(), "the killed worker's directory is gone"
    assert live.exists() and fresh.exists(), "a live owner's directory stays"
    assert unowned.exists()
    assert other_kind.exists(), "only directories of the same prefix are swept"


def test_alive() -> None:
    assert owned_dirs.alive(os.getpid())
    assert not owned_dirs.alive(_dead_pid())
    assert not owned_dirs.alive(0)
