"""KV lifecycle on the real cluster: no KV block outlives its request, however it ends.

The gateway exports, per worker, the blocks held for transfers (``pinned_blocks``), the
requests holding them (``leases``) and the KV cache usage the worker reports. Many streaming
requests are cancelled by their client at random moments (before the prefill, during it,
between the prefill and the pull, during the pull, mid-stream); afterwards every worker's
gauges drain to zero, no prefill worker had to wait for a lease to run out (its own counter of
expired leases: every path frees the blocks at once), and the next request is still exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import uuid
from collections import Counter
from typing import Any

import httpx

from kv_transfer.auth import load_secret
from kv_transfer.client import renew
from prefill_service.client import PrefillClient
from protos.v1 import common_pb2
from tests.e2e.conftest import RealCluster
from tests.e2e.test_disaggregated import generate
from tests.e2e.test_kv_integrity import worker_flag
from tests.helpers import served_name

METRIC = "pdserve_gateway_worker_"
CANCELLATIONS = 240  # however long they take on this machine
CONCURRENCY = 8
DRAIN_S = 180.0  # generous: the gauges travel by heartbeat and discovery


Gauges = dict[str, dict[tuple[str, str], float]]


async def scrape(http: httpx.AsyncClient, base_url: str) -> Gauges:
    """{metric suffix: {(role, worker): value}} of the gateway's per-worker gauges."""
    from prometheus_client.parser import text_string_to_metric_families

    text = (await http.get(base_url + "/metrics", timeout=10)).text
    out: Gauges = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith(METRIC):
            values = out.setdefault(family.name[len(METRIC) :], {})
            for s in family.samples:
                values[(s.labels["role"], s.labels["worker"])] = s.value
    return out


async def until(
    http: httpx.AsyncClient, base_url: str, ok: Any, deadline_s: float, what: str
) -> Gauges:
    deadline = time.monotonic() + deadline_s
    while True:
        gauges = await scrape(http, base_url)
        if ok(gauges):
            return gauges
        assert time.monotonic() < deadline, f"{what} not reached in {deadline_s} s: {gauges}"
        await asyncio.sleep(0.5)


def lease_expiries(g: Gauges) -> float:
    """Hand-offs the prefill workers freed at the end of their lease (their own counter)."""
    return sum(v for (role, _), v in g.get("kv_leases_expired", {}).items() if role == "prefill")


async def cancelled_outcomes(http: httpx.AsyncClient, base_url: str) -> float:
    """The gateway's count of requests that ended because their client went away."""
    text = (await http.get(base_url + "/metrics", timeout=10)).text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("pdserve_gateway_requests_total") and 'outcome="cancelled"' in line
    )


def idle(g: Gauges) -> bool:
    workers = g.get("healthy", {})
    return bool(workers) and all(g["pinned_blocks"][w] == g["leases"][w] == 0 for w in workers)


def drained(baseline: Gauges) -> Any:
    def ok(g: Gauges) -> bool:
        usage = g.get("kv_usage", {})
        return idle(g) and all(
            v <= baseline["kv_usage"].get(w, 0.0) + 1e-6 for w, v in usage.items()
        )

    return ok


def random_prompt(rng: random.Random, low: int, high: int) -> list[int]:
    """Token ids no other request used, so each prefill computes (no prefix-cache hit)."""
    return [rng.randrange(1000, 40000) for _ in range(rng.randint(low, high))]


async def test_a_pinned_hand_off_is_counted_and_freed_at_once_by_abort(
    cluster: RealCluster,
) -> None:
    """A prefill whose hand-off nobody pulls: the prefill worker's gauges show its blocks
    (the lease is renewed meanwhile), and Abort unpins them at once."""
    secret = load_secret(cluster.log_dir / "secret")
    address = f"127.0.0.1:{worker_flag(cluster, 'prefill-0', '--port')}"
    kv_port = worker_flag(cluster, "prefill-0", "--kv-port")
    key = ("prefill", "prefill-0")
    prompt = random_prompt(random.Random(uuid.uuid4().int), 300, 300)  # 3 blocks
    request_id = f"pin-{uuid.uuid4()}"
    async with (
        httpx.AsyncClient() as http,
        PrefillClient(
            address, secret=secret, tls=cluster.worker_tls, default_timeout_s=300
        ) as prefill,
    ):
        before = await scrape(http, cluster.base_url)
        assert key in before["pinned_blocks"], before  # every worker is exported
        params = common_pb2.SamplingParams(max_tokens=1, temperature=0.0)
        handoff = (await prefill.prefill(request_id, prompt, params)).kv_transfer_params

        def pinned(g: Gauges) -> bool:
            # renewed while waiting: a slow heartbeat must not turn this into a lease expiry
            # (False until the engine's transfer process has registered the hand-off)
            held = renew("127.0.0.1", kv_port, handoff.remote_request_id, secret=secret)
            # Only a report from after this prefill counts (more engine steps than before):
            # the last report before it may still show an earlier test's hand-off pinned.
            fresh = g["engine_steps"][key] > before["engine_steps"][key]
            return held and fresh and g["pinned_blocks"][key] >= 3 and g["leases"][key] >= 1

        await until(http, cluster.base_url, pinned, DRAIN_S, "pinned blocks shown")
        assert await prefill.abort(request_id) is True  # its blocks were pinned
        # unpinned at once: the transfer process no longer holds them
        assert not renew("127.0.0.1", kv_port, handoff.remote_request_id, secret=secret)
        await until(
            http, cluster.base_url,
            lambda g: g["pinned_blocks"][key] == 0 and g["leases"][key] == 0,
            DRAIN_S, "prefill-0 unpinned",
        )  # fmt: skip


async def cancelled_request(
    http: httpx.AsyncClient, base_url: str, rng: random.Random, ttft_s: float
) -> str:
    """One streaming completion its client closes at a random moment; returns where."""
    body = {
        "model": served_name(),
        "prompt": random_prompt(rng, 20, 300),
        "max_tokens": 16,
        "temperature": 0,
        "stream": True,
    }
    mode = rng.choice(["at_once", "timed", "timed", "mid_stream"])
    chunks = rng.randint(1, 10) if mode == "mid_stream" else 0
    delay = {"at_once": rng.uniform(0, 0.02), "timed": rng.uniform(0, 1.5 * ttft_s)}.get(mode)

    async def consume() -> str:
        seen = 0
        async with http.stream("POST", base_url + "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    seen += 1
                    if seen == chunks:
                        return "mid_stream"  # leaving the block closes the connection
                if line == "data: [DONE]":
                    return "finished"
        return "closed"

    try:
        return await asyncio.wait_for(consume(), delay)
    except TimeoutError:
        return mode


async def test_cancellations_at_random_points_leave_no_kv_blocks_behind(
    cluster: RealCluster, e2e_cases: list[dict[str, Any]], reference: dict[str, Any]
) -> None:
    rng = random.Random(10)
    limits = httpx.Limits(max_keepalive_connections=0)  # each request its own connection
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        baseline = await until(http, cluster.base_url, idle, DRAIN_S, "an idle cluster")
        cancelled_before = await cancelled_outcomes(http, cluster.base_url)
        # the time to a first token of a fresh prompt, to spread the cancellations over
        started = time.monotonic()
        probe = {"model": served_name(), "prompt": random_prompt(rng, 400, 400),
                 "max_tokens": 1, "temperature": 0}  # fmt: skip
        assert (await http.post(cluster.base_url + "/v1/completions", json=probe)).is_success
        ttft_s = time.monotonic() - started

        outcomes: Counter[str] = Counter()
        peak: Counter[str] = Counter()
        launched = 0

        async def worker() -> None:
            nonlocal launched
            while launched < CANCELLATIONS:
                launched += 1
                outcomes[await cancelled_request(http, cluster.base_url, rng, ttft_s)] += 1

        async def watch() -> None:
            """Whether the gauges moved at all during the cancellations."""
            while True:
                g = await scrape(http, cluster.base_url)
                for name in ("pinned_blocks", "leases"):
                    peak[name] = max(peak[name], int(max(g[name].values(), default=0)))
                await asyncio.sleep(0.5)

        watcher = asyncio.create_task(watch())
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        storm_s = time.monotonic() - started
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        print(f"\n{launched} cancellations in {storm_s:.0f} s (first token {ttft_s:.2f} s): "
              f"{dict(outcomes)}; peak gauges {dict(peak)}")  # fmt: skip
        # The cancellations landed where they were meant to: at once, at a random moment
        # around the first token, and mid-stream; the gateway saw every mid-stream client go
        # away (one that left at once may be gone before the gateway read its request); and
        # blocks were pinned for transfers meanwhile (so that draining means something).
        assert all(outcomes[m] >= 10 for m in ("at_once", "timed", "mid_stream")), outcomes
        assert peak["pinned_blocks"] >= 1 and peak["leases"] >= 1, peak

        drain_started = time.monotonic()
        final = await until(
            http, cluster.base_url, drained(baseline), DRAIN_S, "every worker drained"
        )
        shown = {
            name: {"/".join(w): v for w, v in final[name].items()}
            for name in ("pinned_blocks", "leases", "kv_usage")
        }
        print(f"drained in {time.monotonic() - drain_started:.1f} s: {json.dumps(shown)}")
        cancelled = await cancelled_outcomes(http, cluster.base_url) - cancelled_before
        assert cancelled >= outcomes["mid_stream"], (cancelled, outcomes)
        # every cancellation path unpinned at once: no prefill worker waited for a lease
        assert lease_expiries(final) == lease_expiries(baseline), (baseline, final)

    case = next(c for c in e2e_cases if c["name"] == "several_blocks")
    tokens, text, _ = await generate(cluster, case)
    assert tokens == reference[case["name"]]["token_ids"], text
