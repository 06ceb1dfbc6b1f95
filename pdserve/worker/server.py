"""The gRPC skeleton both worker roles share: bootstrap, error mapping, capabilities, abort.

The server binds first and reports NOT_SERVING while the engine loads (RPCs answer
UNAVAILABLE), then SERVING; it exits when the engine dies so that a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, NoReturn

import grpc

from pdserve import __version__
from pdserve.placement import front_cores
from pdserve.rpc.client import ERROR_REASON_METADATA
from pdserve.rpc.secret import SECRET_FILE_ENV, deployment_secret, is_loopback
from pdserve.rpc.server import GrpcServer, stop_event_on_signals
from pdserve.rpc.tls import deployment_tls
from pdserve.runtime.heap import freeze_startup_objects
from pdserve.telemetry import tracing
from pdserve.worker import kv_tier
from pdserve.worker.config import WorkerSettings
from pdserve.worker.errors import (
    EngineUnavailable,
    InvalidRequest,
    KVTransferFailed,
    RequestAborted,
    WorkerError,
)
from pdserve.worker.handoff import to_params
from pdserve.worker.service import WorkerService
from protos.v1 import worker_pb2

if TYPE_CHECKING:
    from pdserve.worker.registration import Load

log = logging.getLogger(__name__)

_CODES: dict[type[WorkerError], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    EngineUnavailable: grpc.StatusCode.UNAVAILABLE,
    KVTransferFailed: grpc.StatusCode.UNAVAILABLE,
    RequestAborted: grpc.StatusCode.CANCELLED,
}


def grpc_code(exc: WorkerError) -> grpc.StatusCode:
    for kind, code in _CODES.items():
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


async def fail(context: grpc.aio.ServicerContext, exc: WorkerError) -> NoReturn:
    """End the RPC with the status that matches ``exc`` (the one mapping for workers)."""
    if isinstance(exc, KVTransferFailed):
        await context.send_initial_metadata(((ERROR_REASON_METADATA, "kv_transfer_failed"),))
    await context.abort(grpc_code(exc), str(exc))
    raise AssertionError("unreachable")  # context.abort raises


# The workers' gRPC services' full names (method paths, health, reflection, span names).
PREFILL_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name
DECODE_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name


def rpc_span(context: grpc.aio.ServicerContext, method: str, request_id: str) -> Any:
    """The server span of one RPC (``method``: its full name), child of the caller's span
    when the call's metadata carries a ``traceparent``; a no-op while tracing is off."""
    if not tracing.enabled():
        return tracing.NO_SPAN
    return tracing.span(
        method,
        {"rpc.system": "grpc", "rpc.method": method, "pdserve.request_id": request_id},
        kind="server",
        parent=tracing.extract(context.invocation_metadata()),
    )


class ServicerBase:
    """Abort and GetCapabilities for both roles; ``service`` is set once the engine is up."""

    role: int = worker_pb2.ROLE_UNSPECIFIED

    def __init__(self) -> None:
        self.service: Any = None

    async def ready(self, context: grpc.aio.ServicerContext) -> Any:
        if self.service is None:
            await fail(context, EngineUnavailable("the worker's engine is still starting"))
        return self.service

    async def Abort(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        service = await self.ready(context)
        handoff = None
        if request.HasField("kv_transfer_params"):
            handoff = to_params(request.kv_transfer_params)
        return worker_pb2.AbortResponse(found=await service.abort(request.request_id, handoff))

    async def LoadLoraAdapter(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        service: WorkerService = await self.ready(context)
        try:
            await service.adapters.load(
                service.engine, request.name, request.path, request.load_inplace
            )
        except WorkerError as exc:
            await fail(context, exc)
        return worker_pb2.LoraAdapterResponse()

    async def UnloadLoraAdapter(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        service: WorkerService = await self.ready(context)
        try:
            await service.adapters.unload(service.engine, request.name)
        except WorkerError as exc:
            await fail(context, exc)
        return worker_pb2.LoraAdapterResponse()

    async def GetCapabilities(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        service: WorkerService = await self.ready(context)
        info = service.info
        return worker_pb2.Capabilities(
            worker_id=service.settings.name,
            role=self.role,  # type: ignore[arg-type]
            model=info.model,
            served_model_name=info.served_model_name,
            block_size=info.block_size,
            max_model_len=info.max_model_len,
            kv_capacity_tokens=info.num_kv_blocks * info.block_size,
            num_kv_blocks=info.num_kv_blocks,
            dtype=info.dtype,
            kv_connector=info.kv_connector,
            kv_compat=info.kv_compat,
            version=__version__,
            lora_adapters=[
                worker_pb2.LoraAdapter(name=a.name, path=a.path, rank=a.rank)
                for a in service.adapters.by_name.values()
            ],
            resident_lora_adapters=sorted(service.adapters.resident),
            load=worker_pb2.WorkerLoad(**asdict(service.load)),
            index_keys=worker_pb2.PrefixIndexKeys(
                hash_seed=service.settings.hash_seed,
                redis_prefix=service.settings.redis_prefix,
            ),
            kv_tier=kv_tier.identity(service.settings),
            kv_tier_chunk_tokens=service.settings.kv_tier_chunk_tokens,
        )


async def serve(
    settings: WorkerSettings,
    servicer: ServicerBase,
    register: Callable[[grpc.aio.Server], None],
    service_name: str,
    make_service: Callable[[Any, WorkerSettings, Any], WorkerService],
) -> int:
    """Run one worker until SIGINT/SIGTERM or engine death; returns the exit code."""
    from pdserve.model import resolve_model
    from pdserve.worker.engine import check_connector, describe, start_engine
    from pdserve.worker.registration import IndexLink, Load, stat_logger_for

    try:
        model = resolve_model(settings.model or None)
        secret = deployment_secret()
        tls = deployment_tls()
        kv_tier.check(settings)
        check_connector(settings)
    except ValueError as exc:
        log.error("%s", exc)
        return 1
    if secret is None and not _may_run_open(settings):
        return 1
    try:
        server = GrpcServer(settings.host, settings.port, [register], [service_name], secret,
                            worker_id=settings.name, tls=tls)  # fmt: skip
    except ValueError as exc:  # a certificate without the internal name
        log.error("%s", exc)
        return 1
    try:
        await server.start(serving=False)  # NOT_SERVING until the engine has loaded
    except (OSError, RuntimeError) as exc:
        log.error("cannot serve gRPC on %s:%d: %s", settings.host, settings.port, exc)
        return 1
    log.info("%s listening on %s:%d%s, loading %s", settings.name, settings.host, server.port,
             " (mutual TLS)" if tls else "", model)  # fmt: skip
    stop = stop_event_on_signals()
    load = Load()
    link = IndexLink(settings, load) if settings.redis_url else None
    try:
        # Off the event loop: loading takes a while, and meanwhile health checks must be
        # answered (NOT_SERVING) and signals handled.
        engine = await asyncio.to_thread(
            start_engine, settings, model, kv_events=link.kv_events_config() if link else None,
            stat_loggers=[stat_logger_for(load)],
        )  # fmt: skip
    except Exception as exc:  # startup policy: any engine failure ends the worker, clearly
        log.error("the vLLM engine failed to start: %s (its log is above)", exc)
        await server.stop(0)
        return 1
    # The engine's processes have their cores; this process's own threads go where pdserve up
    # says they disturb the decode engine least (pdserve.placement.front_cores).
    front_cores.bind_this_process(settings.name)
    servicer.service = make_service(engine, settings, describe(engine))
    servicer.service.load = load
    if link is not None:
        await link.start(servicer.service.info, server.port, servicer.service.resident_loras)
    # The engine's front end (vLLM, torch, the tokenizer: some 630k objects) stays for good;
    # a full collection walking them all stalls every stream of this worker (0.3-0.45 s here).
    log.info("garbage collector: %d start-up objects frozen", freeze_startup_objects())
    await server.set_serving(True)
    log.info("%s ready (%s)", settings.name, servicer.service.info.kv_connector)
    code = await _run_until_stopped(engine, stop, lending_counters(settings, load))
    log.info("%s stopping", settings.name)
    if link is not None:
        await link.stop()  # leave the registry first: gateways stop sending new requests
    await server.stop(settings.shutdown_grace_s)
    servicer.service.shutdown()
    return code


def _may_run_open(settings: WorkerSettings) -> bool:
    """Without a deployment secret: refuse reachable addresses, warn on loopback (the policy
    of docs/deploy.md, "Internal ports and the deployment secret")."""
    kv_host = settings.kv_bind_host or settings.host
    exposed = sorted({h for h in (settings.host, kv_host) if not is_loopback(h)})
    if exposed:
        log.error(
            "refusing to listen on %s without a deployment secret: anyone who can reach the "
            "worker could read or drop its requests' KV cache. Set %s to a file holding a "
            "secret shared by the deployment (e.g. `openssl rand -hex 32 > secret; chmod 600 "
            "secret`), or bind to 127.0.0.1",
            ", ".join(exposed),
            SECRET_FILE_ENV,
        )
        return False
    log.warning(
        "no deployment secret (%s unset): this worker's gRPC and KV ports accept any local "
        "process; `pdserve up` sets one up",
        SECRET_FILE_ENV,
    )
    return True


def lending_counters(settings: WorkerSettings, load: Load) -> Callable[[], None]:
    """What copies the core lending counters of this worker's cores into ``load`` (nothing
    for a worker that lends no cores)."""
    if not settings.cpu_lending or settings.cpu_borrow or not settings.cpu_cores:
        return lambda: None
    from pdserve.placement.engines import parse_cores
    from pdserve.worker.core_lending import CoreTable

    table, cores = CoreTable(settings.cpu_lending), parse_cores(settings.cpu_cores)
    return lambda: load.take_lending(table.totals(cores))


async def _run_until_stopped(
    engine: Any, stop: asyncio.Event, every_second: Callable[[], None] = lambda: None
) -> int:
    while not stop.is_set():
        if engine.errored:
            log.error("the vLLM engine died; exiting so that the worker is restarted")
            return 1
        every_second()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=1.0)
    return 0
