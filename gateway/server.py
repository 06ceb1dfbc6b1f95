"""Transport wiring of the gateway: one object that starts and stops everything in one loop.

HTTP (uvicorn serving the FastAPI app on a socket bound here, so port 0 works and the real
port is known) and the public gRPC server (``pdserve.rpc.server.GrpcServer``: health and
reflection) share the asyncio loop with the worker pool. The gRPC health status of
``pdserve.v1.Generation`` follows the pool: SERVING while a decode worker is healthy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator, Mapping

import uvicorn
from grpc_health.v1 import health_pb2

from gateway.auth import ApiKeys
from gateway.config import GatewaySettings
from gateway.discovery import RegistryDiscovery
from gateway.grpc_api import SERVICE_NAME, GenerationServicer
from gateway.http import create_app
from gateway.interfaces import PromptTokenizer
from gateway.metrics import GatewayMetrics
from gateway.models import ServedModels
from gateway.offload import Offload
from gateway.pool import DecodeWorker, PrefillWorker, WorkerPool
from gateway.routing import plugins  # noqa: F401  (registers the built-in pickers)
from gateway.routing.registry import PickerContext, make_picker
from gateway.service import GenerationService
from gateway.shared_load import SharedLoad
from gateway.worker_metrics import WorkerCollector
from pdserve.kvindex.keys import Keys
from pdserve.kvindex.redis_store import RedisStore
from pdserve.rpc.server import GrpcServer
from pdserve.runtime.supervise import exit_if_ended
from protos.v1 import generate_pb2_grpc

log = logging.getLogger(__name__)

_HTTP_GRACE_S = 10.0
_REDIS_TIMEOUT_S = 2.0  # RedisStore's per-call timeout (its default)


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: the gateway owns SIGINT/SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    return sock


def _retrieve(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("cannot update gRPC health: %s", task.exception())


class GatewayServer:
    """Build with settings; ``await start()``; ``await stop()``.

    ``tokenizer`` may be injected (tests); by default the model directory's tokenizer is
    loaded once at ``start``.
    """

    def __init__(self, settings: GatewaySettings, tokenizer: PromptTokenizer | None = None):
        self.settings = settings
        self.api_keys = ApiKeys.from_settings(settings)
        self._tokenizer = tokenizer
        self.metrics = GatewayMetrics()
        # One pool per served model: the first takes the static worker lists; the other
        # models' workers are discovered in the registry by the model name they serve.
        self.pool = WorkerPool(settings)
        static: dict[str, list[str]] = {"prefill_workers": [], "decode_workers": []}
        self.pools = [self.pool] + [
            WorkerPool(settings.model_copy(update=static)) for _ in settings.extra_models
        ]
        self.metrics.registry.register(WorkerCollector(self._workers))
        # Templates, tokenization and block hashing run on these threads (gateway.offload).
        self.offload = Offload(settings.prompt_threads)
        self.service: GenerationService | None = None  # the default (first) model's
        self.served: ServedModels | None = None
        self.http_port = 0
        self.grpc_port = 0
        self._http: _EmbeddedUvicorn | None = None
        self._http_task: asyncio.Task[None] | None = None
        self._grpc: GrpcServer | None = None
        self._health_tasks: set[asyncio.Future[None]] = set()
        self._stopping = False
        self.store: RedisStore | None = None
        self.discovery: RegistryDiscovery | None = None
        if settings.redis_url:
            self.store = RedisStore(
                settings.redis_url, prefix=settings.redis_prefix, timeout_s=_REDIS_TIMEOUT_S
            )
            self.discovery = RegistryDiscovery(
                self.pools, self.store, settings.discovery_interval_s
            )
        self.shared_load: SharedLoad | None = None
        if self.store is not None and settings.load_share_interval_s > 0:
            self.shared_load = SharedLoad(
                self.store.client,
                Keys(settings.redis_prefix).inflight,
                settings.load_share_interval_s,
                self._local_in_flight,
                self._set_peer_in_flight,
                registry=self.metrics.registry,
            )

    def _workers(self) -> list[PrefillWorker | DecodeWorker]:
        workers: list[PrefillWorker | DecodeWorker] = []
        for pool in self.pools:
            workers += [*pool.prefill, *pool.decode]
        return workers

    def _local_in_flight(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for pool in self.pools:
            totals.update(pool.local_in_flight())
        return totals

    def _set_peer_in_flight(self, totals: Mapping[str, int]) -> None:
        for pool in self.pools:
            pool.set_peer_in_flight(totals)

    def _build_services(self) -> ServedModels:
        """One service per model: its pool, tokenizer (the injected one for the first model),
        vLLM front end and picker."""
        from gateway.tokenizer import HfTokenizer

        services = []
        models = self.settings.served_models()
        for i, ((name, model_dir), pool) in enumerate(zip(models, self.pools, strict=True)):
            pool.model_name = name
            tokenizer = self._tokenizer if i == 0 and self._tokenizer else HfTokenizer(model_dir)
            context = PickerContext(self.settings, self.metrics, self.store, self.offload)
            services.append(
                GenerationService(
                    self.settings,
                    model_name=name,
                    tokenizer=tokenizer,
                    pool=pool,
                    picker=make_picker(self.settings.picker_name(), context),
                    metrics=self.metrics,
                    offload=self.offload,
                )
            )
        return ServedModels(services)

    async def start(self) -> None:
        """Bind HTTP and gRPC first (port 0 works; clients get 503 until a decode worker is
        healthy), then the first worker health check and discovery, each bounded. vLLM's
        front end (seconds: it imports torch) builds in a thread meanwhile; ``start`` returns
        once it can render."""
        served = self.served = self._build_services()
        self.service = served.default
        renderers = asyncio.gather(*(s.renderer.get() for s in served))
        try:
            await self._start_serving(served)
            await renderers  # e.g. a parser name vLLM does not know: ValueError
            self._update_health()  # ready now that it can render
        except BaseException:
            renderers.cancel()
            await asyncio.gather(renderers, return_exceptions=True)
            await self.stop(grace_s=0)  # nothing it started outlives the failed start
            raise
        log.info(
            "gateway serving %s %s: HTTP on %s:%d, gRPC on %s:%d",
            "models" if len(served.services) > 1 else "model",
            ", ".join(s.model_name for s in served),
            self.settings.http_host,
            self.http_port,
            self.settings.http_host,
            self.grpc_port,
        )

    async def _start_serving(self, served: ServedModels) -> None:
        await self._start_http(served)
        servicer = GenerationServicer(served, self.api_keys)
        self._grpc = GrpcServer(
            self.settings.http_host,
            self.settings.grpc_port,
            [lambda server: generate_pb2_grpc.add_GenerationServicer_to_server(servicer, server)],
            [SERVICE_NAME],
        )
        self.grpc_port = await self._grpc.start()
        for pool in self.pools:
            pool.add_listener(self._update_health)
        self._update_health()
        await asyncio.gather(*(pool.start() for pool in self.pools))
        if self.discovery is not None:
            # The registry's calls and the new workers' health checks, one after the other.
            await self.discovery.start(_REDIS_TIMEOUT_S * 2 + self.settings.control_timeout_s + 1.0)
        if self.shared_load is not None:
            self.shared_load.start()

    async def _start_http(self, served: ServedModels) -> None:
        sock = _bind(self.settings.http_host, self.settings.http_port)
        self.http_port = sock.getsockname()[1]
        config = uvicorn.Config(
            create_app(served, self.api_keys),
            log_config=None,
            lifespan="off",
            access_log=False,
            timeout_graceful_shutdown=int(_HTTP_GRACE_S),
        )
        self._http = _EmbeddedUvicorn(config)
        self._http_task = asyncio.create_task(self._http.serve(sockets=[sock]), name="gateway-http")
        while not self._http.started:
            if self._http_task.done():
                self._http_task.result()  # raises what stopped it
                raise OSError("the HTTP server stopped during start-up")
            await asyncio.sleep(0.01)
        # Once serving, an HTTP server that stops unasked cannot be restarted on the socket it
        # closed: the gateway exits loudly and its supervisor restarts it.
        http = self._http
        exit_if_ended(self._http_task, "gateway-http", lambda: bool(http.should_exit))

    def _update_health(self) -> None:
        if self._grpc is None or self.served is None or self._stopping:
            return
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if self.served.ready()
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        task = asyncio.ensure_future(self._grpc.health.set(SERVICE_NAME, status))
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)
        task.add_done_callback(_retrieve)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop taking requests, let running ones finish (bounded), close the clients."""
        if self._http is not None and self._http_task is not None:
            self._http.should_exit = True
            await self._http_task
        self._stopping = True  # no new health updates; the pending ones finish first
        if self._health_tasks:
            await asyncio.gather(*self._health_tasks, return_exceptions=True)
        if self._grpc is not None:
            await self._grpc.stop(grace_s)
        if self.served is not None:
            await self.served.close()
        if self.discovery is not None:
            await self.discovery.close()
        if self.shared_load is not None:
            await self.shared_load.close()
        for pool in self.pools:
            await pool.close()
        if self.store is not None:
            await self.store.close()
        self.offload.close()
        log.info("gateway stopped")
