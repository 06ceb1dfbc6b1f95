"""Errors of the decode worker: the shared worker errors (see pdserve.worker.errors)."""

from pdserve.worker.errors import EngineUnavailable, InvalidRequest, KVTransferFailed, WorkerError

__all__ = ["EngineUnavailable", "InvalidRequest", "KVTransferFailed", "WorkerError"]
