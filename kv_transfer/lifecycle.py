"""The connector's KV lifecycle gauges, carried by vLLM's per-step scheduler statistics.

The scheduler half knows which requests hold KV blocks for the connector (``scheduler``'s
``lifecycle()``); vLLM collects ``get_kv_connector_stats()`` after each step's connector
update and hands the ``data`` dict to every stat logger in the front-end process, which is
where the worker reads it (``pdserve.worker.registration``). vLLM keeps stepping while a
finished request still holds blocks for the connector, so the last report after a drain says 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

# Keys of ``data``: blocks held for transfers, and the requests (leases) holding them.
PINNED_BLOCKS = "pinned_blocks"
LEASES = "leases"


@dataclass
class LifecycleStats(KVConnectorStats):
    """Gauges, not counters: a newer observation replaces an older one."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other.data:
            self.data = {**self.data, **other.data}
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in self.data.items() if isinstance(v, int | float)}

    def is_empty(self) -> bool:
        return not self.data


def gauges(data: dict[str, Any] | None) -> tuple[int, int] | None:
    """(pinned blocks, leases) from a step's ``kv_connector_stats``; None if it has none.

    Under ``MultiConnector`` the data holds one dict per child connector, by class name."""
    if data and PINNED_BLOCKS not in data:
        data = next((v for v in data.values() if isinstance(v, dict) and PINNED_BLOCKS in v), None)
    if not data or PINNED_BLOCKS not in data:
        return None
    return int(data[PINNED_BLOCKS]), int(data.get(LEASES, 0))


class NoPromMetrics(KVConnectorPromMetrics):
    """vLLM's Prometheus side of a connector's statistics: nothing. pdserve exports these
    gauges itself (the worker reports them, the gateway labels them per worker), but under
    ``MultiConnector`` vLLM requires every child that reports statistics to have one."""

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        return None
