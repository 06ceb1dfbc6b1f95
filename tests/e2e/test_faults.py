"""Fault injection on the real cluster (2 prefill + 2 decode vLLM workers, Redis, gateway).

Each test breaks one real process the way production does (``kill -9`` of its process group,
``SIGSTOP``) while requests stream, and asserts what users see. ``pdserve up`` restarts a
killed worker; each test waits until the cluster is whole again, so the tests share the one
session cluster. They run after every other e2e test (``conftest`` orders them last).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.e2e.conftest import (
    DECODE_WORKERS,
    PREFILL_WORKERS,
    RealCluster,
    metric_sum,
    pid_on_port,
)
from tests.helpers import served_name

pytestmark = [pytest.mark.fault, pytest.mark.timeout(2400)]

RECOVERY_S = 600  # a killed worker's restart: a new vLLM engine on busy cores
MAX_TOKENS = 24

PROMPTS = [
    "Write a short note about the history of lighthouses.",
    "Explain how bees make honey, step by step.",
    "Describe a walk through a rainy city at night.",
    "List some reasons people enjoy railway travel.",
]


@dataclass
class Stream:
    """One streamed completion, read on a thread: its text so far, headers and ending."""

    prompt: str
    max_tokens: int = MAX_TOKENS
    text: str = ""
    tokens: int = 0
    finish: str = ""
    usage: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    error: str = ""
    done: threading.Event = field(default_factory=threading.Event)

    def run(self, base_url: str) -> None:
        body = {
            "model": served_name(), "prompt": self.prompt, "max_tokens": self.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
        }  # fmt: skip
        request = urllib.request.Request(
            base_url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=RECOVERY_S) as response:
                self.headers = {k.lower(): v for k, v in response.headers.items()}
                for raw in response:
                    self._on_line(raw.decode().strip())
        except OSError as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.done.set()

    def _on_line(self, line: str) -> None:
        if not line.startswith("data: {"):
            return
        event = json.loads(line[6:])
        if "error" in event:
            self.error = json.dumps(event["error"])
        for choice in event.get("choices") or []:
            if choice.get("text"):
                self.text += choice["text"]
                self.tokens += 1
            self.finish = choice.get("finish_reason") or self.finish
        self.usage = event.get("usage") or self.usage


def start_streams(cluster: RealCluster, prompts: list[str], max_tokens: int) -> list[Stream]:
    streams = [Stream(p, max_tokens) for p in prompts]
    for s in streams:
        threading.Thread(target=s.run, args=(cluster.base_url,), daemon=True).start()
    return streams


def wait_all(streams: list[Stream], timeout_s: float = RECOVERY_S) -> None:
    deadline = time.monotonic() + timeout_s
    for s in streams:
        assert s.done.wait(max(0.0, deadline - time.monotonic())), "a stream never ended"


def wait_until(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.2)


def health(cluster: RealCluster) -> dict[str, Any]:
    with urllib.request.urlopen(cluster.base_url + "/health", timeout=10) as response:
        return dict(json.loads(response.read()))


def whole(cluster: RealCluster) -> bool:
    try:
        h = health(cluster)
    except OSError:
        return False
    return bool(
        h["healthy_prefill_workers"] == PREFILL_WORKERS
        and h["healthy_decode_workers"] == DECODE_WORKERS
    )


def group_on_port(port: int) -> int:
    """The process group of the worker listening on ``port`` (its engine is in it too)."""
    return os.getpgid(pid_on_port(port))


def reference_texts(cluster: RealCluster, prompts: list[str], max_tokens: int) -> list[str]:
    """Greedy outputs of an uninterrupted run through the same cluster."""
    streams = start_streams(cluster, prompts, max_tokens)
    wait_all(streams)
    assert all(s.finish == "length" and not s.error for s in streams), streams
    return [s.text for s in streams]


def restarts_back(cluster: RealCluster, name: str) -> int:
    """How often ``pdserve up`` has said that ``name`` is back after a restart (the new
    process passed its own readiness check)."""
    out = (cluster.log_dir / "pdserve-up.out").read_text(errors="replace")
    return len(re.findall(rf"^{re.escape(name)} is back: ", out, re.MULTILINE))


@dataclass
class Kills:
    """Workers a test kills with ``kill -9``, and how to wait until they are all back."""

    cluster: RealCluster
    before: dict[str, int] = field(default_factory=dict)  # name -> restarts back at its kill

    def kill(self, name: str) -> None:
        """Kill the worker ``name`` (e.g. "decode-1", as the response headers name it)."""
        role, index = name.rsplit("-", 1)
        self.before.setdefault(name, restarts_back(self.cluster, name))
        os.killpg(group_on_port(self.cluster.ports[role] + int(index)), signal.SIGKILL)

    def wait_back(self) -> None:
        """Until ``pdserve up`` has each killed worker ready again and the gateway routes to
        every worker. The gateway's view alone is not enough: until its next probe it still
        counts a worker killed a moment ago as healthy, so the cluster looks whole while a
        worker is down (the next test then found one prefill worker fewer than it broke)."""
        for name, before in self.before.items():
            wait_until(lambda n=name, b=before: restarts_back(self.cluster, n) > b,
                       RECOVERY_S, f"pdserve up has {name} back")  # fmt: skip
        self.before.clear()
        wait_until(lambda: whole(self.cluster), RECOVERY_S, "the cluster is whole again")


@contextmanager
def restored(cluster: RealCluster) -> Iterator[Kills]:
    """Kill workers through the yielded ``Kills``; after the test, wait until every one is
    back (later tests need the whole cluster)."""
    kills = Kills(cluster)
    try:
        yield kills
    finally:
        kills.wait_back()


def test_kill_decode_worker_mid_stream_migrates_every_stream(cluster: RealCluster) -> None:
    """kill -9 of one of two decode workers while 4 streams run: every stream completes with
    the same greedy text as an uninterrupted run (no token lost or repeated)."""
    wait_until(lambda: whole(cluster), RECOVERY_S, "the cluster is whole")
    # Long enough that no stream can finish between the check below and the kill, however
    # slow the machine (with 24 tokens, the victim's streams once ended in that gap).
    long = 4 * MAX_TOKENS
    expected = reference_texts(cluster, PROMPTS, long)
    migrations = metric_sum(cluster, "pdserve_gateway_retries_total", 'kind="migration"')
    with restored(cluster) as kills:
        streams = start_streams(cluster, PROMPTS, long)
        wait_until(lambda: all(s.tokens >= 3 or s.done.is_set() for s in streams), RECOVERY_S,
                   "every stream has tokens")  # fmt: skip
        victim = streams[0].headers["x-pdserve-decode-worker"]  # e.g. "decode-1"
        on_victim = [s for s in streams if s.headers.get("x-pdserve-decode-worker") == victim]
        # Streams not over when it dies (counted by completion, not by the chunks received:
        # the gateway may send several tokens in one chunk).
        unfinished = [s for s in on_victim if not s.done.is_set()]
        kills.kill(victim)
        wait_all(streams)
    for s, text in zip(streams, expected, strict=True):
        assert not s.error, s.error
        assert s.finish == "length" and s.usage["completion_tokens"] == long, s
        assert s.text == text, f"{s.prompt!r}: {s.text!r} != uninterrupted {text!r}"
    moved = metric_sum(cluster, "pdserve_gateway_retries_total", 'kind="migration"') - migrations
    # The kill hit streams (the first one was 3 of 96 tokens in), and each of them moved once.
    assert unfinished, "no stream was on the killed worker when it died"
    assert moved == len(unfinished), f"{moved} migrations for {len(unfinished)} streams"


def long_prompts(n: int, tag: str) -> list[str]:
    """``n`` prompts of about 400 tokens that share no block with any other request."""
    words = ["amber", "basalt", "cedar", "delta", "ember", "fjord", "garnet", "harbor"]
    return [
        f"{tag} {i}: " + " ".join(f"{words[(i + k) % 8]}-{k * (i + 7)}" for k in range(130))
        for i in range(n)
    ]


def prefill_recoveries(cluster: RealCluster) -> float:
    """Prefills that failed and were tried again elsewhere or computed by the decode worker."""
    return metric_sum(cluster, "pdserve_gateway_retries_total", 'kind="prefill"') + metric_sum(
        cluster, "pdserve_gateway_local_fallbacks_total", 'reason="prefill_failed"'
    )


def test_kill_prefill_worker_while_requests_stream(cluster: RealCluster) -> None:
    """kill -9 of one of two prefill workers while it holds prefills: every request completes
    with the text of an uninterrupted run, and each interrupted prefill is counted as tried
    again (or computed by the decode worker). The worker is stopped first (SIGSTOP) so that
    the prefills routed to it are certainly in flight when it dies."""
    wait_until(lambda: whole(cluster), RECOVERY_S, "the cluster is whole")
    prompts = long_prompts(8, f"kill-prefill {time.time_ns()}")
    expected = reference_texts(cluster, [f"{p}." for p in prompts], 16)
    before = prefill_recoveries(cluster)
    group = group_on_port(cluster.ports["prefill"])
    with restored(cluster) as kills:
        os.killpg(group, signal.SIGSTOP)
        # Each prompt goes to the worker that cached it in the reference run: about half
        # to the stopped one, where they wait in its gRPC server.
        streams = start_streams(cluster, [f"{p}." for p in prompts], 16)
        time.sleep(2)
        kills.kill("prefill-0")
        with contextlib.suppress(ProcessLookupError):  # a stopped child would linger
            os.killpg(group, signal.SIGCONT)
        wait_all(streams)
        failed = [s for s in streams if s.error or s.finish != "length"]
        assert not failed, failed
    assert [s.text for s in streams] == expected
    recovered = prefill_recoveries(cluster) - before
    assert recovered >= 1, "no prefill was in flight on the killed worker"


# docs/reliability.md: a hung worker is ejected within health_interval_s + control_timeout_s
# (5 + 3 s by default). Asserted with twice that as headroom: the gateway shares two cores
# with four engines here, and its health loop may start late.
HANG_BOUND_S = 8.0
HEADROOM = 2.0


def worker_healthy(cluster: RealCluster, name: str) -> bool:
    return metric_sum(cluster, "pdserve_gateway_worker_healthy", f'worker="{name}"') == 1


def ejected_within(cluster: RealCluster, name: str, since: float) -> float:
    """Seconds from ``since`` until the gateway stopped routing to ``name``; asserts the bound."""
    wait_until(lambda: not worker_healthy(cluster, name), HANG_BOUND_S * HEADROOM,
               f"{name} is ejected")  # fmt: skip
    return time.monotonic() - since


def test_hung_prefill_worker_is_ejected_and_readmitted(cluster: RealCluster) -> None:
    """SIGSTOP of a prefill worker (a hang): it is ejected within the documented bound,
    requests complete through the other workers; after SIGCONT it is readmitted."""
    wait_until(lambda: whole(cluster), RECOVERY_S, "the cluster is whole")
    group = group_on_port(cluster.ports["prefill"] + 1)
    os.killpg(group, signal.SIGSTOP)
    try:
        started = time.monotonic()
        streams = start_streams(cluster, PROMPTS, 8)
        took = ejected_within(cluster, "prefill-1", started)
        wait_all(streams)
        assert all(not s.error and s.finish == "length" for s in streams), streams
    finally:
        os.killpg(group, signal.SIGCONT)
    wait_until(lambda: whole(cluster), 120, "the worker is readmitted after SIGCONT")
    print(f"the hung prefill worker was ejected {took:.1f} s after SIGSTOP")


def test_hung_decode_worker_mid_stream_moves_its_streams(cluster: RealCluster) -> None:
    """SIGSTOP of a decode worker while 4 greedy streams run: it is ejected within the
    documented bound and each stream on it moves once (counted), with the same text as an
    uninterrupted run; after SIGCONT it is readmitted."""
    wait_until(lambda: whole(cluster), RECOVERY_S, "the cluster is whole")
    long = 4 * MAX_TOKENS
    expected = reference_texts(cluster, PROMPTS, long)
    migrations = metric_sum(cluster, "pdserve_gateway_retries_total", 'kind="migration"')
    streams = start_streams(cluster, PROMPTS, long)
    wait_until(lambda: all(s.tokens >= 3 or s.done.is_set() for s in streams), RECOVERY_S,
               "every stream has tokens")  # fmt: skip
    victim = streams[0].headers["x-pdserve-decode-worker"]
    on_victim = [s for s in streams if s.headers.get("x-pdserve-decode-worker") == victim]
    unfinished = [s for s in on_victim if not s.done.is_set()]
    group = group_on_port(cluster.ports["decode"] + int(victim.rsplit("-", 1)[1]))
    os.killpg(group, signal.SIGSTOP)
    try:
        took = ejected_within(cluster, victim, time.monotonic())
        wait_all(streams)
    finally:
        os.killpg(group, signal.SIGCONT)
    for s, text in zip(streams, expected, strict=True):
        assert not s.error and s.finish == "length", s
        assert s.text == text, f"{s.prompt!r}: {s.text!r} != uninterrupted {text!r}"
    moved = metric_sum(cluster, "pdserve_gateway_retries_total", 'kind="migration"') - migrations
    assert unfinished, "no stream was on the stopped worker"
    assert moved == len(unfinished), f"{moved} migrations for {len(unfinished)} streams"
    wait_until(lambda: whole(cluster), 120, "the worker is readmitted after SIGCONT")
    print(f"the hung decode worker was ejected {took:.1f} s after SIGSTOP")


def test_decode_worker_hung_before_its_first_token_hands_the_same_kv_on(
    cluster: RealCluster,
) -> None:
    """A decode worker stopped (SIGSTOP) before the first token of the requests sent to it:
    once it is ejected, each of them goes to the other decode worker with the same KV
    hand-off, whose blocks that worker pulls (the decode engine computes only the last prompt
    token); none falls back to computing its prompt there."""
    import asyncio

    from tests.e2e.test_disaggregated import check_transfer, generate

    wait_until(lambda: whole(cluster), RECOVERY_S, "the cluster is whole")
    seed = time.time_ns() % 10_000
    prompts = [[1000 + (seed + 97 * i + 13 * k) % 30000 for k in range(300)] for i in range(4)]
    retries = metric_sum(cluster, "pdserve_gateway_retries_total", 'kind="decode"')
    fallbacks = metric_sum(cluster, "pdserve_gateway_local_fallbacks_total")
    group = group_on_port(cluster.ports["decode"] + 1)

    async def run_all() -> list[Any]:
        cases = [{"token_ids": ids, "max_tokens": 8} for ids in prompts]
        return await asyncio.gather(*(generate(cluster, case) for case in cases))

    os.killpg(group, signal.SIGSTOP)
    try:
        results = asyncio.run(run_all())
    finally:
        os.killpg(group, signal.SIGCONT)
    healthy = f"127.0.0.1:{cluster.ports['decode']}"  # decode-0, by its address here
    for ids, (tokens, _, final) in zip(prompts, results, strict=True):
        assert len(tokens) == 8 and final.decode_worker == healthy, final
        check_transfer(final, len(ids))  # KV pulled; only the last prompt token computed
    moved = metric_sum(cluster, "pdserve_gateway_retries_total", 'kind="decode"') - retries
    assert moved >= 1, "no request was sent to the stopped decode worker"
    assert metric_sum(cluster, "pdserve_gateway_local_fallbacks_total") == fallbacks
    wait_until(lambda: whole(cluster), 120, "the worker is readmitted after SIGCONT")


def agent_pid(cluster: RealCluster, worker: str) -> int:
    """The KV transfer process of ``worker`` (it runs in the worker's process group)."""
    import psutil

    role, index = worker.rsplit("-", 1)
    group = group_on_port(cluster.ports[role] + int(index))
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if "kv_transfer.agent" in " ".join(proc.info["cmdline"] or ()):
            with contextlib.suppress(ProcessLookupError):
                if os.getpgid(proc.info["pid"]) == group:
                    return int(proc.info["pid"])
    raise AssertionError(f"{worker} has no KV transfer process")


def test_killed_kv_transfer_process_takes_its_worker_down_and_back(cluster: RealCluster) -> None:
    """kill -9 of a prefill worker's KV transfer process alone: the worker's next engine step
    sees it gone and the worker exits loudly (``pdserve up`` restarts it) instead of pinning
    blocks nobody can serve; every request completes and the failed prefill is counted."""
    wait_until(lambda: whole(cluster), RECOVERY_S, "the cluster is whole")
    before = prefill_recoveries(cluster)
    with restored(cluster) as kills:
        kills.before["prefill-1"] = restarts_back(cluster, "prefill-1")
        os.kill(agent_pid(cluster, "prefill-1"), signal.SIGKILL)
        # Batches of new prompts (routed by load, so over both prefill workers) until one
        # reached the broken worker and pdserve up said it is back.
        for batch in range(10):
            streams = start_streams(cluster, long_prompts(4, f"agent {batch} {time.time_ns()}"), 8)
            wait_all(streams)
            assert all(not s.error and s.finish == "length" for s in streams), streams
            if prefill_recoveries(cluster) > before:
                break
    # restored() waited until pdserve up said "prefill-1 is back": the worker went down.
    assert prefill_recoveries(cluster) - before >= 1, "no prefill reached the broken worker"


def test_killed_gateway_is_restarted_and_retrying_clients_get_answers(
    cluster: RealCluster,
) -> None:
    """kill -9 of the gateway while 4 requests stream: their connections break, ``pdserve up``
    restarts the gateway on the same port, clients that retry get full answers, and nothing
    the dead gateway's requests held stays pinned on any worker."""
    wait_until(lambda: whole(cluster), RECOVERY_S, "the cluster is whole")
    back = restarts_back(cluster, "gateway")
    streams = start_streams(cluster, PROMPTS, 4 * MAX_TOKENS)
    wait_until(lambda: all(s.tokens >= 1 or s.done.is_set() for s in streams), RECOVERY_S,
               "every stream has tokens")  # fmt: skip
    os.killpg(group_on_port(cluster.http_port), signal.SIGKILL)
    wait_all(streams)
    assert all(s.error or s.finish != "length" for s in streams), "a stream outlived its gateway"

    deadline = time.monotonic() + RECOVERY_S

    def answered(prompt: str) -> Stream:
        while True:  # a client retrying until the restarted gateway answers
            retry = Stream(prompt, 8)
            retry.run(cluster.base_url)
            if not retry.error:
                return retry
            assert time.monotonic() < deadline, f"no answer after the gateway died: {retry}"
            time.sleep(1)

    retried = [answered(p) for p in PROMPTS]
    assert all(s.finish == "length" and s.usage["completion_tokens"] == 8 for s in retried)
    assert restarts_back(cluster, "gateway") == back + 1
    wait_until(lambda: whole(cluster), RECOVERY_S, "the new gateway sees every worker")
    wait_until(lambda: metric_sum(cluster, "pdserve_gateway_worker_pinned_blocks") == 0
               and metric_sum(cluster, "pdserve_gateway_worker_leases") == 0,
               RECOVERY_S, "every worker freed what the dead gateway's requests held")  # fmt: skip


INDEX_BACK_S = 10.0  # docs/reliability.md: the index is whole this long after Redis is back


def redis_port(cluster: RealCluster) -> int:
    out = (cluster.log_dir / "pdserve-up.out").read_text(errors="replace")
    found = re.search(r"private redis-server on redis://127\.0\.0\.1:(\d+)/", out)
    assert found, "pdserve up did not say where its Redis is"
    return int(found.group(1))


def redis_answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def chat(cluster: RealCluster, system: str, question: str) -> None:
    body = {"model": served_name(), "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": question}]}  # fmt: skip
    request = urllib.request.Request(
        cluster.base_url + "/v1/chat/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=RECOVERY_S) as response:
        assert response.status == 200


def test_redis_restarted_empty_costs_no_request(cluster: RealCluster) -> None:
    """Redis killed (kill -9) and restarted empty by ``pdserve up`` while requests stream: no
    request fails, and the workers write their cached prefixes back, so the router predicts
    a cached prefix again."""
    wait_until(lambda: whole(cluster), RECOVERY_S, "the cluster is whole")
    system = "You answer questions about this list. " + " ".join(
        f"Item {k} is a {w} of size {k * 7}." for k, w in enumerate(["lamp", "boat", "kite"] * 30)
    )
    chat(cluster, system, "Which item is first?")  # its blocks are cached and indexed
    port = redis_port(cluster)
    group = group_on_port(port)
    os.killpg(group, signal.SIGKILL)
    streams = start_streams(cluster, PROMPTS, 8)
    wait_until(lambda: redis_answers(port) and group_on_port(port) != group, RECOVERY_S,
               "pdserve up restarted Redis")  # fmt: skip
    back = time.monotonic()
    wait_all(streams)
    assert all(not s.error and s.finish == "length" for s in streams), streams

    def predicted_again() -> bool:
        before = metric_sum(cluster, "pdserve_gateway_predicted_cached_tokens_total")
        chat(cluster, system, "Which item is last?")
        after = metric_sum(cluster, "pdserve_gateway_predicted_cached_tokens_total")
        return after - before >= 128

    # The workers compare the index's count of their blocks with their own every 2 s and
    # rewrite it: docs/reliability.md says the index is whole 10 s after Redis is back.
    # Asserted with three times that as headroom (each check is a request on busy cores).
    wait_until(predicted_again, 3 * INDEX_BACK_S, "the prefix index predicted the prefix again")
    print(f"the index predicted the cached prefix {time.monotonic() - back:.1f} s after Redis")
