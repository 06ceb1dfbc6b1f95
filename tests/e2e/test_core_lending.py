"""Core lending on the real path: ``pdserve up``'s own topology on this machine (1 prefill + 1
decode worker, each engine on cores of its own), where the decode engine also computes on the
prefill engine's cores while that has nothing to compute (pdserve.worker.core_lending).

Requests sent together make the decode engine step both while the prefill engine computes
prompts (its own core only) and after (the lent cores too); every output must still be
token-identical to one monolithic engine, and the lending must show on ``/metrics``. The
decode engine's KV cache is kept small (40 blocks), so that one test can fill it.

The same cluster serves a second base model behind its gateway (``--extra-models``: the default
model with an adapter merged in, ``pdserve model lora --merged``), on a prefill and a decode
worker of its own outside the lending (a 2-core machine has time for one more cluster start,
not two): its requests go to its own workers only, disaggregated, and its answers are its
engine's own, token for token.
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
from tests.helpers import counted, metrics_text, served_name

pytestmark = pytest.mark.own_cluster

T = TypeVar("T")
DECODE_BLOCKS = 40
MAX_MODEL_LEN = 4096  # the longest e2e case (about 3,000 tokens) and its answer fit
LENT = "pdserve_gateway_worker_cpu_lent_steps_total"
FALLBACKS = "pdserve_gateway_local_fallbacks_total"
RECLAIMED = "pdserve_gateway_worker_cpu_lend_reclaims_total"


SECOND = "merged-colors"  # the second model's served name


@pytest.fixture(scope="module")
def lending_cluster(
    reference: dict[str, Any], tmp_path_factory: pytest.TempPathFactory, merged_model: str
) -> Iterator[RealCluster]:
    # A decode KV cache of 40 blocks (5,120 tokens): small enough for fill_cases to fill it.
    small_cache = [
        f"--prefill-engine-args=--dtype {DTYPE} --max-model-len {MAX_MODEL_LEN}",
        f"--decode-engine-args=--dtype {DTYPE} --max-model-len {MAX_MODEL_LEN} "
        f"--num-gpu-blocks-override {DECODE_BLOCKS}",
    ]
    logs = tmp_path_factory.mktemp("lending-logs")
    yield from run_cluster(logs, 1, 1, small_cache, {}, extra_models={SECOND: merged_model})


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
                series = f"pdserve_gateway_worker_{name}"
                peak[name] = max(peak[name], counted(text, series, role="decode"))
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


QUESTION = [{"role": "user", "content": "Name three colors."}]


def _ask(cluster: RealCluster, model: str, messages: Any) -> tuple[str, Any, Any]:
    """The greedy chat answer, its usage and the (prefill, decode) workers that served it."""
    from openai import OpenAI

    client = OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=16, temperature=0
    )
    reply: Any = raw.parse()
    workers = (raw.headers["x-pdserve-prefill-worker"], raw.headers["x-pdserve-decode-worker"])
    return reply.choices[0].message.content, reply.usage, workers


async def _generate(cluster: RealCluster, model: str, **params: Any) -> tuple[list[int], Any]:
    """The greedy tokens of a fixed prompt over gRPC and the (prefill, decode) workers."""
    import grpc

    from protos.v1 import common_pb2, generate_pb2, generate_pb2_grpc

    sampling = common_pb2.SamplingParams(max_tokens=16, temperature=0.0, **params)
    request = generate_pb2.GenerateRequest(
        model=model, text="Three primary colors are", params=sampling
    )
    tokens: list[int] = []
    async with grpc.aio.insecure_channel(cluster.grpc_target) as channel:
        async for message in generate_pb2_grpc.GenerationStub(channel).Generate(request):
            tokens.extend(message.token_ids)
            last = message
    return tokens, (last.prefill_worker, last.decode_worker)


async def test_a_second_model_is_served_by_its_own_workers_as_its_engine_answers(
    lending_cluster: RealCluster, merged_model: str
) -> None:
    import httpx

    cluster = lending_cluster
    listed = httpx.get(cluster.base_url + "/v1/models", timeout=30).json()["data"]
    assert [(m["id"], m["root"], m["parent"]) for m in listed][1:] == [(SECOND, merged_model, None)]
    assert listed[0]["id"] == served_name()
    second, workers = await _generate(cluster, SECOND)
    base, base_workers = await _generate(cluster, served_name())
    # prompt_logprobs: the decode worker computes the prompt itself (the local path)
    alone, alone_workers = await _generate(cluster, SECOND, prompt_logprobs=0)
    ports = cluster.ports
    prefill, decode = (f"127.0.0.1:{ports[role] + 1}" for role in ("prefill", "decode"))
    assert workers == (prefill, decode), "the second model's own workers, KV moved"
    assert base_workers == tuple(f"127.0.0.1:{ports[role]}" for role in ("prefill", "decode"))
    assert alone_workers == ("local", decode)
    assert second and second == alone, "disaggregated, as its engine computing alone"
    assert second != base, "the second model has answers of its own"
    chat, usage, chat_workers = _ask(cluster, SECOND, QUESTION)
    assert chat and usage.completion_tokens > 0 and chat_workers == ("prefill-1", "decode-1")
    unknown = httpx.post(
        cluster.base_url + "/v1/chat/completions",
        json={"model": "no-such-model", "messages": QUESTION, "max_tokens": 4},
        timeout=30,
    )
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"


def test_a_second_models_prefix_stays_with_its_own_workers(lending_cluster: RealCluster) -> None:
    """The same long prompt, twice for the second model, then for the first: the second
    model's second turn finds its own blocks; the first model's turn finds none of them (its
    engines never computed the prompt, and the shared prefix index names only the other
    model's workers)."""
    from tests.e2e.test_routing import BLOCK, system_prompt

    long = [{"role": "system", "content": system_prompt(2) * 3}, *QUESTION]
    _, first, _ = _ask(lending_cluster, SECOND, long)
    _, again, workers = _ask(lending_cluster, SECOND, long)
    _, other, other_workers = _ask(lending_cluster, served_name(), long)
    full = (first.prompt_tokens - 1) // BLOCK * BLOCK
    assert full >= 4 * BLOCK, first.prompt_tokens
    assert first.prompt_tokens_details.cached_tokens == 0, first
    assert again.prompt_tokens_details.cached_tokens >= full, again
    assert workers == ("prefill-1", "decode-1")
    assert other.prompt_tokens_details.cached_tokens == 0, other
    assert other_workers == ("prefill-0", "decode-0")
