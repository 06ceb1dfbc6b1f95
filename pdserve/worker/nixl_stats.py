"""vLLM's NIXL transfer statistics, added up into the worker's load report.

After every engine step vLLM hands each stat logger the step's ``kv_connector_stats``
(vllm/v1/core/sched/scheduler.py:2336-2351, 2937-2955): for vLLM's NixlConnector the ``data``
of ``NixlKVConnectorStats`` since the previous step (stats.py:33-45; its worker resets it on
every report, base_worker.py:3518-3523), under a ``MultiConnector`` one such dict per child by
its class name (multi_connector.py:689-702). Its lists (paths under
vllm/distributed/kv_transfer/kv_connector/v1/nixl/):

- ``bytes_transferred``: bytes of each finished transfer (a decode worker's read), NIXL's
  telemetry ``totalBytes`` (stats.py:47-54, recorded at base_worker.py:3083-3086);
- ``transfer_duration``: its seconds (NIXL's ``xferDuration``, microseconds / 1e6);
- ``num_failed_transfers``, ``num_failed_handshakes``, ``num_failed_notifications``: a 1 per
  failure (stats.py:56-66);
- ``num_kv_expired_reqs``: a 1 per request whose blocks a producer freed at the end of the
  lease, unread (stats.py:68-70, base_worker.py:3014-3040).

A decode worker's bytes and seconds are what its reads moved; the gateway exports them per
worker (``gateway.worker_metrics``), so that bytes / seconds is the KV throughput of the path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# vLLM's class names of the connector (NixlConnector is NixlPullConnector: connector.py:413-414).
NIXL_CLASSES = ("NixlPullConnector", "NixlPushConnector", "NixlConnector")
FAILURES = ("num_failed_transfers", "num_failed_handshakes", "num_failed_notifications")


@dataclass
class TransferTotals:
    """What one step's statistics add (all zero: none)."""

    transfers: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failures: int = 0
    expired: int = 0


def nixl_data(stats: dict[str, Any] | None) -> dict[str, Any] | None:
    """The NixlKVConnectorStats data in a step's ``kv_connector_stats``, or None."""
    if not stats:
        return None
    if "bytes_transferred" in stats:
        return stats
    for name in NIXL_CLASSES:
        child = stats.get(name)
        if isinstance(child, dict) and "bytes_transferred" in child:
            return child
    return None


def step_totals(stats: dict[str, Any] | None) -> TransferTotals | None:
    """The transfers of one step's ``kv_connector_stats``; None when NIXL reported nothing."""
    data = nixl_data(stats)
    if data is None:
        return None
    return TransferTotals(
        transfers=len(data.get("transfer_duration") or ()),
        bytes=int(sum(data.get("bytes_transferred") or ())),
        seconds=float(sum(data.get("transfer_duration") or ())),
        failures=int(sum(sum(data.get(key) or ()) for key in FAILURES)),
        expired=int(sum(data.get("num_kv_expired_reqs") or ())),
    )
