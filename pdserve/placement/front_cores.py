"""pdserve's own threads on the prefill engines' cores (CPU only).

With the engines in the SCHED_IDLE class (``pdserve.worker.vllm_plugin.lower_priority``), a
thread of the gateway or of a worker's own process that wakes takes a core from an engine at
once. Left to the kernel, about half of that work (admitting a request: tokenizing, routing,
the Prefill call; streaming each token to the client) lands on the decode engine's core and
delays the step every stream is waiting for. Bound to the prefill engines' cores, it delays a
prefill instead, which only the request that waits for it sees, and by a fraction of its
length. ``pdserve up`` names those cores in ``FRONT_ENV`` for the gateway and the workers when
they apply (``front_cores``); each process binds its own threads (``bind_this_process``): the
gateway when it starts, a worker once its engine has started, so that the engine's processes
keep the cores the worker was started with. docs/benchmarks-history.md, "pdserve's own threads on
the prefill engine's core", has the measurement.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence

from pdserve.placement.engines import Placement, lendable_cores, parse_cores
from pdserve.worker.vllm_plugin import SCHED_ENV, for_each_thread

FRONT_ENV = "PDSERVE_FRONT_CORES"

log = logging.getLogger("pdserve.placement.front_cores")


def front_cores(
    placements: Sequence[Placement], prefill: int, environ: Mapping[str, str] = os.environ
) -> str:
    """The cores for the gateway's and the workers' own threads: the prefill engines' cores
    where each engine has cores of its own and both roles have one (a GPU cluster has none),
    and the engines give way (``PDSERVE_ENGINE_SCHED`` idle, the CPU default); "" where not.
    A ``FRONT_ENV`` already set wins, empty for none."""
    from pdserve.worker.engine import ENGINE_SCHED

    if FRONT_ENV in environ:
        return environ[FRONT_ENV]
    if environ.get(SCHED_ENV, ENGINE_SCHED) != "idle":
        return ""  # engines in the normal class: the front ends would share a core equally
    return lendable_cores(placements, prefill)


def setting_problem(environ: Mapping[str, str] = os.environ) -> str:
    """What is wrong with a ``FRONT_ENV`` the user set ("" when nothing)."""
    try:
        parse_cores(environ.get(FRONT_ENV) or "0")
    except ValueError as exc:
        return f"{FRONT_ENV}: {exc}, or empty to leave the threads to the OS"
    return ""


def bind_this_process(who: str, environ: Mapping[str, str] = os.environ) -> list[int]:
    """Bind every thread of this process (threads it starts later inherit it) to the cores
    in ``FRONT_ENV``; the cores, [] when it is unset or empty or names no core this process
    may use (logged)."""
    text = environ.get(FRONT_ENV, "")
    if not text:
        return []
    try:
        wanted = set(parse_cores(text))
    except ValueError:
        log.warning("%s=%r is not a core list such as '0' or '0-1': %s keeps its cores",
                    FRONT_ENV, text, who)  # fmt: skip
        return []
    cores = sorted(wanted & os.sched_getaffinity(0))
    if not cores:
        log.warning("%s=%s names no core this process may use: %s keeps its cores",
                    FRONT_ENV, text, who)  # fmt: skip
        return []
    for_each_thread(os.getpid(), lambda tid: os.sched_setaffinity(tid, cores))
    log.info("%s: its own threads on cores %s (%s; the engines there give way to them)",
             who, text, FRONT_ENV)  # fmt: skip
    return cores
