"""Errors of the prefill worker: the shared worker errors (see pdserve.worker.errors)."""

from pdserve.worker.errors import EngineUnavailable, InvalidRequest, WorkerError

__all__ = ["EngineUnavailable", "InvalidRequest", "WorkerError"]
