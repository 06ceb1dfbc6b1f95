"""A worker shuts its engine down once: vLLM's AsyncLLM shuts down again when it is freed,
at interpreter exit, when what its shutdown calls is gone (a traceback on every stop)."""

from __future__ import annotations

from typing import Any

from pdserve.worker.service import WorkerService


class Engine:
    def __init__(self) -> None:
        self.shutdowns = 0

    def shutdown(self, timeout: float | None = None) -> None:
        self.shutdowns += 1

    def __del__(self) -> None:  # as AsyncLLM does
        self.shutdown()


def test_the_engine_is_shut_down_once() -> None:
    engine = Engine()
    service: Any = WorkerService.__new__(WorkerService)  # only the engine matters here
    service.engine = engine
    service.shutdown()
    engine.__del__()  # what freeing it at interpreter exit runs
    assert engine.shutdowns == 1
