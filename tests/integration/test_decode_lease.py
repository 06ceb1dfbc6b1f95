"""A decode worker keeps the prefill worker's lease on a queued hand-off alive, and stops.

The decode service (``decode_service.service.DecodeService.decode``, as its gRPC server runs
it) is given a sealed hand-off of a job that a real producer transfer process
(``kv_transfer.agent``) holds under a short lease; the engine is a stand-in that keeps the
request queued until the test lets it go. Time is read from the agent itself: jobs served
next to the hand-off and never renewed expire when a lease has passed, and every end of a job
is the agent's own report on its control channel (``finished`` with reason ``lease``, what the
worker counts as an expired lease). No assertion depends on the machine's speed: renewals come
every third of the lease.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from decode_service.config import DecodeSettings
from decode_service.service import DecodeService
from kv_transfer import bench, seal
from kv_transfer.auth import load_secret, new_secret
from kv_transfer.handle import AgentHandle
from protos.v1 import common_pb2
from tests.helpers import wait_pinned

LEASE_S = 3.0  # renewed every second: two seconds of headroom for a busy machine
PROMPT = list(range(300, 340))
GEO = bench.Geometry(blocks=4, block_bytes=4096)
WAIT_S = 60.0  # the bound on any one wait below (a lease is 3 s)


class QueuedEngine:
    """An ``AsyncLLM`` stand-in whose request waits in its queue until ``admit`` is set, then
    finishes with one token."""

    def __init__(self) -> None:
        self.errored = False
        self.queued = asyncio.Event()
        self.admit = asyncio.Event()

    async def generate(
        self, prompt: Any, sampling: Any, request_id: str, **kw: Any
    ) -> AsyncIterator[Any]:
        self.queued.set()
        await self.admit.wait()
        completion = SimpleNamespace(token_ids=[7], text="x", logprobs=None,
                                     finish_reason="length", stop_reason=None)  # fmt: skip
        yield SimpleNamespace(outputs=[completion], finished=True, kv_transfer_params=None,
                              num_cached_tokens=0, prompt_logprobs=None, metrics=None)  # fmt: skip

    async def abort(self, request_id: str) -> None:
        pass


class Producer:
    """A prefill worker's transfer process under a ``LEASE_S`` lease, and its reports."""

    def __init__(self, secret_file: Path) -> None:
        self.secret = load_secret(secret_file)
        self.fd, _, layout = bench.make_region(GEO, 8, seed=1)
        self.agent: AgentHandle = bench.start_agent(
            "producer", self.fd, layout, secret_file=str(secret_file), lease_s=LEASE_S
        )
        self.ended: dict[str, str] = {}  # request -> why its job ended, as the agent reported

    def serve(self, req: str, block: int) -> None:
        self.agent.channel.send({"op": "serve", "req": req, "blocks": [block]})

    def _read_until_ended(self, req: str) -> None:
        sock = self.agent.channel.sock
        sock.settimeout(WAIT_S)
        try:
            while req not in self.ended:
                try:
                    message = self.agent.channel.recv()
                except TimeoutError:
                    raise AssertionError(f"no end of {req} in {WAIT_S:.0f} s") from None
                assert message is not None, "the agent closed its control channel"
                if message.get("op") == "finished":
                    self.ended[str(message["req"])] = str(message["reason"])
        finally:
            sock.settimeout(None)

    async def ended_by(self, req: str) -> str:
        """Why ``req``'s job ended; waits (off the event loop) for the agent's report."""
        await asyncio.to_thread(self._read_until_ended, req)
        return self.ended[req]

    def close(self) -> None:
        self.agent.stop()
        os.close(self.fd)


@pytest.fixture
def producer(tmp_path: Path) -> Iterator[Producer]:
    secret_file = tmp_path / "secret"
    secret_file.write_text(new_secret() + "\n")
    secret_file.chmod(0o600)
    p = Producer(secret_file)
    yield p
    p.close()


def handoff(producer: Producer, req: str) -> dict[str, Any]:
    """The hand-off a prefill worker's connector gives for ``req`` (sealed, tied to PROMPT)."""
    params = {
        "remote_engine_id": "prefill-0",
        "remote_request_id": req,
        "remote_host": "127.0.0.1",
        "remote_port": producer.agent.port,
        "remote_block_ids": [2],
        "remote_num_tokens": len(PROMPT),
        seal.DIGEST: seal.prompt_digest(PROMPT),
        seal.EPOCH: "epoch-1",
    }
    return seal.seal(params, producer.secret)


def decode_service(producer: Producer, engine: QueuedEngine) -> DecodeService:
    settings = DecodeSettings(kv_connector="pdserve", kv_lease_s=LEASE_S)
    service = DecodeService(engine, settings, SimpleNamespace(max_model_len=4096))
    service.secret = producer.secret  # the process-wide secret is read once, by whichever test
    return service


async def more_than_two_leases(producer: Producer) -> None:
    """Returns after two leases, one after the other, by the agent's own clock: a job served
    now and never renewed has expired, then another served after that one's end has too."""
    for n in (1, 2):
        producer.serve(f"unrenewed-{n}", 4 + n)
        assert await producer.ended_by(f"unrenewed-{n}") == "lease"


@pytest.mark.parametrize("ending", ["first_output", "client_gone"])
async def test_a_queued_handoff_is_kept_past_its_lease_until_the_request_ends(
    producer: Producer, ending: str
) -> None:
    """The hand-off's job outlives two leases while its request waits in the decode engine's
    queue; when the request ends (its first output comes, or its caller goes away) the
    renewals stop and the agent expires the job one lease later."""
    engine = QueuedEngine()
    service = decode_service(producer, engine)
    params = common_pb2.SamplingParams(max_tokens=1)
    # A request without a hand-off first: the service imports vLLM's request types on its
    # first request, which would stall the event loop (and the renewals) for seconds here.
    engine.admit.set()
    assert [e.finish_reason async for e in service.decode("warm", PROMPT, params, None)] == [
        "length"
    ]
    engine.admit.clear()
    producer.serve("queued", 2)
    wait_pinned(producer.agent.port, "queued", producer.secret)

    async def run() -> list[Any]:
        return [e async for e in service.decode("d-1", PROMPT, params, handoff(producer, "queued"))]

    request = asyncio.ensure_future(run())
    await asyncio.wait_for(engine.queued.wait(), WAIT_S)
    await more_than_two_leases(producer)
    assert "queued" not in producer.ended, "the lease of a queued hand-off ran out"
    if ending == "first_output":
        engine.admit.set()
        (event,) = await asyncio.wait_for(request, WAIT_S)
        assert event.finish_reason == "length"
    else:
        request.cancel()
        await asyncio.wait({request}, timeout=WAIT_S)
        assert request.cancelled()
    assert service.active == set() and service.load.in_flight == 0
    # Nothing pulls or releases the job here: only its lease can end it, once renewals stop.
    assert await producer.ended_by("queued") == "lease"
