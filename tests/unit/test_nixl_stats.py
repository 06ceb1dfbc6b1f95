"""vLLM's NIXL transfer statistics in the worker's load report, from vLLM's own
``NixlKVConnectorStats`` (vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py:24-98):
its ``data`` lists ``bytes_transferred`` (telemetry totalBytes), ``transfer_duration``
(xferDuration, microseconds -> seconds: stats.py:47-54), a 1 per failed transfer, handshake and
notification (56-66) and per expired lease (68-70), reset on every report (76-79)."""

from __future__ import annotations

from types import SimpleNamespace

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

from pdserve.worker.nixl_stats import step_totals
from pdserve.worker.registration import Load, stat_logger_for


def telemetry(total_bytes: int, micros: int) -> SimpleNamespace:
    """NIXL's nixlXferTelemetry of one finished read (the fields record_transfer reads)."""
    return SimpleNamespace(totalBytes=total_bytes, xferDuration=micros, postDuration=50,
                           descCount=8)  # fmt: skip


def one_step() -> dict:
    """What a decode worker's NIXL connector reports after a step with two reads, one failed
    transfer and a failed handshake; as the scheduler sends it (``to_dict``)."""
    stats = NixlKVConnectorStats()
    stats.record_transfer(telemetry(3 * 2**20, 1500))
    stats.record_transfer(telemetry(2**20, 500))
    stats.record_failed_transfer()
    stats.record_failed_handshake()
    return stats.clone_and_reset().to_dict()


def test_a_steps_nixl_statistics_add_up() -> None:
    step = step_totals(one_step())
    assert step is not None
    assert (step.transfers, step.bytes, step.failures, step.expired) == (2, 4 * 2**20, 2, 0)
    assert abs(step.seconds - 0.002) < 1e-12


def test_under_a_multiconnector_the_nixl_childs_statistics_count() -> None:
    """MultiConnector reports one dict per child, by class name (multi_connector.py:689-702);
    NixlConnector's class is NixlPullConnector (nixl/connector.py:413-414)."""
    tier = {"pinned_blocks": 0, "leases": 0}
    step = step_totals({"NixlPullConnector": one_step(), "LMCacheConnectorV1": tier})
    assert step is not None and step.bytes == 4 * 2**20


def test_other_connectors_statistics_are_not_transfers() -> None:
    assert step_totals({"pinned_blocks": 3, "leases": 1}) is None  # pdserve's connector
    assert step_totals(None) is None and step_totals({}) is None


def test_the_worker_load_accumulates_them_across_steps() -> None:
    from vllm.v1.metrics.stats import SchedulerStats

    load = Load()
    logger = stat_logger_for(load)(None)
    logger.record(SchedulerStats(kv_connector_stats=one_step()), None)
    producer = NixlKVConnectorStats()
    producer.record_kv_expired_req()
    logger.record(SchedulerStats(kv_connector_stats=producer.to_dict()), None)
    logger.record(SchedulerStats(kv_connector_stats=one_step()), None)
    assert (load.kv_transfers, load.kv_bytes) == (4, 8 * 2**20)
    assert (load.kv_transfer_failures, load.kv_leases_expired) == (4, 1)
    assert abs(load.kv_transfer_seconds - 0.004) < 1e-12
    # GB/s as the GPU script computes it from /metrics: 8 MiB in 4 ms.
    assert round(load.kv_bytes / load.kv_transfer_seconds / 1e9, 3) == 2.097
