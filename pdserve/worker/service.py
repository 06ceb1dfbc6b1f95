"""The transport-agnostic core both worker roles share: engine, capabilities, aborts."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from pdserve.telemetry import tracing
from pdserve.worker.config import WorkerSettings
from pdserve.worker.engine import EngineInfo
from pdserve.worker.errors import EngineUnavailable
from pdserve.worker.lora import Adapters, parse_modules

log = logging.getLogger(__name__)


class WorkerService:
    """Owns the engine of one worker. Subclasses add the role's request path."""

    def __init__(self, engine: Any, settings: WorkerSettings, info: EngineInfo) -> None:
        from pdserve.rpc.secret import deployment_secret
        from pdserve.worker.registration import Load

        self.engine = engine
        self.settings = settings
        self.info = info
        self.adapters = Adapters(parse_modules(settings.lora_modules))
        self.secret = deployment_secret()  # checked by the server before the engine started
        self.load = Load()  # replaced by the server with the one the engine's stats fill

    @contextlib.contextmanager
    def counted(self) -> Iterator[None]:
        """Counts a request in ``load.in_flight`` while it runs."""
        self.load.in_flight += 1
        try:
            yield
        finally:
            self.load.in_flight -= 1

    async def lora_request(self, name: str) -> Any:
        """vLLM's ``LoRARequest`` for the adapter ``name`` (None: the base model), counted in
        ``load``: ``lora_requests``, and ``lora_loads`` when the engine's LoRA cache does not
        hold the adapter, so that running the request loads it first."""
        request = self.adapters.request(name)
        if request is not None:
            resident = await self.adapters.refresh(self.engine)
            self.load.lora_requests += 1
            self.load.lora_loads += name not in resident
        return request

    async def resident_loras(self) -> list[str]:
        """The adapters resident in the engine's LoRA cache now, by name."""
        return sorted(await self.adapters.refresh(self.engine))

    def trace_headers(self) -> dict[str, str] | None:
        """The current trace context for vLLM's ``trace_headers``, so that its request spans
        join the caller's trace; None unless both pdserve's and vLLM's tracing are on (vLLM
        warns about every request that brings a context while its own tracing is off)."""
        config = getattr(self.engine, "observability_config", None)
        if not tracing.enabled() or not getattr(config, "otlp_traces_endpoint", None):
            return None
        return tracing.headers()

    def check_alive(self) -> None:
        if self.engine.errored:
            raise EngineUnavailable(f"the vLLM engine of {self.settings.name} has stopped")

    async def abort(self, request_id: str, handoff: dict[str, Any] | None = None) -> bool:
        """Abort the engine request; True if it was known (running or pinned). ``handoff``:
        a hand-off the request would have brought (decode workers release it)."""
        await self.engine.abort(request_id)
        return True

    def shutdown(self) -> None:
        self.engine.shutdown()
        # Once is enough. vLLM's AsyncLLM.__del__ shuts down again when the object is freed,
        # at interpreter exit, after the module globals that its shutdown calls are gone: a
        # TypeError traceback in the log of every stopped worker.
        setattr(self.engine, "shutdown", _already_shut_down)  # noqa: B010


def _already_shut_down(timeout: float | None = None) -> None:
    """An engine's ``shutdown`` after the first."""
