"""The KV transfer port under hostile or careless peers, with real transfer processes.

Each test starts real producer/consumer agents (``kv_transfer.agent``) that share a deployment
secret file, as the workers of one deployment do, and talks to them over loopback TCP.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kv_transfer import bench
from kv_transfer.announce import Announcer
from kv_transfer.auth import AuthenticationFailed, connect, load_secret, new_secret
from kv_transfer.client import release, renew
from kv_transfer.handle import AgentHandle
from kv_transfer.scheduler import new_owner
from kv_transfer.wire import ConnectionClosed, recv_frame, send_frame
from tests.helpers import wait_pinned

GEO = bench.Geometry(blocks=4, block_bytes=4096)
RSS_SLACK = 32 * 1024 * 1024


def write_secret(path: Path, value: str | None = None) -> Path:
    path.write_text((value or new_secret()) + "\n")
    path.chmod(0o600)
    return path


class Agents:
    """A producer and a consumer agent over 8-block regions, both with ``secret_file``."""

    def __init__(self, secret_file: Path, **producer: Any) -> None:
        self.secret = load_secret(secret_file)
        self.p_fd, self.p_mem, self.p_layout = bench.make_region(GEO, 8, seed=1)
        self.c_fd, self.c_mem, self.c_layout = bench.make_region(GEO, 8, seed=2)
        common = {"secret_file": str(secret_file)}
        self.producer = bench.start_agent(
            "producer", self.p_fd, self.p_layout, **common, **producer
        )
        self.consumer = bench.start_agent("consumer", self.c_fd, self.c_layout, **common)

    def serve(self, req: str, blocks: list[int]) -> None:
        self.producer.channel.send({"op": "serve", "req": req, "blocks": blocks})

    def pull(self, req: str, remote: list[int], local: list[int], port: int = 0) -> None:
        """Pull ``remote`` into ``local``, from the producer or through ``port`` (a proxy)."""
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

    def pull_is_correct(self, req: str, remote: list[int], local: list[int]) -> None:
        self.serve(req, remote)
        self.pull(req, remote, local)
        done = next_message(self.consumer)
        assert done["op"] == "done" and done["ok"], done
        src = bench.blocks_digest(self.p_mem, self.p_layout, remote)
        assert bench.blocks_digest(self.c_mem, self.c_layout, local) == src

    def close(self) -> None:
        for agent in (self.producer, self.consumer):
            agent.stop()
        for fd in (self.p_fd, self.c_fd):
            os.close(fd)


def next_message(agent: AgentHandle, timeout_s: float = 30.0) -> dict[str, Any]:
    agent.channel.sock.settimeout(timeout_s)
    try:
        message = agent.channel.recv()
    finally:
        agent.channel.sock.settimeout(None)
    assert message is not None, "agent closed its control channel"
    return message


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    return write_secret(tmp_path / "secret")


@pytest.fixture
def agents(secret_file: Path, request: pytest.FixtureRequest) -> Iterator[Agents]:
    pair = Agents(secret_file, **getattr(request, "param", {}))
    yield pair
    pair.close()


def test_pull_and_release_work_with_the_deployment_secret(agents: Agents) -> None:
    agents.pull_is_correct("r1", [5, 1], [2, 6])
    assert next_message(agents.producer)["reason"] == "sent"
    agents.serve("r2", [3])
    wait_pinned(agents.producer.port, "r2", agents.secret)
    assert release("127.0.0.1", agents.producer.port, "r2", secret=agents.secret) is True
    assert next_message(agents.producer) == {"op": "finished", "req": "r2", "reason": "released"}


def test_a_wrong_or_missing_secret_is_refused_before_anything_is_read(
    agents: Agents, tmp_path: Path
) -> None:
    agents.serve("victim", [0])
    wrong = load_secret(write_secret(tmp_path / "other"))
    with pytest.raises(AuthenticationFailed, match="refused"):
        release("127.0.0.1", agents.producer.port, "victim", secret=wrong)
    with pytest.raises(AuthenticationFailed, match="requires the deployment secret"):
        release("127.0.0.1", agents.producer.port, "victim", secret=None)
    # A raw peer that skips the handshake and asks for the blocks is cut off unanswered.
    with socket.create_connection(("127.0.0.1", agents.producer.port), timeout=10) as conn:
        assert recv_frame(conn)["op"] == "hello"
        send_frame(conn, {"op": "pull", "req": "victim", "blocks": [0]})
        with pytest.raises(ConnectionClosed):
            recv_frame(conn)
    # So is one that guesses a MAC.
    with socket.create_connection(("127.0.0.1", agents.producer.port), timeout=10) as conn:
        assert recv_frame(conn)["op"] == "hello"
        send_frame(conn, {"op": "auth", "nonce": "00", "mac": "0" * 64})
        assert recv_frame(conn) == {"ok": False, "error": "authentication failed"}
        with pytest.raises(ConnectionClosed):
            recv_frame(conn)
    # The blocks are still pinned and served to the real decode side.
    agents.pull("victim", [0], [4])
    assert next_message(agents.consumer)["ok"]
    assert next_message(agents.producer)["reason"] == "sent"


def test_a_consumer_with_another_secret_cannot_pull(agents: Agents, tmp_path: Path) -> None:
    stranger = Agents(write_secret(tmp_path / "stranger"))
    try:
        agents.serve("r", [1])
        stranger.consumer.channel.send(
            {
                "op": "pull",
                "req": "r",
                "host": "127.0.0.1",
                "port": agents.producer.port,
                "remote_req": "r",
                "remote_blocks": [1],
                "local_blocks": [2],
            }
        )
        done = next_message(stranger.consumer)
        assert not done["ok"] and "refused" in done["error"], done
    finally:
        stranger.close()
    agents.pull("r", [1], [2])
    assert next_message(agents.consumer)["ok"]


@pytest.mark.parametrize("agents", [{"lease_s": 1.0}], indirect=True)
def test_the_scheduler_announces_jobs_at_once_and_the_late_step_copy_is_ignored(
    agents: Agents,
) -> None:
    """The engine's scheduler registers a finished prompt over the KV port (no engine step
    needed); the same job then arriving through the worker process after it was pulled must
    not pin it again (a second "finished" would confuse the engine)."""
    owner = new_owner()
    agents.producer.channel.send({"op": "owner", "epoch": owner[0], "key": owner[1]})
    assert next_message(agents.producer) == {"op": "owner", "ok": True}
    announcer = Announcer("127.0.0.1", [agents.producer.port], agents.secret, owner)
    try:
        announcer.announce("early", 1, [5, 1], "")
        agents.pull("early", [5, 1], [2, 6])  # no serve through the worker at all
        assert next_message(agents.consumer)["ok"]
        assert next_message(agents.producer)["reason"] == "sent"
        agents.producer.channel.send(  # the step path's copy, late
            {"op": "serve", "req": "early", "blocks": [5, 1], "seq": 1}
        )
        threading.Event().wait(2.0)  # two leases: it would have expired by now
        assert agents.producer.channel.poll() == []
    finally:
        announcer.close()


# The producer's lease where a test renews it: long next to the renewals (every 0.1 to 0.2 s),
# so that only a renewal that never comes lets it run out, not a busy machine.
RENEWED_LEASE_S = 2.0


@pytest.mark.parametrize("agents", [{"lease_s": RENEWED_LEASE_S}], indirect=True)
async def test_a_decode_worker_keeps_a_queued_handoff_alive_until_it_stops(
    agents: Agents,
) -> None:
    """The decode service renews the hand-off's lease while its engine has the request queued
    (here: one and a half leases long), and stops when told to: the lease then runs out."""
    from decode_service.config import DecodeSettings
    from decode_service.service import DecodeService

    # It renews every third of its own lease setting: every 0.2 s.
    settings = DecodeSettings.model_validate({"kv_lease_s": 0.6})
    service = DecodeService(None, settings, None)
    service.secret = agents.secret  # the process-wide secret is read once, by whichever test
    agents.serve("queued", [2])
    handoff = {"remote_host": "127.0.0.1", "remote_port": agents.producer.port,
               "remote_request_id": "queued"}  # fmt: skip
    keeper = service._keep_lease(handoff)
    await asyncio.sleep(1.5 * RENEWED_LEASE_S)
    assert agents.producer.channel.poll() == []  # no "finished": still pinned
    keeper.cancel()
    message = await asyncio.to_thread(next_message, agents.producer, 60.0)
    assert message == {"op": "finished", "req": "queued", "reason": "lease"}


@pytest.mark.parametrize("agents", [{"lease_s": RENEWED_LEASE_S}], indirect=True)
def test_renew_keeps_an_unpulled_job_pinned_past_its_lease(agents: Agents) -> None:
    port = agents.producer.port
    assert renew("127.0.0.1", port, "nobody", secret=agents.secret) is False
    agents.serve("queued", [2])
    wait_pinned(port, "queued", agents.secret)
    # Renew for one and a half leases' time: the job must outlive its original lease.
    pinned, stop = time.monotonic(), threading.Event()
    while time.monotonic() - pinned < 1.5 * RENEWED_LEASE_S:
        assert renew("127.0.0.1", port, "queued", secret=agents.secret) is True
        stop.wait(0.1)
    assert agents.producer.channel.poll() == []  # no "finished" while renewed
    agents.pull("queued", [2], [3])
    assert next_message(agents.consumer)["ok"]
    assert next_message(agents.producer)["reason"] == "sent"
    # Once it is gone, renew says so; an unrenewed job still expires.
    assert renew("127.0.0.1", port, "queued", secret=agents.secret) is False
    agents.serve("orphan", [4])
    finished = next_message(agents.producer, 60.0)
    assert finished == {"op": "finished", "req": "orphan", "reason": "lease"}


def test_renew_needs_the_secret(agents: Agents) -> None:
    agents.serve("r", [0])
    with pytest.raises(AuthenticationFailed):
        renew("127.0.0.1", agents.producer.port, "r", secret=None)


def test_garbage_and_half_sent_huge_frames_leave_the_agent_small_and_working(
    agents: Agents,
) -> None:
    pid, port = agents.producer.process.pid, agents.producer.port
    agents.pull_is_correct("warm", [0, 1], [2, 3])  # first pull's buffers are in the baseline
    assert next_message(agents.producer)["reason"] == "sent"
    before = rss_bytes(pid)
    for n in range(1000):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            conn.sendall(os.urandom(1 + n % 64))
    held = []
    try:
        for n in range(100):
            conn = socket.create_connection(("127.0.0.1", port), timeout=10)
            held.append(conn)
            # Announce a huge frame (or one just under the handshake bound) and send part of it.
            size = 0xFFFFFFF0 if n % 2 else 1000
            conn.sendall(struct.pack("!I", size) + os.urandom(200))
        assert agents.producer.process.poll() is None
        assert rss_bytes(pid) - before < RSS_SLACK, (before, rss_bytes(pid))
        # Served while the garbage connections are still open:
        agents.pull_is_correct("after", [4, 5, 6], [7, 1, 0])
        assert next_message(agents.producer)["reason"] == "sent"
    finally:
        for conn in held:
            conn.close()
    assert agents.producer.process.poll() is None
    assert rss_bytes(pid) - before < RSS_SLACK


@pytest.mark.parametrize("agents", [{"max_connections": 8}], indirect=True)
def test_connections_over_the_cap_are_refused_and_served_again_after(agents: Agents) -> None:
    port = agents.producer.port
    held = [connect("127.0.0.1", port, agents.secret, 10) for _ in range(8)]
    try:
        with pytest.raises((OSError, AuthenticationFailed)):
            release("127.0.0.1", port, "x", secret=agents.secret)
    finally:
        for conn in held:
            conn.close()
    agents.serve("r", [0])
    # Slots come back as the held connections' threads notice the close; poll for one (a
    # generous deadline: on a loaded machine those threads may run late).
    deadline = time.monotonic() + 120
    while True:
        try:
            # True, or False when it overtook the job's registration (then it is remembered
            # and applied on arrival): either way "r" ends "released" below.
            release("127.0.0.1", port, "r", secret=agents.secret)
            break
        except (OSError, AuthenticationFailed):
            if time.monotonic() > deadline:
                pytest.fail("the agent never accepted connections again")
            threading.Event().wait(0.05)
    assert next_message(agents.producer)["reason"] == "released"


def test_an_idle_engine_with_1000_results_due_stalls_neither_pulls_nor_the_engine(
    agents: Agents,
) -> None:
    """The "engine" here is this test: it sends jobs but does not read the producer's results,
    as an idle vLLM engine takes no steps and reads nothing."""
    for n in range(1000):
        agents.serve(f"job-{n}", [n % 8])
    wait_pinned(agents.producer.port, "job-999", agents.secret)  # and so all before it
    for n in range(1000):  # each ends at once: 1,000 results the engine does not read
        assert release("127.0.0.1", agents.producer.port, f"job-{n}", secret=agents.secret)
    # Pulls are still served ...
    agents.pull_is_correct("live", [6, 7], [0, 1])
    # ... and the engine's own sends return although nobody reads the results.
    sent = threading.Event()

    def engine_step() -> None:
        for n in range(1000):
            agents.serve(f"more-{n}", [n % 8])
        sent.set()

    threading.Thread(target=engine_step, daemon=True).start()
    assert sent.wait(60), "the engine blocked sending jobs to its transfer process"
    # Every result arrives, in order, once the engine reads again.
    reasons = [next_message(agents.producer) for _ in range(1001)]
    assert [r["req"] for r in reasons[:1000]] == [f"job-{n}" for n in range(1000)]
    assert {r["reason"] for r in reasons[:1000]} == {"released"}
    assert reasons[1000] == {
        **reasons[1000],
        "req": "live",
        "reason": "sent",
    }
