"""Core lending between engines (pdserve.worker.core_lending): the shared table, the lender's
wait and the borrower's choice, with a fake clock, and across two real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from pdserve.worker.core_lending import IDLE_FOR_S, Borrower, CoreTable, Lender, Record

MS = 1_000_000  # ns


class Clock:
    def __init__(self) -> None:
        self.now = 10_000 * MS

    def __call__(self) -> int:
        return self.now


@pytest.fixture
def table(tmp_path: Path) -> CoreTable:
    path = str(tmp_path / "cpu-lending")
    CoreTable.create(path, 2)
    opened = CoreTable(path)
    yield opened
    opened.close()


def test_a_new_table_has_every_core_idle_and_free(table: CoreTable) -> None:
    assert table.size == 2
    assert table.read(0) == table.read(1) == Record()


def test_a_file_that_is_not_a_table_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.write_bytes(b"x" * 7)
    with pytest.raises(ValueError, match="not a core lending table"):
        CoreTable(str(bad))
    with pytest.raises(ValueError, match="at least one core"):
        CoreTable.create(str(tmp_path / "empty"), 0)


def test_a_core_outside_the_table_is_refused(table: CoreTable) -> None:
    with pytest.raises(ValueError, match="core 2 is not in the lending table"):
        table.read(2)


def test_the_borrower_takes_a_core_idle_long_enough_and_gives_it_back(table: CoreTable) -> None:
    clock = Clock()
    lender = Lender(table, [0], clock=clock)
    borrower = Borrower(table, home=1, cores=[0], clock=clock, pid=4242)
    lender.step_begins()
    assert borrower.step_begins() == 1  # the owner computes: its own thread only
    borrower.step_ends()
    lender.step_ends()
    clock.now += int(IDLE_FOR_S * 1e9) // 2
    assert borrower.step_begins() == 1  # idle, but maybe between two of its steps
    borrower.step_ends()
    clock.now += int(IDLE_FOR_S * 1e9)
    assert borrower.step_begins() == 2
    assert table.read(0).borrower == 4242
    borrower.step_ends()
    assert table.read(0).borrower == 0
    assert table.read(0).lent_steps == 1


def test_a_second_borrower_does_not_take_a_lent_core(table: CoreTable) -> None:
    clock = Clock()
    first = Borrower(table, home=1, cores=[0], clock=clock, pid=1111)
    second = Borrower(table, home=1, cores=[0], clock=clock, pid=2222)
    assert first.step_begins() == 2
    assert second.step_begins() == 1
    first.step_ends()
    assert second.step_begins() == 2


def test_the_owner_waits_for_the_borrowers_step(table: CoreTable) -> None:
    clock, sleeps = Clock(), []
    borrower = Borrower(table, home=1, cores=[0], clock=clock, pid=_alive_pid())

    def sleep(seconds: float) -> None:  # the borrower's step ends after the third look
        sleeps.append(seconds)
        clock.now += 10 * MS
        if len(sleeps) == 3:
            borrower.step_ends()

    lender = Lender(table, [0], clock=clock, sleep=sleep)
    assert borrower.step_begins() == 2
    assert lender.step_begins() == pytest.approx(0.03)
    assert len(sleeps) == 3
    assert table.read(0).busy == 1
    assert table.read(0).waited_ns == 30 * MS
    assert table.read(0).reclaimed == 0


def test_the_owner_takes_its_core_back_from_a_borrower_that_is_gone(table: CoreTable) -> None:
    gone = Borrower(table, home=1, cores=[0], pid=_gone_pid())
    assert gone.step_begins() == 2
    lender = Lender(table, [0], sleep=_no_sleep)
    lender.step_begins()
    assert table.read(0).borrower == 0
    assert table.read(0).reclaimed == 1


def test_the_owner_takes_its_core_back_from_a_borrower_too_slow(table: CoreTable) -> None:
    clock = Clock()
    slow = Borrower(table, home=1, cores=[0], clock=clock, pid=_alive_pid())
    assert slow.step_begins() == 2

    def sleep(seconds: float) -> None:
        clock.now += 500 * MS

    lender = Lender(table, [0], wait_limit_s=2.0, clock=clock, sleep=sleep)
    assert lender.step_begins() > 2.0
    assert table.read(0).reclaimed == 1
    slow.step_ends()  # its late end leaves the core to its owner
    assert table.read(0).borrower == 0
    assert table.totals() == Record(lent_steps=1, waited_ns=table.read(0).waited_ns, reclaimed=1)


def test_an_engine_step_that_failed_gives_the_cores_back_at_the_next(table: CoreTable) -> None:
    borrower = Borrower(table, home=1, cores=[0], pid=_alive_pid())
    assert borrower.step_begins() == 2
    assert borrower.step_begins() == 2  # no step_ends in between: the first is released
    assert table.read(0).lent_steps == 2


def test_two_processes_agree_through_the_file(tmp_path: Path) -> None:
    """A borrower process holds core 0 until told to end its step; the owner here waits for
    it all that time, and computes once it has ended."""
    path = str(tmp_path / "cpu-lending")
    CoreTable.create(path, 2)
    borrowed, release = tmp_path / "borrowed", tmp_path / "release"
    code = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from pdserve.worker.core_lending import Borrower, CoreTable
        borrower = Borrower(CoreTable({path!r}), home=1, cores=[0])
        assert borrower.step_begins() == 2
        Path({str(borrowed)!r}).touch()
        while not Path({str(release)!r}).exists():
            time.sleep(0.01)
        borrower.step_ends()
    """)
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        _wait_for(borrowed, child)
        table = CoreTable(path)
        owner = Lender(table, [0], wait_limit_s=600)
        waited: list[float] = []
        thread = threading.Thread(target=lambda: waited.append(owner.step_begins()))
        thread.start()
        thread.join(timeout=0.3)
        assert thread.is_alive(), "the owner computed while the borrower's step ran"
        release.touch()
        thread.join(timeout=60)
        assert waited and waited[0] >= 0.3
        assert table.read(0).borrower == 0 and table.read(0).reclaimed == 0
        assert child.wait(timeout=60) == 0
    finally:
        release.touch()
        child.kill()
        child.wait()


def _wait_for(path: Path, child: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        assert child.poll() is None, "the borrower process failed"
        assert time.monotonic() < deadline, "the borrower never took the core"
        time.sleep(0.01)


def _alive_pid() -> int:
    return os.getpid()


def _gone_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return int(done.stdout)


def _no_sleep(seconds: float) -> None:
    pass
