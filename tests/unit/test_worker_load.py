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
