"""The light client of ``pdserve bench gateway``: many concurrent token streams on one event
loop, each timed on arrival (TTFT = request sent -> first token; ITL = gap between tokens).

Three paths, one function each: straight to the decode worker's gRPC ``Decode`` stream
(``decode_service.client``), through the gateway's OpenAI HTTP API (streaming chat, httpx),
and through its gRPC API (``pdserve.cli.client``). Every path asks for the same number of tokens
from the same fake decode worker, so the difference is what the gateway adds.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import httpx

from decode_service.client import DecodeClient
from pdserve.cli.client import GatewayCallError, GatewayClient, sampling
from pdserve.rpc.client import RpcCallError

# One stream: yields once per token received.
Stream = Callable[[int], AsyncIterator[None]]


@dataclass
class PathResult:
    """Samples of one path over all rounds (seconds)."""

    requests: int = 0
    failed: int = 0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


@dataclass
class Paths:
    """The clients of one run, made once (connections are reused across rounds)."""

    decode_address: str
    gateway_grpc: str
    gateway_http: str
    model: str
    prompts: Sequence[Sequence[dict[str, str]]]
    prompt_ids: Sequence[Sequence[int]]
    timeout_s: float = 600.0
    _direct: DecodeClient | None = None
    _grpc: GatewayClient | None = None
    _http: httpx.AsyncClient | None = None

    async def open(self, streams: int) -> None:
        self._direct = DecodeClient(self.decode_address, default_timeout_s=self.timeout_s)
        self._grpc = GatewayClient(self.gateway_grpc, timeout_s=self.timeout_s)
        await self.reopen_http(streams)

    async def reopen_http(self, streams: int) -> None:
        """Fresh HTTP connections, made before each HTTP phase: the gateway (uvicorn) closes
        keep-alive connections idle for 5 s, as they are while the other paths run. (This did
        not end the rare ReadError seen in saturated HTTP phases; its cause is not known.)"""
        if self._http is not None:
            await self._http.aclose()
        limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
        timeout = httpx.Timeout(self.timeout_s, connect=30.0)
        self._http = httpx.AsyncClient(base_url=self.gateway_http, limits=limits, timeout=timeout)

    async def close(self) -> None:
        for client in (self._direct, self._grpc):
            if client is not None:
                await client.close()
        if self._http is not None:
            await self._http.aclose()

    def streams(self, max_tokens: int) -> dict[str, Stream]:
        """Path name -> stream(i): the i-th stream's request with ``max_tokens`` tokens."""
        return {
            "direct_grpc": lambda i: self._direct_stream(i, max_tokens),
            "gateway_http": lambda i: self._http_stream(i, max_tokens),
            "gateway_grpc": lambda i: self._grpc_stream(i, max_tokens),
        }

    async def _direct_stream(self, i: int, max_tokens: int) -> AsyncIterator[None]:
        assert self._direct is not None
        params = sampling(max_tokens=max_tokens, temperature=0.0)
        ids = self.prompt_ids[i % len(self.prompt_ids)]
        async for chunk in self._direct.decode(uuid.uuid4().hex, ids, params):
            for _ in chunk.token_ids:
                yield

    async def _grpc_stream(self, i: int, max_tokens: int) -> AsyncIterator[None]:
        assert self._grpc is not None
        messages = self.prompts[i % len(self.prompts)]
        async for piece in self._grpc.generate(
            messages=messages, max_tokens=max_tokens, temperature=0.0
        ):
            for _ in piece.token_ids:
                yield

    async def _http_stream(self, i: int, max_tokens: int) -> AsyncIterator[None]:
        assert self._http is not None
        body = {
            "model": self.model, "messages": list(self.prompts[i % len(self.prompts)]),
            "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
        }  # fmt: skip
        async with self._http.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(
                    f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                )
            # One SSE event per token; the role-only opening and the finish carry no content.
            # Raw bytes, split by hand: httpx's line iterator costs the client more CPU.
            pending = b""
            async for data in response.aiter_raw():
                *events, pending = (pending + data).split(b"\n\n")
                for event in events:
                    if b'"content":"' in event and b'"content":""' not in event:
                        yield
                    elif event.startswith(b'data: {"error"'):
                        raise RuntimeError(event[6:200].decode(errors="replace"))


async def _timed(stream: Stream, i: int, expect: int, out: PathResult) -> None:
    sent = last = time.perf_counter()
    n = 0
    try:
        async for _ in stream(i):
            now = time.perf_counter()
            if n == 0:
                out.ttft.append(now - sent)
            else:
                out.itl.append(now - last)
            last, n = now, n + 1
        if n != expect:
            raise RuntimeError(f"{n} tokens instead of {expect}")
    except (RpcCallError, GatewayCallError, httpx.HTTPError, RuntimeError, OSError) as err:
        out.failed += 1
        if len(out.errors) < 5:
            out.errors.append(f"{type(err).__name__}: {err}")
    finally:
        out.requests += 1
        out.tokens += n


async def run_phase(
    stream: Stream,
    streams: int,
    tokens: int,
    requests: int,
    spread_s: float,
    out: PathResult,
    progress: Callable[[int], None] | None = None,
) -> float:
    """A closed loop of ``streams`` slots, each running one unmeasured request and then
    ``requests`` measured ones back to back. Slots start evenly over ``spread_s`` (about one
    stream's duration), so the measured requests arrive at a steady rate with ``streams``
    streams open, not as one burst. Returns the phase's wall time."""
    started = time.perf_counter()

    async def slot(i: int) -> None:
        await asyncio.sleep(spread_s * i / streams)
        await _timed(stream, i, tokens, PathResult())  # the ramp: concurrency still rising
        for _ in range(requests):
            await _timed(stream, i, tokens, out)

    tasks = [asyncio.create_task(slot(i)) for i in range(streams)]
    if progress is not None:
        watcher = asyncio.create_task(_watch(tasks, progress))
    await asyncio.gather(*tasks)
    if progress is not None:
        watcher.cancel()
    return time.perf_counter() - started


async def _watch(tasks: list[asyncio.Task[None]], progress: Callable[[int], None]) -> None:
    while True:
        await asyncio.sleep(1.0)
        progress(sum(t.done() for t in tasks))
