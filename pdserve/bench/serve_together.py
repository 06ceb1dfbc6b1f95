"""``pdserve bench serve --together``: both systems up at once, their runs back to back.

By default every round starts each system afresh and stops it, so the two systems' runs of a
round lie a start-up (one to two minutes on the CPU) apart, and a shared machine can change
speed in between. With ``--together`` each system starts once and stays up for the whole
benchmark; the rounds then alternate the workload runs between them (the order alternating
from round to round as before), so that a pair of runs lies a few seconds apart. A system
waits idle while the other runs; what that costs the running one is measured: the CPU time
of the idle system's processes over every run is recorded beside its results.

Each round gets its own prompts (the seed plus ten per round; both systems the same ones):
a server that stays up keeps its prefix cache, and the same prompts again would be cache
hits. On a GPU both systems would not fit its memory at once: CPU only.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from pdserve.bench import systems as bench_systems

SEED_STEP = 10  # seeds per round: a workload may use seed + 1 as well (mixed)


@dataclass(frozen=True)
class Held:
    """A system kept up for the whole benchmark: its URL and its process tree's root."""

    url: str
    root_pid: int

    def cpu_seconds(self) -> float:
        """CPU time (user + system) of the processes under ``root_pid`` now alive."""
        import psutil

        try:
            root = psutil.Process(self.root_pid)
            processes = [root, *root.children(recursive=True)]
        except (psutil.Error, ValueError):  # gone, or no pid at all
            return 0.0
        total = 0.0
        for process in processes:
            try:
                times = process.cpu_times()
            except psutil.Error:
                continue  # ended in between
            total += times.user + times.system
        return total


def round_args(args: argparse.Namespace, round_no: int) -> argparse.Namespace:
    """The settings of round ``round_no`` (1-based): with ``--together``, its own seed."""
    if not getattr(args, "together", False):
        return args
    return argparse.Namespace(**{**vars(args), "seed": args.seed + SEED_STEP * (round_no - 1)})


def server_root(port: int) -> int:
    """The pid of the process this one started that (itself or a child) listens on ``port``."""
    import psutil

    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            process = psutil.Process(conn.pid)
            for candidate in [process, *process.parents()]:
                if candidate.ppid() == os.getpid():
                    return candidate.pid
    raise LookupError(f"no process started by this benchmark listens on port {port}")


@contextmanager
def held_servers(
    args: argparse.Namespace, systems: list[str], model: str, name: str, out: Path
) -> Iterator[dict[str, Held]]:
    """With ``--together``, every system started once and kept up until the block ends;
    without it, nothing (each round starts its own)."""
    if not args.together:
        yield {}
        return
    with ExitStack() as stack:
        held = {}
        for system in systems:
            url = stack.enter_context(bench_systems.server(system, args, model, name, out))
            port = urlsplit(url).port
            assert port is not None  # the servers' URLs name their ports
            held[system] = Held(url, server_root(port))
        yield held


def serving(
    system: str, held: dict[str, Held], args: argparse.Namespace, model: str, name: str,
    out: Path,
) -> AbstractContextManager[str]:  # fmt: skip
    """The URL of ``system`` for a round: the held server's, or a server of its own."""
    if system in held:
        return nullcontext(held[system].url)
    return bench_systems.server(system, args, model, name, out)


@contextmanager
def idle_cpu(held: dict[str, Held], running: str) -> Iterator[dict[str, float]]:
    """The CPU seconds every held system but ``running`` spends in the block, filled in
    when it ends ("<idle> while <running> ran" -> seconds; empty without held systems)."""
    idle = {system: h for system, h in held.items() if system != running}
    before = {system: h.cpu_seconds() for system, h in idle.items()}
    spent: dict[str, float] = {}
    yield spent
    for system, h in idle.items():
        spent[f"{system} while {running} ran"] = round(h.cpu_seconds() - before[system], 2)


def meanwhile(spent: dict[str, float]) -> str:
    """``idle_cpu``'s figures as the end of a progress line ("" when there are none)."""
    return "".join(f"; {what}: {s:.1f} CPU-s" for what, s in spent.items())


def settings_problem(args: argparse.Namespace) -> str:
    """Why ``--together`` cannot be used with these settings ("" when it can)."""
    if not args.together:
        return ""
    if args.tracing != "off":
        return "--together compares pdserve with vllm serve; --tracing has rounds of its own"
    from pdserve.placement.engines import gpus_to_use

    if gpus_to_use(args.gpus):
        return "--together runs on the CPU only: on a GPU both systems would not fit at once"
    return ""
