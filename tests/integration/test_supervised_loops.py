"""Each long-lived loop of the KV agent, the worker's index link and the gateway, killed once
(an exception injected into its body), keeps working afterwards or takes its process down
loudly (``pdserve.runtime.supervise``): a pull is served after the accept loop died, a lease
still expires after the lease loop died, the KV event sink skips a malformed frame and, after
a crash, rewrites the index and goes on; a gateway whose HTTP server stops unasked exits."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Literal

import msgspec
import pytest

from kv_transfer import bench
from kv_transfer.agent_context import AgentConfig, Reporter, map_regions
from kv_transfer.handle import AgentHandle
from kv_transfer.producer import Producer
from kv_transfer.wire import LineChannel
from pdserve.cluster.redis_server import RedisServer
from pdserve.kvindex.redis_store import RedisStore
from pdserve.runtime import supervise
from pdserve.worker.config import WorkerSettings
from pdserve.worker.engine import EngineInfo
from pdserve.worker.registration import IndexLink, Load
from tests.helpers import model_dir

GEO = bench.Geometry(blocks=4, block_bytes=4096)
ROOT = Path(__file__).resolve().parents[2]  # where ``tests.helpers`` imports from
WAIT_S = 15.0  # far above what any step takes: only a dead loop reaches it
M, W = "model", "prefill-0"


class Boom(RuntimeError):
    pass


def fail_once(real: Any) -> Any:
    """``real`` that raises ``Boom`` on its first call only."""
    calls = {"n": 0}

    def call(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise Boom("injected")
        return real(*args, **kwargs)

    return call


# ---- the KV agent's accept and lease loops -------------------------------------------------
class LocalProducer:
    """A producer agent in this process (so that its loops can be broken), serving a real
    consumer transfer process; its results come back on ``results``."""

    def __init__(self, **settings: Any) -> None:
        self.fd, self.mem, self.layout = bench.make_region(GEO, 8, seed=1)
        config = AgentConfig(
            role="producer", layout=self.layout, region_fds=(os.dup(self.fd),),
            compat={"bench": "1"}, bind_host="127.0.0.1", **settings,
        )  # fmt: skip
        ours, theirs = socket.socketpair()
        self.results = LineChannel(ours)
        self.reporter = Reporter(LineChannel(theirs))
        self.agent = Producer(config, map_regions(config), self.reporter)

    def next_result(self) -> dict[str, Any]:
        self.results.sock.settimeout(WAIT_S)
        message = self.results.recv()
        assert message is not None
        return message

    def close(self) -> None:
        self.agent.close()
        self.reporter.channel.close_writer()
        self.results.sock.close()
        os.close(self.fd)


@pytest.fixture
def consumer() -> Iterator[tuple[AgentHandle, Any, Any]]:
    fd, mem, layout = bench.make_region(GEO, 8, seed=2)
    agent = bench.start_agent("consumer", fd, layout)
    yield agent, mem, layout
    agent.stop()
    os.close(fd)


def pull(consumer: AgentHandle, port: int, req: str, remote: list[int], local: list[int]) -> Any:
    message = {"op": "pull", "req": req, "host": "127.0.0.1", "port": port, "remote_req": req}
    consumer.channel.send({**message, "remote_blocks": remote, "local_blocks": local})
    consumer.channel.sock.settimeout(WAIT_S)
    done = consumer.channel.recv()
    consumer.channel.sock.settimeout(None)
    assert done is not None and done["op"] == "done"
    return done


def test_a_pull_is_served_after_the_accept_loop_died(consumer: Any) -> None:
    agent, c_mem, c_layout = consumer
    producer = LocalProducer()
    before = supervise.restarts["kv-accept"]
    try:
        gate = producer.agent.gate
        gate.enter = fail_once(gate.enter)  # type: ignore[method-assign]
        producer.agent.handle({"op": "serve", "req": "r1", "blocks": [1]})
        producer.agent.handle({"op": "serve", "req": "r2", "blocks": [5, 6]})
        pull(agent, producer.agent.port, "r1", [1], [0])  # its connection met the failure
        done = pull(agent, producer.agent.port, "r2", [5, 6], [2, 3])
        assert done["ok"], done
        assert supervise.restarts["kv-accept"] == before + 1
        src = bench.blocks_digest(producer.mem, producer.layout, [5, 6])
        assert bench.blocks_digest(c_mem, c_layout, [2, 3]) == src
    finally:
        producer.close()


def test_a_lease_still_expires_after_the_lease_loop_died() -> None:
    producer = LocalProducer(lease_s=0.3)
    before = supervise.restarts["kv-lease"]
    try:
        producer.agent._finish = fail_once(producer.agent._finish)  # type: ignore[method-assign]
        producer.agent.handle({"op": "serve", "req": "orphan", "blocks": [0]})
        assert producer.next_result() == {"op": "finished", "req": "orphan", "reason": "lease"}
        assert supervise.restarts["kv-lease"] == before + 1
    finally:
        producer.close()


# ---- the worker's KV event sink and heartbeat ------------------------------------------------
def stored(*hashes: int) -> Any:
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[],
                       block_size=128, lora_id=None, medium="GPU", lora_name=None)  # fmt: skip


class NotAStep(msgspec.Struct):
    """Published like a step, but not one: its payload does not decode as a ``KVEventBatch``."""

    data_parallel_rank: int | None = None
    junk: str = "not a step of KV events"


class Settings(WorkerSettings):
    @property
    def role(self) -> Literal["prefill", "decode"]:
        return "prefill"


class Linked:
    """A worker's index link (``IndexLink``) fed by vLLM's own KV event publisher."""

    def __init__(self, redis_url: str) -> None:
        from vllm.distributed.kv_events import ZmqEventPublisher

        from pdserve.worker.kv_events import events_config

        self.link = IndexLink(Settings(redis_url=redis_url, worker_id=W), Load())
        config = events_config(self.link.endpoints)
        self.publisher = ZmqEventPublisher(
            0, endpoint=config["endpoint"], replay_endpoint=config["replay_endpoint"],
            topic=config["topic"],
        )  # fmt: skip
        self.store = RedisStore(redis_url, timeout_s=0.5)

    def step(self, *events: Any) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        self.publisher.publish(KVEventBatch(ts=0.0, events=list(events)))

    async def indexed(self, hashes: list[int]) -> None:
        """Wait until the index holds ``hashes`` as this worker's prefix."""
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while True:
            found = (await self.store.longest_prefixes(M, hashes, [W]))[W]
            if found == len(hashes):
                return
            assert asyncio.get_running_loop().time() < deadline, f"{hashes}: {found} indexed"
            await asyncio.sleep(0.05)


@pytest.fixture
async def linked() -> AsyncIterator[Linked]:
    with RedisServer() as server:
        linked = Linked(server.url)
        info = EngineInfo(model="m", served_model_name=M, block_size=128, max_model_len=2048,
                          num_kv_blocks=1000, dtype="float32", kv_connector="PdserveConnector",
                          kv_compat={})  # fmt: skip
        await linked.link.start(info, grpc_port=1234)
        try:
            yield linked
        finally:
            await linked.link.stop()
            await linked.store.close()
            linked.publisher.shutdown()


async def test_the_sink_skips_a_malformed_frame_and_goes_on(linked: Linked) -> None:
    linked.step(stored(5))
    await linked.indexed([5])
    linked.publisher.publish(NotAStep())  # type: ignore[arg-type]
    linked.step(stored(6))
    await linked.indexed([5, 6])
    assert linked.link.sink is not None and linked.link.sink.malformed == 1


async def test_the_sink_restarts_after_a_crash_and_rewrites_the_index(linked: Linked) -> None:
    sink = linked.link.sink
    assert sink is not None
    before = supervise.restarts["kv-event-sink"]
    linked.step(stored(5))
    await linked.indexed([5])
    rewrites = sink.rewrites
    sink.index.apply = fail_once(sink.index.apply)  # type: ignore[method-assign]
    linked.step(stored(6))  # the sink dies applying it
    await linked.indexed([5, 6])  # rewritten from the sink's copy after its restart
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while sink.rewrites == rewrites:  # Redis may answer before the sink has counted it
        assert asyncio.get_running_loop().time() < deadline, "no rewrite after the restart"
        await asyncio.sleep(0.05)
    assert supervise.restarts["kv-event-sink"] == before + 1 and sink.rewrites == rewrites + 1
    linked.step(stored(7))  # and it follows the engine again
    await linked.indexed([5, 6, 7])


async def test_the_heartbeat_restarts_after_a_crash(linked: Linked) -> None:
    before = supervise.restarts["worker-heartbeat"]
    store = linked.link.store
    announced = asyncio.Event()
    real = store.announce

    async def announce(*args: Any, **kwargs: Any) -> None:
        await real(*args, **kwargs)
        announced.set()

    store.announce = fail_once(announce)  # type: ignore[method-assign]
    await asyncio.wait_for(announced.wait(), WAIT_S)
    assert supervise.restarts["worker-heartbeat"] == before + 1


# ---- the gateway's HTTP server ---------------------------------------------------------------
def test_a_gateway_whose_http_server_stops_unasked_exits_loudly() -> None:
    """uvicorn cannot be restarted on the socket it closed: the gateway exits (``pdserve up``
    restarts it) instead of living on with gRPC only."""
    script = f"""
        import asyncio
        from gateway.config import GatewaySettings
        from gateway.server import GatewayServer
        from tests.helpers import tokenizer
        async def main():
            settings = GatewaySettings(http_host="127.0.0.1", http_port=0, grpc_port=0,
                                       model={model_dir()!r}, control_timeout_s=0.5)
            gateway = GatewayServer(settings, tokenizer=tokenizer())
            await gateway.start()
            async def broken(counter):
                raise RuntimeError("uvicorn main loop broke")
            gateway._http.on_tick = broken
            await asyncio.sleep(60)
            print("still alive")
        asyncio.run(main())
        """
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == supervise.EXIT_CODE, result.stderr[-3000:]
    assert "still alive" not in result.stdout
    assert "gateway-http" in result.stderr and "uvicorn main loop broke" in result.stderr
