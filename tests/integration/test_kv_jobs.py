"""A job exists once, on real transfer processes: numbered announcements, pulls of ended jobs,
contiguous pulls, and announcements over the KV port only from the worker's own engine.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kv_transfer import bench
from kv_transfer.announce import Announcer
from kv_transfer.auth import connect
from kv_transfer.registry import serve_mac
from kv_transfer.scheduler import new_owner
from kv_transfer.wire import ConnectionClosed, send_frame
from tests.integration.test_kv_security import Agents, next_message, write_secret


class Stand(Agents):
    """Agents whose producer knows its engine (``owner``), with numbered jobs."""

    def __init__(self, secret_file: Path, **producer: Any) -> None:
        super().__init__(secret_file, **producer)
        self.owner = new_owner()
        self.producer.channel.send({"op": "owner", "epoch": self.owner[0], "key": self.owner[1]})
        assert next_message(self.producer) == {"op": "owner", "ok": True}

    def serve_seq(self, req: str, seq: int, blocks: list[int]) -> None:
        """The worker's (step path) copy of job number ``seq``."""
        self.producer.channel.send({"op": "serve", "req": req, "blocks": blocks, "seq": seq})

    def pull_seq(
        self, req: str, remote: list[int], local: list[int], seq: int, epoch: str = ""
    ) -> dict[str, Any]:
        self.consumer.channel.send(
            {"op": "pull", "req": req, "host": "127.0.0.1", "port": self.producer.port,
             "remote_req": req, "remote_blocks": remote, "local_blocks": local,
             "seq": seq, "epoch": epoch or self.owner[0]}
        )  # fmt: skip
        return next_message(self.consumer)

    def digest_equal(self, remote: list[int], local: list[int]) -> bool:
        theirs = bench.blocks_digest(self.p_mem, self.p_layout, remote)
        return theirs == bench.blocks_digest(self.c_mem, self.c_layout, local)

    def announcer(self) -> Announcer:
        return Announcer("127.0.0.1", [self.producer.port], self.secret, self.owner)


@pytest.fixture
def stand(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Stand]:
    s = Stand(write_secret(tmp_path / "secret"), **getattr(request, "param", {}))
    yield s
    s.close()


# How long a pull waits for its job to be registered: a pull for a job that ended fails at
# once, which these tests tell from waiting with half of it (a busy machine's headroom).
REGISTER_WAIT_S = 10.0


@pytest.mark.parametrize(
    "stand", [{"lease_s": 0.5, "register_wait_s": REGISTER_WAIT_S}], indirect=True
)
def test_a_late_duplicate_after_10000_ended_jobs_does_not_register(stand: Stand) -> None:
    """Job 1 is announced over the KV port and pulled; 10,000 later jobs end (their leases run
    out); then job 1's late copies arrive, through the worker and over the KV port again: the
    job must not come back (its blocks belong to other requests by now)."""
    announcer = stand.announcer()
    try:
        announcer.announce("first", 1, [5, 1], "")
        assert stand.pull_seq("first", [5, 1], [2, 6], seq=1)["ok"]
        assert next_message(stand.producer)["reason"] == "sent"
        for seq in range(2, 10_002):
            stand.serve_seq(f"other-{seq}", seq, [3])
        ended = [next_message(stand.producer, 60.0) for _ in range(10_000)]
        assert {m["reason"] for m in ended} == {"lease"}
        stand.serve_seq("first", 1, [5, 1])  # the step path's copy, very late
        announcer.announce("first", 1, [5, 1], "")  # and the announcer's, again
        time.sleep(1.5)  # three leases: a registered copy would have expired and reported
        assert stand.producer.channel.poll() == []
        started = time.monotonic()
        done = stand.pull_seq("first", [5, 1], [2, 6], seq=1)
        assert not done["ok"] and "no longer held" in done["error"], done
        assert time.monotonic() - started < REGISTER_WAIT_S / 2, "it waited for the job"
    finally:
        announcer.close()


@pytest.mark.parametrize("stand", [{"register_wait_s": REGISTER_WAIT_S}], indirect=True)
def test_a_pull_for_an_ended_job_fails_at_once(stand: Stand) -> None:
    stand.serve_seq("r", 1, [1, 2])
    assert stand.pull_seq("r", [1, 2], [3, 4], seq=1)["ok"]
    assert next_message(stand.producer)["reason"] == "sent"
    for epoch in ("", "an-earlier-start"):  # the same job again; a hand-off of a past start
        started = time.monotonic()
        done = stand.pull_seq("r", [1, 2], [3, 4], seq=1, epoch=epoch)
        assert time.monotonic() - started < REGISTER_WAIT_S / 2, done  # it did not wait
        assert not done["ok"], done
        assert "no longer held" in done["error"] or "earlier start" in done["error"]
    assert "earlier start" in done["error"]
    # A job not registered yet is still waited for (it may be one engine step away).
    stand.consumer.channel.send(
        {"op": "pull", "req": "later", "host": "127.0.0.1", "port": stand.producer.port,
         "remote_req": "later", "remote_blocks": [5], "local_blocks": [5], "seq": 2,
         "epoch": stand.owner[0]}
    )  # fmt: skip
    time.sleep(0.5)
    stand.serve_seq("later", 2, [5])
    assert next_message(stand.consumer)["ok"]


def test_a_non_contiguous_pull_is_refused(stand: Stand) -> None:
    for seq, (req, remote) in enumerate(
        [("gap", [1, 3]), ("reordered", [2, 1]), ("twice", [2, 2])], start=1
    ):
        stand.serve_seq(req, seq, [1, 2, 3, 4])
        done = stand.pull_seq(req, remote, [5, 6], seq=seq)
        assert not done["ok"] and "contiguous run" in done["error"], done
        assert next_message(stand.producer)["reason"] == "released"
    stand.serve_seq("tail", 4, [1, 2, 3, 4])
    assert stand.pull_seq("tail", [3, 4], [5, 6], seq=4)["ok"]  # what a prefix hit leaves
    assert stand.digest_equal([3, 4], [5, 6])


@pytest.mark.parametrize("stand", [{"register_wait_s": 0.5}], indirect=True)
def test_a_serve_from_a_peer_that_is_not_the_workers_engine_is_refused(stand: Stand) -> None:
    """A holder of the deployment secret (another worker) cannot register jobs on this agent:
    unsigned, signed with its own key, or signed for another epoch, the announcement is
    refused and its connection closed; the engine's own announcer still registers jobs."""
    mine = new_owner()
    forged: list[dict[str, Any]] = []
    for epoch, key in ((stand.owner[0], ""), (stand.owner[0], mine[1]), mine):
        signature = serve_mac(key, epoch, "evil", 1, [1], "", "") if key else None
        forged.append({"op": "serve", "req": "evil", "seq": 1, "epoch": epoch,
                       "blocks": [1], "digest": "", "key": "", "mac": signature})  # fmt: skip
    for message in forged:
        conn = connect("127.0.0.1", stand.producer.port, stand.secret, 5.0)
        try:
            send_frame(conn, message)
            conn.settimeout(5.0)
            with pytest.raises((ConnectionClosed, ConnectionResetError)):
                if conn.recv(1) == b"":
                    raise ConnectionClosed("closed by the agent")
        finally:
            conn.close()
    done = stand.pull_seq("evil", [1], [2], seq=1)
    assert not done["ok"] and "holds no KV blocks" in done["error"], done
    announcer = stand.announcer()
    try:
        announcer.announce("good", 1, [1], "")
        assert stand.pull_seq("good", [1], [2], seq=1)["ok"]
    finally:
        announcer.close()


def test_a_peer_that_is_not_the_engine_is_refused_even_before_the_engine_key(
    tmp_path: Path,
) -> None:
    """Before the worker has handed over its engine's key, no announcement over the KV port
    registers anything (the step path does it, one engine step later)."""
    agents = Agents(write_secret(tmp_path / "secret"), register_wait_s=0.5)
    try:
        conn = connect("127.0.0.1", agents.producer.port, agents.secret, 5.0)
        with conn:
            send_frame(conn, {"op": "serve", "req": "x", "seq": 1, "epoch": "e", "blocks": [1],
                              "digest": "", "key": "", "mac": "0" * 64})  # fmt: skip
            conn.shutdown(socket.SHUT_WR)
        agents.pull("x", [1], [2])
        done = next_message(agents.consumer)
        assert not done["ok"] and "holds no KV blocks" in done["error"], done
    finally:
        agents.close()
