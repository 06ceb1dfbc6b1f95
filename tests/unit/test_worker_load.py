"""The worker's load report from vLLM's per-step scheduler statistics."""

from __future__ import annotations

from kv_transfer.lifecycle import LifecycleStats
from pdserve.worker.registration import Load, stat_logger_for


def step(logger: object, **stats: object) -> None:
    from vllm.v1.metrics.stats import SchedulerStats

    logger.record(SchedulerStats(**stats), None)  # type: ignore[attr-defined]


def test_each_step_updates_the_load_and_counts_engine_steps() -> None:
    load = Load()
    logger = stat_logger_for(load)(None)
    step(logger, num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.25,
         kv_connector_stats={"pinned_blocks": 5, "leases": 2})  # fmt: skip
    assert (load.running, load.waiting, load.kv_usage) == (2, 1, 0.25)
    assert (load.pinned_blocks, load.leases, load.engine_steps) == (5, 2, 1)
    step(logger, kv_connector_stats={"pinned_blocks": 0, "leases": 0})
    assert (load.pinned_blocks, load.leases, load.engine_steps) == (0, 0, 2)
    # a step without the connector's gauges (another connector) leaves them as they were
    load.pinned_blocks = 7
    step(logger)
    assert load.pinned_blocks == 7 and load.engine_steps == 3
    logger.record(None, None)  # no scheduler statistics: not an engine step
    assert load.engine_steps == 3


def test_lifecycle_stats_are_gauges_the_newest_wins() -> None:
    older = LifecycleStats(data={"pinned_blocks": 4, "leases": 1})
    newer = LifecycleStats(data={"pinned_blocks": 0, "leases": 0})
    assert older.aggregate(newer).reduce() == {"pinned_blocks": 0, "leases": 0}
    assert not newer.is_empty()  # zero is a value worth reporting
    assert LifecycleStats().is_empty()


def test_a_lending_worker_reports_its_cores_counters(tmp_path: object) -> None:
    from pathlib import Path

    from pdserve.worker.config import WorkerSettings
    from pdserve.worker.core_lending import Borrower, CoreTable, Lender
    from pdserve.worker.server import lending_counters

    path = str(Path(str(tmp_path)) / "cpu-lending")
    CoreTable.create(path, 2)
    table = CoreTable(path)
    for _ in range(3):  # a decode engine computes three steps on core 0 (never computed on)
        borrower = Borrower(table, home=1, cores=[0])
        assert borrower.step_begins() == 2
        borrower.step_ends()
    Lender(table, [1]).step_begins()  # core 1's owner, not counted for core 0's
    load = Load()
    lender = WorkerSettings.model_validate({"cpu_lending": path, "cpu_cores": "0"})
    lending_counters(lender, load)()
    assert (load.cpu_lent_steps, load.cpu_lend_wait_seconds, load.cpu_lend_reclaims) == (3, 0, 0)
    borrowing = WorkerSettings.model_validate(
        {"cpu_lending": path, "cpu_cores": "1", "cpu_borrow": "0"}
    )
    other = Load()
    lending_counters(borrowing, other)()  # a borrower lends nothing: nothing to report
    assert other.cpu_lent_steps == 0
