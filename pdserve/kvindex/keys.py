"""The Redis key layout, in one place.

``{p}`` is the deployment prefix (default ``pdserve``), ``{ns}`` the model namespace (the
served model name), so several models can share one Redis.

- ``{p}:workers``                  HASH worker id -> WorkerRecord JSON (registry)
- ``{p}:alive:{worker}``           STRING epoch, with a TTL refreshed by the heartbeat
- ``{p}:registry``                 STRING the registry's epoch (new after Redis lost its data)
- ``{p}:{ns}:b:{hash}``            SET of worker ids holding the block with that hash
- ``{p}:{ns}:w:{worker}``          SET of block hashes the worker holds (reverse index)

A shared KV tier (LMCache) is a holder like a worker, with the id ``tier:<identity>`` (e.g.
``tier:redis:10.0.0.5:6379/1``, the identity its workers report) in both sets. The gateways
write its entries (``gateway.routing.kv_tier``), not the workers; it is in no registry, so no
gateway reaps it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    prefix: str = "pdserve"

    @property
    def workers(self) -> str:
        return f"{self.prefix}:workers"

    @property
    def registry(self) -> str:
        return f"{self.prefix}:registry"

    def alive(self, worker: str) -> str:
        return f"{self.prefix}:alive:{worker}"

    def namespace(self, model: str) -> str:
        """Key prefix of one model's block index (block and reverse keys hang off it)."""
        return f"{self.prefix}:{model}"

    def worker_blocks(self, model: str, worker: str) -> str:
        """The reverse index of one worker: the hashes of the blocks it holds."""
        return f"{self.namespace(model)}:w:{worker}"
