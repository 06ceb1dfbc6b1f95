"""The gateway's per-worker gauges on ``/metrics``: what the workers report, for exactly the
workers in the pool."""

from __future__ import annotations

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import GatewaySettings
from gateway.pool import WorkerPool
from gateway.worker_metrics import WorkerCollector
from pdserve.bench.fake_worker import FakeDecode, FakePrefill
from pdserve.kvindex.interfaces import WorkerRecord
from protos.v1 import worker_pb2
from tests.helpers import dead_address, gateway_cluster


def gauges(text: str) -> dict[tuple[str, str, str], float]:
    """(metric, role, worker) -> value of every pdserve_gateway_worker_* sample."""
    return {
        (s.name, s.labels["role"], s.labels["worker"]): s.value
        for family in text_string_to_metric_families(text)
        if family.name.startswith("pdserve_gateway_worker_")
        for s in family.samples
    }


async def test_workers_reported_load_is_exported_per_worker() -> None:
    prefill, decode = FakePrefill(), FakeDecode()
    prefill.caps.load.CopyFrom(
        worker_pb2.WorkerLoad(running=1, kv_usage=0.5, pinned_blocks=3, leases=1, engine_steps=9)
    )
    decode.caps.load.CopyFrom(worker_pb2.WorkerLoad(running=2, waiting=4, pinned_blocks=2))
    async with gateway_cluster(prefill=prefill, decode=decode) as c, httpx.AsyncClient() as http:
        values = gauges((await http.get(c.base_url + "/metrics")).text)
    p, d = ("prefill", "fake-role_prefill"), ("decode", "fake-role_decode")
    assert values[("pdserve_gateway_worker_healthy", *p)] == 1.0
    assert values[("pdserve_gateway_worker_pinned_blocks", *p)] == 3.0
    assert values[("pdserve_gateway_worker_leases", *p)] == 1.0
    assert values[("pdserve_gateway_worker_kv_usage", *p)] == 0.5
    assert values[("pdserve_gateway_worker_engine_steps", *p)] == 9.0
    assert values[("pdserve_gateway_worker_running", *d)] == 2.0
    assert values[("pdserve_gateway_worker_waiting", *d)] == 4.0
    assert values[("pdserve_gateway_worker_pinned_blocks", *d)] == 2.0
    assert values[("pdserve_gateway_worker_in_flight", *d)] == 0.0


async def test_nixl_transfer_counters_are_exported_per_worker() -> None:
    """vLLM's NIXL statistics as a decode worker reports them (pdserve.worker.nixl_stats)."""
    decode = FakeDecode()
    decode.caps.load.CopyFrom(
        worker_pb2.WorkerLoad(
            kv_transfers=3, kv_bytes=3 * 2**20, kv_transfer_seconds=0.25, kv_transfer_failures=1
        )
    )
    async with gateway_cluster(decode=decode) as c, httpx.AsyncClient() as http:
        text = (await http.get(c.base_url + "/metrics")).text
    values = gauges(text)
    d = ("decode", "fake-role_decode")
    assert values[("pdserve_gateway_worker_kv_transfers_total", *d)] == 3.0
    assert values[("pdserve_gateway_worker_kv_transfer_bytes_total", *d)] == 3 * 2**20
    assert values[("pdserve_gateway_worker_kv_transfer_seconds_total", *d)] == 0.25
    assert values[("pdserve_gateway_worker_kv_transfer_failures_total", *d)] == 1.0
    assert "# TYPE pdserve_gateway_worker_kv_transfer_bytes_total counter" in text
    p = ("prefill", "fake-role_prefill")
    assert values[("pdserve_gateway_worker_kv_leases_expired_total", *p)] == 0.0


async def test_core_lending_counters_are_exported_per_worker() -> None:
    """The core lending counters a prefill worker reports (pdserve.worker.core_lending)."""
    prefill = FakePrefill()
    prefill.caps.load.CopyFrom(
        worker_pb2.WorkerLoad(cpu_lent_steps=40, cpu_lend_wait_seconds=0.5, cpu_lend_reclaims=1)
    )
    async with gateway_cluster(prefill=prefill) as c, httpx.AsyncClient() as http:
        values = gauges((await http.get(c.base_url + "/metrics")).text)
    p = ("prefill", "fake-role_prefill")
    assert values[("pdserve_gateway_worker_cpu_lent_steps_total", *p)] == 40.0
    assert values[("pdserve_gateway_worker_cpu_lend_wait_seconds_total", *p)] == 0.5
    assert values[("pdserve_gateway_worker_cpu_lend_reclaims_total", *p)] == 1.0


async def test_lora_counters_and_the_heartbeats_resident_adapters() -> None:
    """A worker's LoRA requests and the loads they needed (pdserve.worker.service), exported
    per worker; the adapters its heartbeat lists as resident are those the pool's worker holds
    (routing prefers them: gateway.routing.prefix)."""
    pool = WorkerPool(GatewaySettings(control_timeout_s=0.5))
    registry = CollectorRegistry()
    registry.register(WorkerCollector(lambda: [*pool.prefill, *pool.decode]))
    address = dead_address()
    load = {"lora_requests": 10.0, "lora_loads": 3.0}
    record = WorkerRecord("d", "decode", address, "e1", "m", load=load, loras=["a", "b"])
    try:
        await pool.reconcile([record])
        values = gauges(generate_latest(registry).decode())
        assert values[("pdserve_gateway_worker_lora_requests_total", "decode", address)] == 10.0
        assert values[("pdserve_gateway_worker_lora_loads_total", "decode", address)] == 3.0
        (worker,) = pool.decode
        assert worker.holds_lora("a") and worker.holds_lora("b") and not worker.holds_lora("c")
        record.loras = ["c"]  # "a" and "b" were evicted, "c" loaded
        await pool.reconcile([record])
        assert worker.holds_lora("c") and not worker.holds_lora("a")
    finally:
        await pool.close()


async def test_a_worker_that_leaves_the_pool_is_no_longer_exported() -> None:
    pool = WorkerPool(GatewaySettings(control_timeout_s=0.5))
    registry = CollectorRegistry()
    registry.register(WorkerCollector(lambda: [*pool.prefill, *pool.decode]))
    gone, stays = dead_address(), dead_address()
    record = WorkerRecord("p-gone", "prefill", gone, "e1", "m", load={"pinned_blocks": 4.0})
    other = WorkerRecord("d-stays", "decode", stays, "e2", "m", load={"leases": 2.0})
    try:
        await pool.reconcile([record, other])
        values = gauges(generate_latest(registry).decode())
        # never answered: named by address, unhealthy, its heartbeat's load
        assert values[("pdserve_gateway_worker_pinned_blocks", "prefill", gone)] == 4.0
        assert values[("pdserve_gateway_worker_healthy", "prefill", gone)] == 0.0
        assert values[("pdserve_gateway_worker_leases", "decode", stays)] == 2.0
        await pool.reconcile([other])  # the prefill worker's heartbeat expired
        values = gauges(generate_latest(registry).decode())
        assert not [key for key in values if key[2] == gone]
        assert values[("pdserve_gateway_worker_leases", "decode", stays)] == 2.0
    finally:
        await pool.close()
