"""The shared KV tier (LMCache in the cluster's Redis) on real workers.

A long prompt is prefilled on prefill worker A, which stores its whole 256-token chunks in the
tier. A is then killed, so the same prefix with another question lands on prefill worker B,
which has never seen it: B retrieves the chunks from the tier instead of computing them. Once
A is back (a new engine: its own cache is empty) B is killed, and the prefix is served to the
restarted A from the tier again. Every answer is token-identical to a monolithic engine.
"""

from __future__ import annotations

import json
import re
import urllib.request
from typing import Any

import pytest
import redis

from tests.e2e.cases import tier_cases
from tests.e2e.conftest import RealCluster
from tests.e2e.test_faults import RECOVERY_S, Kills, wait_until, whole
from tests.helpers import served_name

CHUNK = 256  # the tier's chunk (workers' --kv-tier-chunk-tokens default)


def complete(cluster: RealCluster, case: dict[str, Any]) -> tuple[str, dict[str, Any], str]:
    """(prefill worker, usage, text) of one greedy completion through the gateway."""
    body = {"model": served_name(), "prompt": case["text"], "temperature": 0,
            "max_tokens": case["max_tokens"]}  # fmt: skip
    request = urllib.request.Request(
        cluster.base_url + "/v1/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=RECOVERY_S) as response:
        worker = response.headers["x-pdserve-prefill-worker"]
        out = json.loads(response.read())
    return worker, out["usage"], out["choices"][0]["text"]


def retrieved_lines(cluster: RealCluster, worker: str) -> list[str]:
    """LMCache's own log lines of tier retrievals in the worker's log."""
    log = (cluster.log_dir / f"{worker}.log").read_text(errors="replace")
    return [line for line in log.splitlines() if "Retrieved" in line and "tokens" in line]


def tier_keys(cluster: RealCluster) -> set[bytes]:
    """The keys in the cluster's private tier Redis (its URL is in pdserve up's output)."""
    out = (cluster.log_dir / "pdserve-up.out").read_text(errors="replace")
    url = re.search(r"KV tier redis-server on (redis://\S+)", out)
    assert url, "pdserve up did not say where the tier's redis-server is"
    password = (cluster.log_dir / "redis-password").read_text().strip()  # pdserve up's ACL
    client = redis.Redis.from_url(
        url.group(1), username="pdserve", password=password, socket_timeout=10
    )
    try:
        return set(client.keys("*"))
    finally:
        client.close()


@pytest.mark.fault
def test_a_prefix_is_computed_once_and_retrieved_from_the_tier_by_other_workers(
    cluster: RealCluster, reference: dict[str, Any]
) -> None:
    first, second, third = tier_cases()
    wait_until(lambda: whole(cluster), RECOVERY_S, "the cluster is whole")
    before = tier_keys(cluster)

    a, usage, text = complete(cluster, first)
    assert a.startswith("prefill-"), a
    assert text == reference[first["name"]]["text"]
    prompt_tokens = usage["prompt_tokens"]
    in_tier = prompt_tokens // CHUNK * CHUNK
    assert in_tier >= 2 * CHUNK, "the prompt must span several whole chunks"
    # LMCache writes to the tier in the background, after A has answered: until every chunk
    # is there, killing A would lose the ones not yet written (B would then compute them).
    chunks = in_tier // CHUNK
    wait_until(lambda: len(tier_keys(cluster) - before) >= chunks, RECOVERY_S,
               f"the tier holds {a}'s {chunks} chunks")  # fmt: skip

    kills = Kills(cluster)
    kills.kill(a)  # A's own cache is gone; the tier still holds what A computed
    b, usage, text = complete(cluster, second)
    assert b.startswith("prefill-") and b != a, f"expected the other prefill worker, got {b}"
    assert usage["prompt_tokens_details"]["cached_tokens"] >= in_tier, usage
    assert text == reference[second["name"]]["text"]
    assert retrieved_lines(cluster, b), f"{b}'s log shows no tier retrieval"

    kills.wait_back()  # A is back, with an empty cache
    retrieved_before = len(retrieved_lines(cluster, a))  # its log goes on after the restart
    kills.kill(b)
    again, usage, text = complete(cluster, third)
    assert again == a, f"expected the restarted {a}, got {again}"
    assert usage["prompt_tokens_details"]["cached_tokens"] >= in_tier, usage
    assert text == reference[third["name"]]["text"]
    assert len(retrieved_lines(cluster, a)) > retrieved_before, f"{a} did not use the tier"
    kills.wait_back()
