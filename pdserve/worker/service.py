"""The transport-agnostic core both worker roles share: engine, capabilities, aborts."""

from __future__ import annotations

import logging
from typing import Any

from pdserve.worker.config import WorkerSettings
from pdserve.worker.engine import EngineInfo
from pdserve.worker.errors import EngineUnavailable

log = logging.getLogger(__name__)


class WorkerService:
    """Owns the engine of one worker. Subclasses add the role's request path."""

    def __init__(self, engine: Any, settings: WorkerSettings, info: EngineInfo) -> None:
        self.engine = engine
        self.settings = settings
        self.info = info

    def check_alive(self) -> None:
        if self.engine.errored:
            raise EngineUnavailable(f"the vLLM engine of {self.settings.name} has stopped")

    async def abort(self, request_id: str) -> bool:
        """Abort the engine request; True if it was known (running or pinned)."""
        await self.engine.abort(request_id)
        return True

    def shutdown(self) -> None:
        self.engine.shutdown()
