"""The KV transport between real transfer processes over loopback TCP and shared memory.

Each test starts a real producer and consumer agent (``kv_transfer.agent``) over memfd
regions laid out like the CPU KV cache, exactly as the connector does inside vLLM workers.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kv_transfer import bench
from kv_transfer.client import release, release_by_key
from kv_transfer.handle import AgentHandle
from tests.helpers import dead_port, wait_pinned

GEO = bench.Geometry(blocks=4, block_bytes=4096)


class Pair:
    def __init__(self, producer_settings: dict[str, Any], consumer_settings: dict[str, Any]):
        self.p_fd, self.p_mem, self.p_layout = bench.make_region(GEO, 8, seed=1)
        self.c_fd, self.c_mem, self.c_layout = bench.make_region(GEO, 8, seed=2)
        self.producer = bench.start_agent("producer", self.p_fd, self.p_layout, **producer_settings)
        self.consumer = bench.start_agent("consumer", self.c_fd, self.c_layout, **consumer_settings)

    def serve(self, req: str, blocks: list[int], key: str = "") -> None:
        self.producer.channel.send({"op": "serve", "req": req, "blocks": blocks, "key": key})

    def pull(self, req: str, remote: list[int], local: list[int], port: int = 0) -> None:
        self.consumer.channel.send(
            {
                "op": "pull",
                "req": req,
                "host": "127.0.0.1",
                "port": port or self.producer.port,
                "remote_req": req,
                "remote_blocks": remote,
                "local_blocks": local,
            }
        )

    def close(self) -> None:
        for agent in (self.producer, self.consumer):
            agent.stop()
        for fd in (self.p_fd, self.c_fd):
            os.close(fd)


def next_message(agent: AgentHandle, timeout_s: float = 10.0) -> dict[str, Any]:
    agent.channel.sock.settimeout(timeout_s)
    message = agent.channel.recv()
    agent.channel.sock.settimeout(None)
    assert message is not None, "agent closed its control channel"
    return message


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    settings = getattr(request, "param", {})
    p = Pair(settings.get("producer", {}), settings.get("consumer", {}))
    yield p
    p.close()


def test_pull_copies_exactly_the_requested_blocks(pair: Pair) -> None:
    before = bench.blocks_digest(pair.c_mem, pair.c_layout, [0, 2, 4, 6])
    pair.serve("r1", [5, 1, 2, 3])
    pair.pull("r1", remote=[5, 1, 2, 3], local=[7, 5, 3, 1])
    done = next_message(pair.consumer)
    assert done["op"] == "done" and done["ok"], done
    assert done["bytes"] == 4 * pair.p_layout.bytes_per_block
    src = bench.blocks_digest(pair.p_mem, pair.p_layout, [5, 1, 2, 3])
    assert bench.blocks_digest(pair.c_mem, pair.c_layout, [7, 5, 3, 1]) == src
    # blocks that were not pulled into are untouched
    assert bench.blocks_digest(pair.c_mem, pair.c_layout, [0, 2, 4, 6]) == before
    finished = next_message(pair.producer)
    assert finished["req"] == "r1" and finished["reason"] == "sent"


def test_pull_that_arrives_before_registration_waits_for_it(pair: Pair) -> None:
    pair.pull("early", remote=[0], local=[1])
    time.sleep(0.3)
    pair.serve("early", [0])
    assert next_message(pair.consumer)["ok"]
    assert next_message(pair.producer)["reason"] == "sent"


@pytest.mark.parametrize("pair", [{"producer": {"register_wait_s": 0.3}}], indirect=True)
def test_unknown_request_is_a_clear_error(pair: Pair) -> None:
    pair.pull("nobody", remote=[0], local=[1])
    done = next_message(pair.consumer)
    assert not done["ok"]
    assert "holds no KV blocks for request nobody" in done["error"]


@pytest.mark.parametrize("pair", [{"consumer": {"compat": {"bench": "2"}}}], indirect=True)
def test_incompatible_workers_are_refused_and_blocks_unpinned(pair: Pair) -> None:
    pair.serve("r", [0])
    pair.pull("r", remote=[0], local=[1])
    done = next_message(pair.consumer)
    assert not done["ok"]
    assert "not exchangeable" in done["error"] and "bench: ours=1 decode worker=2" in done["error"]
    assert next_message(pair.producer) == {"op": "finished", "req": "r", "reason": "released"}


def test_blocks_beyond_the_pinned_ones_are_refused(pair: Pair) -> None:
    pair.serve("r", [0, 1])
    pair.pull("r", remote=[0, 2], local=[1, 3])
    done = next_message(pair.consumer)
    assert not done["ok"] and "contiguous run" in done["error"]


LEASE_S = 0.5


@pytest.mark.parametrize("pair", [{"producer": {"lease_s": LEASE_S}}], indirect=True)
def test_unpulled_blocks_are_unpinned_when_the_lease_runs_out(pair: Pair) -> None:
    started = time.monotonic()
    pair.serve("orphan", [0])
    finished = next_message(pair.producer, timeout_s=60.0)  # how late: only a hang matters
    assert finished == {"op": "finished", "req": "orphan", "reason": "lease"}
    assert time.monotonic() - started >= LEASE_S, "unpinned before its lease ran out"


def test_release_unpins_at_once_and_also_before_registration(pair: Pair) -> None:
    pair.serve("r", [0])
    wait_pinned(pair.producer.port, "r")
    assert release("127.0.0.1", pair.producer.port, "r") is True
    assert next_message(pair.producer)["reason"] == "released"
    # a release that overtakes its registration unpins the blocks when they arrive
    assert release("127.0.0.1", pair.producer.port, "later") is False
    pair.serve("later", [1])
    assert next_message(pair.producer) == {"op": "finished", "req": "later", "reason": "released"}


def test_release_by_key_unpins_the_job_that_carries_the_key(pair: Pair) -> None:
    """The prefill service knows its own request id, not the engine's (vLLM renames it)."""
    pair.serve("engine-id-1", [0], key="gw-1")
    wait_pinned(pair.producer.port, "engine-id-1")
    assert release_by_key("127.0.0.1", pair.producer.port, "engine-id-1") is False  # not a key
    assert release("127.0.0.1", pair.producer.port, "gw-1") is False  # not a request id
    assert release_by_key("127.0.0.1", pair.producer.port, "gw-1") is True
    assert next_message(pair.producer) == {"op": "finished", "req": "engine-id-1",
                                           "reason": "released"}  # fmt: skip
    # an abort that overtakes the job: the job is unpinned as it arrives
    assert release_by_key("127.0.0.1", pair.producer.port, "gw-2") is False
    pair.serve("engine-id-2", [1], key="gw-2")
    assert next_message(pair.producer)["req"] == "engine-id-2"


@pytest.mark.parametrize("pair", [{"consumer": {"io_timeout_s": 2.0}}], indirect=True)
def test_unreachable_producer_fails_the_pull(pair: Pair) -> None:
    pair.pull("r", remote=[0], local=[1], port=dead_port())
    done = next_message(pair.consumer)
    assert not done["ok"] and "refused" in done["error"].lower()


def test_many_pulls_reuse_connections_and_stay_correct(pair: Pair) -> None:
    for n in range(20):
        blocks = [n % 8, (n + 3) % 8]
        pair.serve(f"r{n}", blocks)
        pair.pull(f"r{n}", remote=blocks, local=[(n + 1) % 8, (n + 5) % 8])
        assert next_message(pair.consumer)["ok"]
        assert next_message(pair.producer)["reason"] == "sent"
        src = bench.blocks_digest(pair.p_mem, pair.p_layout, blocks)
        assert bench.blocks_digest(pair.c_mem, pair.c_layout, [(n + 1) % 8, (n + 5) % 8]) == src


def test_pull_after_the_producer_restarted_reconnects(pair: Pair) -> None:
    """A kept connection to a prefill worker that restarted (same port) is dead: the next pull
    reconnects once and succeeds instead of failing the request."""
    pair.serve("before", [0])
    pair.pull("before", remote=[0], local=[1])
    assert next_message(pair.consumer)["ok"]  # the consumer now keeps a connection
    port = pair.producer.port
    pair.producer.stop()
    pair.producer = bench.start_agent("producer", pair.p_fd, pair.p_layout, port=port)
    assert pair.producer.port == port
    pair.serve("after", [2, 3])
    pair.pull("after", remote=[2, 3], local=[4, 5])
    done = next_message(pair.consumer)
    assert done["ok"], done
    src = bench.blocks_digest(pair.p_mem, pair.p_layout, [2, 3])
    assert bench.blocks_digest(pair.c_mem, pair.c_layout, [4, 5]) == src


def test_a_pull_of_a_run_of_a_job_is_exact(pair: Pair) -> None:
    """A decode worker that holds the first blocks of a prompt pulls only the rest: a
    contiguous run of the job, authenticated like a whole one (kv_transfer.integrity)."""
    pair.serve("r1", [5, 1, 2, 3])
    pair.pull("r1", remote=[2, 3], local=[6, 0])
    done = next_message(pair.consumer)
    assert done["op"] == "done" and done["ok"], done
    src = bench.blocks_digest(pair.p_mem, pair.p_layout, [2, 3])
    assert bench.blocks_digest(pair.c_mem, pair.c_layout, [6, 0]) == src
