"""Messages between the connector's scheduler half (EngineCore) and worker half (Worker).

Both are pickled by vLLM once per engine step, so they stay small: ids and block lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class PullJob:
    req_id: str
    host: str
    port: int
    remote_req_id: str
    remote_blocks: list[int]
    local_blocks: list[int]
    # Set when the scheduler already knows the pull cannot work; the worker then reports
    # the request as a failed receive without contacting anyone.
    error: str = ""
    # The prompt digest of the hand-off: the producer serves only a pull that names it.
    digest: str = ""
    # The producer engine's start (epoch) and its number for the job (seq), from the sealed
    # hand-off: a pull for a job that has ended, or of an earlier start, fails at once.
    epoch: str = ""
    seq: int | None = None


@dataclass
class ReleaseJob:
    host: str
    port: int
    remote_req_id: str


@dataclass
class StepMetadata(KVConnectorMetadata):
    """Scheduler -> worker: what to start this step."""

    serve: dict[str, list[int]] = field(default_factory=dict)  # producer: req -> blocks
    serve_digests: dict[str, str] = field(default_factory=dict)  # producer: req -> prompt digest
    serve_keys: dict[str, str] = field(default_factory=dict)  # producer: req -> release key
    serve_seqs: dict[str, int] = field(default_factory=dict)  # producer: req -> job number
    # Producer: (epoch, announcement key) of this engine start, for its transfer processes
    # (kv_transfer.registry.Owner); never leaves the engine's processes.
    owner: tuple[str, str] = ("", "")
    pull: list[PullJob] = field(default_factory=list)  # consumer
    release: list[ReleaseJob] = field(default_factory=list)  # consumer


@dataclass
class TransferReport(KVConnectorWorkerMetadata):
    """Worker -> scheduler: per-request results of finished pulls this step.

    With tensor parallelism every rank pulls its share of each block: vLLM aggregates the
    ranks' reports, so bytes add up, the time is the slowest rank's, and a request is ok only
    when every rank's pull was."""

    results: dict[str, dict[str, Any]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, TransferReport):
            for req, result in other.results.items():
                mine = self.results.setdefault(req, dict(result))
                if mine is not result:
                    mine["bytes"] = mine.get("bytes", 0) + result.get("bytes", 0)
                    mine["seconds"] = max(mine.get("seconds", 0.0), result.get("seconds", 0.0))
                    mine["ok"] = mine.get("ok", False) and result.get("ok", False)
                    if not result.get("ok") and result.get("error"):
                        mine.setdefault("error", result["error"])
        return self
