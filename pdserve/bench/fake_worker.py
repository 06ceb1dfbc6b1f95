"""Scripted fake prefill and decode workers (real grpc.aio servers, no engine).

For gateway tests and gateway load benchmarks only (DESIGN.md: never a substitute for real
engines): they speak the worker protos exactly and record what they received, so a test can
check token parity, the KV hand-off, request ids, aborts and cancellation.

``python -m pdserve.bench.fake_worker --tokens 64 --interval-ms 50`` serves one of each on free
loopback ports, prints ``{"prefill": PORT, "decode": PORT}`` as one JSON line and runs until
SIGINT/SIGTERM (``pdserve bench gateway`` runs them so). That process traces as a real worker
does when the OTEL_* environment turns tracing on (``pdserve.telemetry.tracing``): one server span
per Prefill and Decode call (``rpc_span``), service.name ``<prefix>-fake-workers``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import sys
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import grpc

from pdserve.rpc.server import GrpcServer, stop_event_on_signals
from pdserve.runtime.heap import freeze_startup_objects
from pdserve.settings import default_model_dir
from pdserve.telemetry import tracing
from pdserve.worker.server import DECODE_SERVICE, PREFILL_SERVICE, rpc_span
from protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc

# (token id, text) of the scripted answer: "Hello, world!"
DEFAULT_PIECES: list[tuple[int, str]] = [(19556, "Hello"), (28, ","), (905, " world"), (17, "!")]
KV_BYTES_PER_TOKEN = 1000
# The engine times the fakes report (seconds): what a vLLM engine's request statistics say.
PREFILL_ENGINE = common_pb2.EngineTimes(queue_seconds=0.001, prefill_seconds=0.02)
DECODE_ENGINE = common_pb2.EngineTimes(
    queue_seconds=0.005, prefill_seconds=0.003, decode_seconds=0.1
)


def pieces(n: int) -> list[tuple[int, str]]:
    """``n`` scripted tokens: ``DEFAULT_PIECES`` over and over."""
    return list(itertools.islice(itertools.cycle(DEFAULT_PIECES), n))


def _span(traced: bool, context: Any, method: str, request_id: str) -> Any:
    """A real worker's server span when ``traced`` (and tracing is on); else a no-op, so
    in-process fakes add no spans to the traces tests check."""
    return rpc_span(context, method, request_id) if traced else tracing.NO_SPAN


KV_COMPAT = {"model": "fake", "dtype": "bfloat16", "block_size": "16", "kv_layout": "NHD"}


def capabilities(
    role: int, max_model_len: int, kv_compat: dict[str, str], worker_id: str = ""
) -> worker_pb2.Capabilities:
    """``worker_id``: its name in the registry and the prefix index (default ``fake-<role>``)."""
    return worker_pb2.Capabilities(
        worker_id=worker_id or f"fake-{worker_pb2.Role.Name(role).lower()}",
        role=role,  # type: ignore[arg-type]
        model="fake-model",
        served_model_name=default_model_dir().name,  # what the test gateways serve
        block_size=16,
        max_model_len=max_model_len,
        kv_capacity_tokens=100_000,
        num_kv_blocks=6250,
        dtype="bfloat16",
        kv_connector="FakeConnector",
        kv_compat=kv_compat,
        version="test",
        index_keys=worker_pb2.PrefixIndexKeys(hash_seed=42, redis_prefix="pdserve"),
    )


R = TypeVar("R")


@dataclass
class Recorder(Generic[R]):
    """What one fake worker saw."""

    requests: list[R] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    # (request id, hand-off) of every Abort that brought a hand-off to release.
    releases: list[tuple[str, worker_pb2.KvTransferParams]] = field(default_factory=list)
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    keep: bool = True  # False: a load benchmark, nobody reads the requests back

    def record(self, request: R, context: Any) -> None:
        if not self.keep:
            return
        self.requests.append(request)
        self.metadata.append({k: str(v) for k, v in context.invocation_metadata() or ()})

    def abort(self, request: worker_pb2.AbortRequest) -> worker_pb2.AbortResponse:
        self.aborts.append(request.request_id)
        if request.HasField("kv_transfer_params"):
            self.releases.append((request.request_id, request.kv_transfer_params))
        self.aborted.set()
        return worker_pb2.AbortResponse(found=True)


class FakeAdapters:
    """Run-time LoRA adapters as a real worker takes them: listed in its capabilities once
    loaded (``refuse_adapters``: every load fails, as an engine without LoRA refuses it)."""

    caps: worker_pb2.Capabilities
    refuse_adapters = False

    async def LoadLoraAdapter(self, request, context):  # type: ignore[no-untyped-def]
        if self.refuse_adapters:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "scripted: no LoRA here")
        kept = [a for a in self.caps.lora_adapters if a.name != request.name]
        del self.caps.lora_adapters[:]
        self.caps.lora_adapters.extend(kept)
        self.caps.lora_adapters.add(name=request.name, path=request.path, rank=8)
        return worker_pb2.LoraAdapterResponse()

    async def UnloadLoraAdapter(self, request, context):  # type: ignore[no-untyped-def]
        kept = [a for a in self.caps.lora_adapters if a.name != request.name]
        if len(kept) == len(self.caps.lora_adapters):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no such adapter")
        del self.caps.lora_adapters[:]
        self.caps.lora_adapters.extend(kept)
        return worker_pb2.LoraAdapterResponse()


class FakePrefill(FakeAdapters, worker_pb2_grpc.PrefillWorkerServicer):
    """``serve_s`` > 0: prefills take that long each, one at a time (an engine's queue).
    ``traced``: a server span per call, as a real worker's (see ``_span``). ``cached_for``
    says how many prompt tokens its cache serves (default: ``cached_tokens``, at most all but
    the last); ``pdserve bench fleet`` gives each fake a cache of its own there."""

    def __init__(
        self,
        *,
        cached_tokens: int = 3,
        max_model_len: int = 2048,
        record: bool = True,
        serve_s: float = 0.0,
        traced: bool = False,
        worker_id: str = "",
    ) -> None:
        self.traced = traced
        self.seen: Recorder[worker_pb2.PrefillRequest] = Recorder(keep=record)
        self.cached_tokens = cached_tokens
        self.serve_s = serve_s
        self.queue = asyncio.Lock()
        self.fail_with: grpc.StatusCode | None = None
        self.caps = capabilities(worker_pb2.ROLE_PREFILL, max_model_len, dict(KV_COMPAT), worker_id)
        self.responses: list[worker_pb2.PrefillResponse] = []

    async def Prefill(self, request, context):  # type: ignore[no-untyped-def]
        with _span(self.traced, context, f"{PREFILL_SERVICE}/Prefill", request.request_id):
            return await self._prefill(request, context)

    async def _prefill(self, request, context):  # type: ignore[no-untyped-def]
        self.seen.record(request, context)
        if self.fail_with is not None:
            await context.abort(self.fail_with, "scripted prefill failure")
        if self.serve_s:
            async with self.queue:
                await asyncio.sleep(self.serve_s)
        n = len(request.prompt_token_ids)
        cached = await self.cached_for(request)
        params = worker_pb2.KvTransferParams(
            remote_engine_id="fake-prefill-engine",
            remote_request_id=f"engine-{request.request_id}",
            remote_host="127.0.0.1",
            remote_port=15100,
            remote_block_ids=list(range((n + 15) // 16)),
            remote_num_tokens=n,
            remote_prefill_cached_tokens=cached,
            extra_json='{"tp_size": 1}',
        )
        response = worker_pb2.PrefillResponse(
            request_id=request.request_id,
            kv_transfer_params=params,
            first_token_id=DEFAULT_PIECES[0][0],
            prompt_tokens=n,
            cached_tokens=cached,
            engine=PREFILL_ENGINE,
        )
        self.responses.append(response)
        return response

    async def cached_for(self, request: worker_pb2.PrefillRequest) -> int:
        return min(self.cached_tokens, len(request.prompt_token_ids) - 1)

    async def Abort(self, request, context):  # type: ignore[no-untyped-def]
        return self.seen.abort(request)

    async def GetCapabilities(self, request, context):  # type: ignore[no-untyped-def]
        return self.caps


class FakeDecode(FakeAdapters, worker_pb2_grpc.DecodeWorkerServicer):
    """Streams ``pieces`` one token per chunk, the finish on the last token's chunk.

    ``positional``: like a greedy model, the i-th token after a prompt of length L is
    ``pieces[(L + i) % len(pieces)]`` and a request generates exactly ``max_tokens``, so a
    continuation from the prompt plus the tokens so far goes on where the first stream was.
    ``fail_after`` / ``hang_after``: after that many tokens the stream fails (UNAVAILABLE, as
    a dying worker's) or goes silent (a hung worker's) — on this fake's first request only when
    ``once`` is set. ``cached_tokens``: what its caches serve of a prompt it computes itself
    (the local path; with a hand-off it reports the prefill worker's). ``traced``: a server
    span per call, as a real worker's (see ``_span``)."""

    def __init__(
        self,
        *,
        delay_s: float = 0.0,
        max_model_len: int = 2048,
        tokens: list[tuple[int, str]] | None = None,
        record: bool = True,
        positional: bool = False,
        fail_after: int | None = None,
        hang_after: int | None = None,
        once: bool = False,
        cached_tokens: int = 0,
        traced: bool = False,
        worker_id: str = "",
    ) -> None:
        self.traced = traced
        self.positional = positional
        self.cached_tokens = cached_tokens
        self.fail_after = fail_after
        self.hang_after = hang_after
        self.once = once
        self.seen: Recorder[worker_pb2.DecodeRequest] = Recorder(keep=record)
        self.pieces = list(tokens or DEFAULT_PIECES)
        self.delay_s = delay_s
        # Refuse hand-offs the way a worker does when it cannot pull the KV blocks.
        self.fail_kv_transfer = False
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.caps = capabilities(worker_pb2.ROLE_DECODE, max_model_len, dict(KV_COMPAT), worker_id)

    def _final(self, request: worker_pb2.DecodeRequest, emitted: int) -> worker_pb2.DecodeChunk:
        n = len(request.prompt_token_ids)
        cached = min(self.cached_tokens, n - 1)
        transfer = common_pb2.TransferStats(prompt_tokens_computed=n - cached)
        if request.HasField("kv_transfer_params"):
            kv = request.kv_transfer_params
            cached = kv.remote_prefill_cached_tokens
            transfer = common_pb2.TransferStats(
                prompt_tokens_computed=1,
                kv_tokens_received=kv.remote_num_tokens - 1,
                kv_blocks_received=len(kv.remote_block_ids),
                kv_bytes_received=(kv.remote_num_tokens - 1) * KV_BYTES_PER_TOKEN,
                kv_transfer_seconds=0.002,
            )
        usage = common_pb2.Usage(prompt_tokens=n, completion_tokens=emitted, cached_tokens=cached)
        return worker_pb2.DecodeChunk(usage=usage, transfer=transfer, engine=DECODE_ENGINE)

    async def Decode(self, request, context):  # type: ignore[no-untyped-def]
        with _span(self.traced, context, f"{DECODE_SERVICE}/Decode", request.request_id):
            # aclosing: a cancelled stream runs _decode's cleanup now, not at garbage collection
            async with contextlib.aclosing(self._decode(request, context)) as chunks:
                async for chunk in chunks:
                    yield chunk

    async def _decode(self, request, context):  # type: ignore[no-untyped-def]
        self.seen.record(request, context)
        self.started.set()
        if self.fail_kv_transfer and request.HasField("kv_transfer_params"):
            await context.send_initial_metadata((("x-pdserve-error", "kv_transfer_failed"),))
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted KV pull failure")
        finished = False

        def on_done(_: object) -> None:
            # A cancel may land while the stream waits to send, where the generator body
            # never sees a CancelledError: the RPC ending unfinished is the signal.
            if not finished:
                self.cancelled.set()

        context.add_done_callback(on_done)
        pieces = self._script(request)
        fail_after, hang_after = self.fail_after, self.hang_after
        if self.once:
            self.fail_after = self.hang_after = None
        try:
            for i, (token_id, text) in enumerate(pieces):
                if i == fail_after:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted worker death")
                if i == hang_after:
                    await asyncio.Event().wait()  # until cancelled
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                chunk = worker_pb2.DecodeChunk(token_ids=[token_id], text=text)
                _add_logprobs(chunk, request, token_id, first=i == 0)
                if i == len(pieces) - 1:
                    chunk.MergeFrom(self._final(request, len(pieces)))
                    full = len(pieces) == len(self.pieces) and not self.positional
                    chunk.finish_reason = "stop" if full else "length"
                yield chunk
            finished = True
        finally:
            if not finished:
                self.cancelled.set()

    def _script(self, request: worker_pb2.DecodeRequest) -> list[tuple[int, str]]:
        limit = request.params.max_tokens or len(self.pieces)
        if not self.positional:
            return self.pieces[:limit]
        start = len(request.prompt_token_ids)
        return [self.pieces[(start + i) % len(self.pieces)] for i in range(limit)]

    async def Abort(self, request, context):  # type: ignore[no-untyped-def]
        return self.seen.abort(request)

    async def GetCapabilities(self, request, context):  # type: ignore[no-untyped-def]
        return self.caps


def _entry(token_id: int, top: int) -> common_pb2.TokenLogprob:
    """A scripted logprob: the token at -0.5, then alternatives 1, 2, ... at -1.5, -2.5, ..."""
    alternatives = [common_pb2.TopLogprob(token_id=token_id, logprob=-0.5)]
    alternatives += [common_pb2.TopLogprob(token_id=t, logprob=-0.5 - t) for t in range(1, top)]
    return common_pb2.TokenLogprob(token_id=token_id, logprob=-0.5, top=alternatives[: max(top, 1)])


def _add_logprobs(
    chunk: worker_pb2.DecodeChunk, request: worker_pb2.DecodeRequest, token_id: int, first: bool
) -> None:
    params = request.params
    if params.HasField("logprobs"):
        chunk.logprobs.append(_entry(token_id, params.logprobs))
    if first and params.HasField("prompt_logprobs"):
        for prompt_token in request.prompt_token_ids[1:]:
            chunk.prompt_logprobs.append(_entry(prompt_token, params.prompt_logprobs))


async def start_worker(servicer: FakePrefill | FakeDecode) -> GrpcServer:
    """Serve ``servicer`` on a free loopback port (``server.port``)."""
    if isinstance(servicer, FakePrefill):
        add = worker_pb2_grpc.add_PrefillWorkerServicer_to_server
        name = PREFILL_SERVICE
    else:
        add = worker_pb2_grpc.add_DecodeWorkerServicer_to_server  # type: ignore[assignment]
        name = DECODE_SERVICE
    server = GrpcServer("127.0.0.1", 0, [lambda s: add(servicer, s)], [name])  # type: ignore[arg-type]
    await server.start()
    return server


async def _serve(args: argparse.Namespace) -> None:
    stop = stop_event_on_signals()
    traced = tracing.setup("fake-workers")
    prefill = FakePrefill(max_model_len=args.max_model_len, record=False, traced=traced)
    decode = FakeDecode(
        delay_s=args.interval_ms / 1000,
        max_model_len=args.max_model_len,
        tokens=pieces(args.tokens),
        record=False,
        traced=traced,
    )
    servers = [await start_worker(prefill), await start_worker(decode)]
    freeze_startup_objects()
    print(json.dumps({"prefill": servers[0].port, "decode": servers[1].port}), flush=True)
    try:
        await stop.wait()
    finally:
        for server in servers:
            await server.stop(0)
        tracing.shutdown()  # export the spans still buffered


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.bench.fake_worker", description=__doc__
    )
    parser.add_argument("--tokens", type=int, default=len(DEFAULT_PIECES), help="per answer")
    parser.add_argument("--interval-ms", type=float, default=0.0, help="pause before each token")
    parser.add_argument("--max-model-len", type=int, default=32768)
    asyncio.run(_serve(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
