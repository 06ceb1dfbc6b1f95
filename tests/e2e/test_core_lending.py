"""Core lending on the real path: ``pdserve up``'s own topology on this machine (1 prefill + 1
decode worker, each engine on cores of its own), where the decode engine also computes on the
prefill engine's cores while that has nothing to compute (pdserve.worker.core_lending).

Requests sent together make the decode engine step both while the prefill engine computes
prompts (its own core only) and after (the lent cores too); every output must still be
token-identical to one monolithic engine, and the lending must show on ``/metrics``. The
decode engine's KV cache is kept small (40 blocks), so that one test can fill it.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import psutil
import pytest

from pdserve.bench import systems as bench_systems
from pdserve.placement.engines import parse_cores
from pdserve.worker.vllm_plugin import for_each_thread
from tests.e2e.cases import DTYPE, FILL_PROMPT_TOKENS, fill_cases
from tests.e2e.conftest import RealCluster, pid_on_port, run_cluster
from tests.e2e.test_disaggregated import check_transfer, generate
from tests.helpers import counted, metrics_text

pytestmark = pytest.mark.own_cluster

T = TypeVar("T")
DECODE_BLOCKS = 40
MAX_MODEL_LEN = 4096  # the longest e2e case (about 3,000 tokens) and its answer fit
LENT = "pdserve_gateway_worker_cpu_lent_steps_total"
FALLBACKS = "pdserve_gateway_local_fallbacks_total"
RECLAIMED = "pdserve_gateway_worker_cpu_lend_reclaims_total"


@pytest.fixture(scope="module")
def lending_cluster(
    reference: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealCluster]:
    # A decode KV cache of 40 blocks (5,120 tokens): small enough for fill_cases to fill it.
    small_cache = [
        f"--prefill-engine-args=--dtype {DTYPE} --max-model-len {MAX_MODEL_LEN}",
        f"--decode-engine-args=--dtype {DTYPE} --max-model-len {MAX_MODEL_LEN} "
        f"--num-gpu-blocks-override {DECODE_BLOCKS}",
    ]
    yield from run_cluster(tmp_path_factory.mktemp("lending-logs"), 1, 1, small_cache, {})


async def test_steps_on_lent_cores_stay_token_identical(
    lending_cluster: RealCluster, e2e_cases: list[dict[str, Any]], reference: dict[str, Any]
) -> None:
    cluster = lending_cluster
    up_log = (cluster.log_dir / "pdserve-up.out").read_text()
    assert "core lending: decode engines also compute on cores" in up_log, up_log[-2000:]
    answers = await asyncio.gather(*(generate(cluster, case) for case in e2e_cases))
    for case, (tokens, text, final) in zip(e2e_cases, answers, strict=True):
        expected = reference[case["name"]]
        compared = case.get("compare_tokens")  # None: the whole greedy output
        assert tokens[:compared] == expected["token_ids"][:compared], (case["name"], text)
        check_transfer(final, final.usage.prompt_tokens)
    # The prefill worker's counters reach /metrics with its heartbeat (seconds late).
    lent, deadline = 0.0, time.monotonic() + 60
    while lent == 0 and time.monotonic() < deadline:
        await asyncio.sleep(1)
        lent = counted(await metrics_text(cluster.base_url), LENT)
    assert lent > 0, "no decode step was computed on the prefill worker's cores"
    assert counted(await metrics_text(cluster.base_url), RECLAIMED) == 0
    decode_log = (cluster.log_dir / "decode-0.log").read_text()
    assert "core lending: steps on cores" in decode_log
    prefill_log = (cluster.log_dir / "prefill-0.log").read_text()
    assert "lent while the engine is idle" in prefill_log


async def test_a_full_decode_kv_cache_makes_requests_wait_not_fail(
    lending_cluster: RealCluster, reference: dict[str, Any]
) -> None:
    """Four requests of 15-17 blocks each sent together to a decode worker whose cache holds 40:
    the decode engine runs two at a time and the others wait for blocks, their hand-offs kept
    pinned (and leased) on the prefill worker. Every request completes token-identical to a
    monolithic engine with its KV pulled (the decode engine computed only the last prompt
    token; no local fallback), and afterwards no block is pinned anywhere."""
    cluster = lending_cluster
    cases = fill_cases()
    before = counted(await metrics_text(cluster.base_url), FALLBACKS)
    peak: dict[str, float] = {"kv_usage": 0.0, "waiting": 0.0}

    async def watch() -> None:
        while True:
            text = await metrics_text(cluster.base_url)
            for name in peak:
                series = f'pdserve_gateway_worker_{name}{{role="decode",'
                peak[name] = max(peak[name], counted(text, series))
            await asyncio.sleep(0.25)

    watcher = asyncio.create_task(watch())
    try:
        answers = await asyncio.gather(*(generate(cluster, case) for case in cases))
    finally:
        watcher.cancel()
    for case, (tokens, text, final) in zip(cases, answers, strict=True):
        assert tokens == reference[case["name"]]["token_ids"], (case["name"], text)
        check_transfer(final, len(case["token_ids"]))
    # The fault happened: the decode worker's cache was nearly full with requests waiting.
    prompt_blocks = -(-(FILL_PROMPT_TOKENS + 1) // 128)  # with the first generated token
    assert peak["kv_usage"] >= 2 * prompt_blocks / DECODE_BLOCKS - 0.01, peak
    assert peak["waiting"] >= 1, peak
    assert counted(await metrics_text(cluster.base_url), FALLBACKS) == before

    async def pinned() -> float:
        text = await metrics_text(cluster.base_url)
        return counted(text, "pdserve_gateway_worker_pinned_blocks") + counted(
            text, "pdserve_gateway_worker_leases"
        )

    deadline = time.monotonic() + 120  # the gauges travel by heartbeat (every 2 s)
    while await pinned():
        assert time.monotonic() < deadline, "blocks stayed pinned after every request ended"
        await asyncio.sleep(1)


def test_the_engines_give_way_to_the_workers_and_the_gateway(
    lending_cluster: RealCluster,
) -> None:
    """Every thread of both engines runs in the SCHED_IDLE class; the workers' own processes
    and the gateway's stay in the normal one (pdserve.worker.vllm_plugin.lower_priority)."""
    cluster = lending_cluster
    gateway = pid_on_port(cluster.http_port)
    assert os.sched_getscheduler(gateway) == os.SCHED_OTHER
    for role in ("prefill", "decode"):
        worker = psutil.Process(pid_on_port(cluster.ports[role]))
        assert set(_of_threads(worker.pid, os.sched_getscheduler)) == {os.SCHED_OTHER}
        engines = bench_systems.engine_processes(worker.pid)
        assert engines, f"the {role} worker runs no engine process"
        for engine in engines:
            classes = set(_of_threads(engine.pid, os.sched_getscheduler))
            assert classes == {os.SCHED_IDLE}, (role, engine.cmdline(), classes)


def test_pdserves_own_threads_run_on_the_prefill_engines_cores(
    lending_cluster: RealCluster,
) -> None:
    """The gateway's and the workers' own threads are bound to the prefill engine's cores
    (pdserve.placement.front_cores); the decode engine keeps the cores it was started with."""
    cluster = lending_cluster
    up_log = (cluster.log_dir / "pdserve-up.out").read_text()
    said = re.search(r"own threads run on the prefill engines' cores (\S+) \(", up_log)
    assert said, up_log[-2000:]
    front = set(parse_cores(said.group(1)))
    workers = {role: psutil.Process(pid_on_port(cluster.ports[role])) for role in ROLES}
    assert front == _engine_cores(workers["prefill"])
    own = [psutil.Process(pid_on_port(cluster.http_port)), *workers.values()]
    for process in own:
        masks = _of_threads(process.pid, os.sched_getaffinity)
        assert masks and all(mask == front for mask in masks), (process.cmdline(), masks)
    decode_cores = _engine_cores(workers["decode"])
    assert decode_cores - front
    reach = set().union(*(mask for e in bench_systems.engine_processes(workers["decode"].pid)
                          for mask in _of_threads(e.pid, os.sched_getaffinity)))  # fmt: skip
    assert decode_cores <= reach, "the decode engine lost its own cores"
    for role in ROLES:
        assert "its own threads on cores" in (cluster.log_dir / f"{role}-0.log").read_text()


ROLES = ("prefill", "decode")


def _of_threads(pid: int, read: Callable[[int], T]) -> list[T]:
    """``read(tid)`` for every thread of process ``pid`` still running when it is read (a
    server's threads come and go: one listed may have ended a moment later)."""
    values: list[T] = []
    for_each_thread(pid, lambda tid: values.append(read(tid)))
    return values


def _engine_cores(worker: psutil.Process) -> set[int]:
    """The cores the worker gave its engine (``--cpu-cores``, from pdserve up)."""
    argv = worker.cmdline()
    return set(parse_cores(argv[argv.index("--cpu-cores") + 1]))
