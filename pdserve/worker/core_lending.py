"""Cores one engine lends another while it has no step to compute (CPU only).

On a small machine ``pdserve up`` gives each engine cores of its own: on two cores, the
prefill engine core 0 and the decode engine core 1. Prefill comes in bursts (a prompt, then
nothing until the next) while decode steps without pause, and a decode step computes faster
with a second OpenMP thread (it reads every weight once a step, and a second core reads
alongside the first; docs/benchmarks.md). So the decode engine computes each step with the
prefill engine's cores too while the prefill engine has had no step to compute for a moment,
and with its own core alone while it has. The prefill engine never waits longer than the
borrower's step in progress, and a borrower that is gone or too slow loses the cores.

The engines' model-runner processes agree through a small shared file, one record a core,
changed under an exclusive ``flock`` (a few microseconds a step):

==========  ===========================================================================
busy        1 while the core's owner computes a step
idle_since  ``CLOCK_MONOTONIC`` ns when the owner's last step ended
borrower    process id of the engine computing on the core as a borrower (0: none)
lent_steps  steps a borrower computed on the core (a counter)
waited_ns   time the owner waited for a borrower to give the core back (a counter)
reclaimed   times the owner took the core back from a borrower that was gone or too slow
==========  ===========================================================================
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

from pdserve.worker.owned_dirs import alive

_RECORD = struct.Struct("<6q")
# How long the owner has had no step before its cores may be borrowed. An engine's next step
# follows the last within a few milliseconds while it has requests (the scheduler's turn), so
# a borrower does not slip in between two steps of a long prompt and make the owner wait.
IDLE_FOR_S = 0.01
# The longest an owner waits for a borrower's step before it takes its cores back (a decode
# step takes 30-150 ms on the CPUs measured; a borrower stopped in a debugger must not stop
# the owner).
WAIT_LIMIT_S = 2.0
# Between two looks at a borrower that has not given the cores back yet.
PAUSE_S = 0.0002


@dataclass(frozen=True)
class Record:
    busy: int = 0
    idle_since: int = 0
    borrower: int = 0
    lent_steps: int = 0
    waited_ns: int = 0
    reclaimed: int = 0


class CoreTable:
    """The shared file: one ``Record`` per core id, ``0 .. size-1``."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_RDWR)
        try:
            length = os.fstat(self._fd).st_size
            if length == 0 or length % _RECORD.size:
                raise ValueError(f"{path} is not a core lending table ({length} bytes)")
            self._map = mmap.mmap(self._fd, length)
        except BaseException:
            os.close(self._fd)
            raise
        self.size = length // _RECORD.size

    @staticmethod
    def create(path: str, size: int) -> None:
        """A new table at ``path`` for core ids below ``size``, every core idle and free."""
        if size < 1:
            raise ValueError("a core lending table needs at least one core")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, bytes(_RECORD.size * size))
        finally:
            os.close(fd)

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)

    @contextmanager
    def locked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def read(self, core: int) -> Record:
        return Record(*_RECORD.unpack_from(self._map, self._offset(core)))

    def write(self, core: int, record: Record) -> None:
        """Only under ``locked()``."""
        _RECORD.pack_into(self._map, self._offset(core), *vars(record).values())

    def _offset(self, core: int) -> int:
        if not 0 <= core < self.size:
            raise ValueError(f"core {core} is not in the lending table (0-{self.size - 1})")
        return core * _RECORD.size

    def totals(self, cores: Sequence[int] = ()) -> Record:
        """The counters (lent steps, waited ns, reclaimed) summed over ``cores`` (default:
        every core)."""
        records = [self.read(core) for core in (cores or range(self.size))]
        return Record(
            lent_steps=sum(r.lent_steps for r in records),
            waited_ns=sum(r.waited_ns for r in records),
            reclaimed=sum(r.reclaimed for r in records),
        )


class Lender:
    """The owner of ``cores``: marks them busy for each of its steps and, before computing,
    waits until no borrower computes on them."""

    def __init__(
        self,
        table: CoreTable,
        cores: Sequence[int],
        wait_limit_s: float = WAIT_LIMIT_S,
        clock: Callable[[], int] = time.monotonic_ns,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.table, self.cores = table, list(cores)
        self.wait_limit_ns = int(wait_limit_s * 1e9)
        self._clock, self._sleep = clock, sleep

    def step_begins(self) -> float:
        """Before a step: the cores are the owner's again once this returns; the seconds it
        waited for a borrower."""
        with self.table.locked():
            for core in self.cores:
                self.table.write(core, replace(self.table.read(core), busy=1))
        lent = [c for c in self.cores if self.table.read(c).borrower]
        if not lent:
            return 0.0
        start = self._clock()
        while lent:
            gone = [c for c in lent if not alive(self.table.read(c).borrower)]
            if gone or self._clock() - start > self.wait_limit_ns:
                self._reclaim(gone or lent)
            else:
                self._sleep(PAUSE_S)
            lent = [c for c in self.cores if self.table.read(c).borrower]
        waited = self._clock() - start
        with self.table.locked():
            record = self.table.read(self.cores[0])
            self.table.write(self.cores[0], replace(record, waited_ns=record.waited_ns + waited))
        return waited / 1e9

    def step_ends(self) -> None:
        now = self._clock()
        with self.table.locked():
            for core in self.cores:
                self.table.write(core, replace(self.table.read(core), busy=0, idle_since=now))

    def _reclaim(self, cores: list[int]) -> None:
        with self.table.locked():
            for core in cores:
                record = self.table.read(core)
                if record.borrower:
                    self.table.write(
                        core, replace(record, borrower=0, reclaimed=record.reclaimed + 1)
                    )


class Borrower:
    """An engine with ``home`` threads of its own that computes each step on whichever of
    ``cores`` (other engines') have been idle for ``idle_for_s`` and are not lent already."""

    def __init__(
        self,
        table: CoreTable,
        home: int,
        cores: Sequence[int],
        idle_for_s: float = IDLE_FOR_S,
        clock: Callable[[], int] = time.monotonic_ns,
        pid: int | None = None,
    ) -> None:
        self.table, self.home, self.cores = table, home, list(cores)
        self.idle_for_ns = int(idle_for_s * 1e9)
        self._clock = clock
        self.pid = pid or os.getpid()
        self.held: list[int] = []

    def step_begins(self) -> int:
        """Before a step: the threads to compute it with (``home`` plus the cores taken)."""
        self.step_ends()  # a step that ended without step_ends (an error) gives them back
        now = self._clock()
        with self.table.locked():
            for core in self.cores:
                record = self.table.read(core)
                idle = not record.busy and now - record.idle_since >= self.idle_for_ns
                if idle and not record.borrower:
                    self.table.write(
                        core, replace(record, borrower=self.pid, lent_steps=record.lent_steps + 1)
                    )
                    self.held.append(core)
        return self.home + len(self.held)

    def step_ends(self) -> None:
        if not self.held:
            return
        with self.table.locked():
            for core in self.held:
                record = self.table.read(core)
                if record.borrower == self.pid:  # not taken back meanwhile
                    self.table.write(core, replace(record, borrower=0))
        self.held = []
