"""The refresh loop's pass spreads the workers' health checks over the interval in slices."""

from __future__ import annotations

import asyncio
import time

from gateway import pool as pool_module
from gateway.config import GatewaySettings
from gateway.pool import REFRESH_SLICE, DecodeWorker, PrefillWorker, WorkerPool


def _pool(n: int) -> WorkerPool:
    return WorkerPool(
        GatewaySettings(
            model="m",
            prefill_workers=[f"10.0.0.{i}:1" for i in range(n // 2)],
            decode_workers=[f"10.0.1.{i}:1" for i in range(n // 2)],
        )
    )


async def test_a_pass_checks_every_worker_once_a_slice_at_a_time() -> None:
    pool = _pool(64)
    starts: dict[str, float] = {}
    running, most = 0, 0

    async def check(worker: PrefillWorker | DecodeWorker) -> None:
        nonlocal running, most
        starts[worker.address] = time.monotonic()
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.01)
        running -= 1

    pool._refresh_one = check  # type: ignore[method-assign]
    try:
        began = time.monotonic()
        await pool.paced_refresh(0.4)
        assert sorted(starts) == sorted(w.address for w in [*pool.prefill, *pool.decode])
        assert most <= REFRESH_SLICE
        # 8 slices, one every 0.05 s: the last starts near the end of the interval
        assert max(starts.values()) - began >= 0.3
        assert min(starts.values()) - began < 0.2
    finally:
        await pool.close()


async def test_a_hung_check_delays_no_later_slice() -> None:
    pool = _pool(4 * REFRESH_SLICE)
    starts: dict[str, float] = {}
    hung = pool.prefill[0]

    async def check(worker: PrefillWorker | DecodeWorker) -> None:
        starts[worker.address] = time.monotonic()
        await asyncio.sleep(1.0 if worker is hung else 0.0)

    pool._refresh_one = check  # type: ignore[method-assign]
    try:
        began = time.monotonic()
        await pool.paced_refresh(0.2)
        assert len(starts) == 4 * REFRESH_SLICE
        assert max(starts.values()) - began < 0.5  # every slice on its time, not after 1 s
    finally:
        await pool.close()


async def test_a_worker_dropped_before_its_slice_is_skipped() -> None:
    pool = _pool(4 * REFRESH_SLICE)
    checked: list[str] = []
    gone = pool.decode[-1]

    async def check(worker: PrefillWorker | DecodeWorker) -> None:
        checked.append(worker.address)
        if worker is pool.prefill[0]:
            pool.decode.remove(gone)

    pool._refresh_one = check  # type: ignore[method-assign]
    try:
        await pool.paced_refresh(0.1)
        assert gone.address not in checked and len(checked) == 4 * REFRESH_SLICE - 1
    finally:
        pool.decode.append(gone)  # closed with the others
        await pool.close()


async def test_the_refresh_loop_paces_its_passes() -> None:
    pool = _pool(2)
    passes: list[float] = []

    async def paced(interval_s: float) -> None:
        passes.append(interval_s)
        await asyncio.sleep(interval_s)

    pool.paced_refresh = paced  # type: ignore[method-assign]
    pool.settings = GatewaySettings(model="m", health_interval_s=0.02)
    task = asyncio.ensure_future(pool._refresh_loop())
    await asyncio.sleep(0.1)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert len(passes) >= 2 and set(passes) == {0.02}
    assert pool_module.REFRESH_SLICE == REFRESH_SLICE
