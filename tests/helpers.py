"""Shared test helpers: refused addresses, the prepared default model, an in-process gateway
cluster."""

from __future__ import annotations

import asyncio
import functools
import json
import re
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing, asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

from gateway.config import GatewaySettings
from gateway.pool import WorkerPool
from gateway.render import Renderer, shared_renderer
from gateway.server import GatewayServer
from gateway.tokenizer import HfTokenizer
from pdserve.bench.fake_worker import FakeDecode, FakePrefill, start_worker
from pdserve.rpc.server import GrpcServer
from pdserve.settings import default_model_dir

MODEL_WAIT_S = 900.0
PORT_ATTEMPTS = 5  # fresh ports tried by ``on_fresh_port`` after a start that lost its port
# What a server says when the port it was told is taken (redis-server: "bind: Address already
# in use").
PORT_TAKEN = re.compile(r"in use|EADDRINUSE|cannot bind")

T = TypeVar("T")


# Sockets held for the whole test session; see ``dead_port``.
_HELD: list[socket.socket] = []


def dead_port() -> int:
    """A loopback port where connections are refused, for as long as the tests run: bound
    here and never listened on, so no other process can take it meanwhile. (Servers in the
    tests bind port 0 and report their port; nothing chooses a port and binds it later.)"""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    _HELD.append(sock)
    return int(sock.getsockname()[1])


def dead_address() -> str:
    return f"127.0.0.1:{dead_port()}"


def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    """Whether ``condition`` holds within ``timeout_s`` (a generous bound: only a hang
    reaches it), polled every 10 ms."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return condition()
        time.sleep(0.01)
    return True


class PortTaken(Exception):
    """A server could not bind the port it was told (another process took it first)."""


def on_fresh_port(start: Callable[[int], T], attempts: int = PORT_ATTEMPTS) -> T:
    """``start(port)`` on a free port; again on a fresh one while it raises ``PortTaken``.

    For a process that must be told its port before it binds it (redis-server cannot bind
    port 0 and report it): whatever chooses the port, another process may take it before the
    server binds it. Every other server in the tests binds port 0 and reports its port."""
    from pdserve.cluster.redis_server import free_port

    for attempt in range(attempts):
        try:
            return start(free_port())
        except PortTaken:
            if attempt + 1 == attempts:
                raise
    raise AssertionError("unreachable")


@contextmanager
def redis_process(
    argv: Callable[[int], list[str]], password: str | None = None, env: dict[str, str] | None = None
) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """The redis-server ``argv(port)`` starts, on a free port (``on_fresh_port``), once *it*
    answers (with ``password``: logging in as ``redis_server.USER``): (port, process)."""
    from pdserve.cluster.redis_server import server_pid

    def start(port: int) -> tuple[int, subprocess.Popen[bytes]]:
        args = argv(port)
        with tempfile.TemporaryFile() as log:
            process = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 30
            while server_pid(port, password) != process.pid:
                if process.poll() is not None or time.monotonic() > deadline:
                    stop_process(process)
                    log.seek(0)
                    out = log.read().decode(errors="replace")
                    if PORT_TAKEN.search(out):
                        raise PortTaken(out)
                    raise AssertionError(f"{args[:3]} did not start ({process.returncode}):\n{out}")
                time.sleep(0.05)
        return port, process

    port, process = on_fresh_port(start)
    try:
        yield port, process
    finally:
        stop_process(process)


def stop_process(process: subprocess.Popen[bytes], grace_s: float = 10) -> None:
    """Stops ``process`` if it runs: SIGTERM, and SIGKILL after ``grace_s``."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@functools.cache
def model_dir() -> str:
    """The prepared default model; waits while another process is still preparing it."""
    path = default_model_dir()
    deadline = time.monotonic() + MODEL_WAIT_S
    while not (path / "pdserve-manifest.json").exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"default model not prepared in {path}: run `pdserve model prepare`")
        time.sleep(2)
    return str(path)


@functools.cache
def tokenizer() -> HfTokenizer:
    return HfTokenizer(model_dir())


def cpu_engine_args(user: list[str], role: str = "") -> Any:
    """vLLM's parse of the arguments a CPU engine of ``role`` gets (none: the monolith):
    pdserve's defaults, then the user's, as ``pdserve.worker.engine`` orders them."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from pdserve.worker.engine import COMMON_DEFAULT_ARGS, cpu_default_args

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser(prog="t"))
    defaults = [*COMMON_DEFAULT_ARGS, *cpu_default_args(user, role)[0]]
    return parser.parse_args(["--model", "m", *defaults, *user])


def chat_ids(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """transformers' own rendering of a chat with the model's template (generation prompt
    added, no extra special tokens): the reference the ids the gateway sends must equal."""
    tok = tokenizer()._tok
    text = tok.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    return list(tok.encode(text, add_special_tokens=False))


@functools.cache
def renderer() -> Renderer:
    """vLLM's renderer of the default model with the gateway's default flags."""
    return shared_renderer(model_dir(), GatewaySettings().vllm_args(served_name()))


def served_name() -> str:
    return Path(model_dir()).name


class GatedDecode(FakeDecode):
    """A fake decode worker whose streams stop after ``free`` tokens until ``gate`` is set: a
    request stays in flight for as long as a test needs, however busy the machine (a delay
    ends it on its own, maybe before the test has done its part)."""

    def __init__(self, free: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.free = free
        self.gate = asyncio.Event()

    async def _decode(self, request: Any, context: Any) -> AsyncIterator[Any]:
        sent = 0
        async with aclosing(super()._decode(request, context)) as chunks:
            async for chunk in chunks:
                if sent >= self.free:
                    await self.gate.wait()
                sent += 1
                yield chunk


@dataclass
class Cluster:
    gateway: GatewayServer
    prefill: FakePrefill | None
    decode: FakeDecode | None
    servers: dict[str, GrpcServer]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.gateway.grpc_port}"

    def openai(self) -> Any:
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0)


@asynccontextmanager
async def gateway_cluster(
    *,
    prefill: FakePrefill | bool | None = True,
    decode: FakeDecode | bool | None = True,
    extra_prefill: list[str] | None = None,
    extra_decode: list[str] | None = None,
    **overrides: Any,
) -> AsyncIterator[Cluster]:
    """Fake workers on free ports plus a real gateway (HTTP and gRPC on free ports).

    ``True`` makes a default fake, ``None``/``False`` none; ``extra_*`` adds more addresses
    (e.g. ``dead_address()``).
    """
    p = FakePrefill() if prefill is True else prefill or None
    d = FakeDecode() if decode is True else decode or None
    servers: dict[str, GrpcServer] = {}
    for name, fake in (("prefill", p), ("decode", d)):
        if fake is not None:
            servers[name] = await start_worker(fake)
    settings = GatewaySettings(
        http_host="127.0.0.1",
        http_port=0,
        grpc_port=0,
        model=model_dir(),
        prefill_workers=_addresses(servers, "prefill") + (extra_prefill or []),
        decode_workers=_addresses(servers, "decode") + (extra_decode or []),
        health_interval_s=overrides.pop("health_interval_s", 30.0),
        control_timeout_s=overrides.pop("control_timeout_s", 1.0),
        **overrides,
    )
    gateway = GatewayServer(settings, tokenizer=tokenizer())
    await gateway.start()
    try:
        fakes = {*_addresses(servers, "prefill"), *_addresses(servers, "decode")}
        await _until_checked(gateway.pool, fakes)
        yield Cluster(gateway, p, d, servers)
    finally:
        await gateway.stop(grace_s=0)
        for server in servers.values():
            await server.stop(0)


async def _until_checked(pool: WorkerPool, fakes: set[str], timeout_s: float = 30.0) -> None:
    """Health-checks the pool again while a fake worker's check ran out of time. A fake
    answers at once, so that happens only on a loaded machine, where the helper's 1 s
    ``control_timeout_s`` can pass before a fresh channel's first answer; its 30 s health
    interval would then leave the worker unhealthy for the whole test."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = [*pool.prefill, *pool.decode]
        if not any(w.address in fakes and "DEADLINE_EXCEEDED" in w.last_error for w in workers):
            return
        await pool.refresh()


def _addresses(servers: dict[str, GrpcServer], role: str) -> list[str]:
    return [f"127.0.0.1:{servers[role].port}"] if role in servers else []


REQUESTS = "pdserve_gateway_requests_total"  # the gateway's finished requests, by label


def counted(metrics: str, series: str, **labels: str) -> float:
    """The sum of the samples in a /metrics text whose series is ``series``: a metric's name
    (every label set of it) or a name with its labels. With ``labels``: the samples named
    ``series`` whose labels include these (whatever other labels they carry). 0 when there is
    none yet."""
    if "{" in series and not series.endswith("}"):
        raise ValueError(f"{series!r}: name the labels in full or pass them as keywords")
    if labels:
        from prometheus_client.parser import text_string_to_metric_families

        return sum(
            sample.value
            for family in text_string_to_metric_families(metrics)
            for sample in family.samples
            if sample.name == series and labels.items() <= sample.labels.items()
        )
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith(series) and line[len(series) : len(series) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def metrics_text(base_url: str) -> str:
    """The gateway's /metrics page."""
    async with httpx.AsyncClient(base_url=base_url) as http:
        return (await http.get("/metrics")).text


def parse_sse(body: str) -> list[Any]:
    """The events of an SSE body, each ``data:`` payload JSON-decoded ("[DONE]" kept as is).

    Asserts the framing: every event is one ``data: ...`` line followed by a blank line."""
    assert body.endswith("\n\n"), body[-50:]
    events = []
    for block in body[:-2].split("\n\n"):
        assert block.startswith("data: ") and "\n" not in block, block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def wait_pinned(port: int, req: str, secret: bytes | None = None, timeout_s: float = 60.0) -> None:
    """Wait until the producer agent on ``port`` holds ``req``'s blocks. A job comes in on
    the agent's control channel, a release or renewal over TCP, and nothing orders the two:
    a test that releases right after serving may overtake the job. Renewing is the probe (it
    only pushes the lease out)."""
    from kv_transfer.client import renew

    deadline = time.monotonic() + timeout_s
    while not renew("127.0.0.1", port, req, secret=secret):
        assert time.monotonic() < deadline, f"the agent never registered {req}"
        time.sleep(0.01)
