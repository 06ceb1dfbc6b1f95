"""Per-worker gauges and counters of the gateway's ``/metrics``, read from the worker pool at
scrape time.

Labels: ``role`` ("prefill" or "decode") and ``worker`` (the worker's own name, its address
until it has answered). Exported for exactly the workers in the pool now: one that left the
registry disappears from the next scrape. Values are the worker's latest report (its
heartbeat through the registry, else its last capabilities), except ``in_flight``, which is
this gateway's own count of its requests on the worker.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LABELS = ["role", "worker"]


class WorkerView(Protocol):
    """What the gauges read of a pool worker (``gateway.pool.Worker``)."""

    healthy: bool
    in_flight: int

    @property
    def role_name(self) -> str: ...

    @property
    def worker_id(self) -> str: ...

    def reported(self, name: str) -> float: ...


# (metric suffix, help, how to read it); reported fields are the WorkerLoad field names.
GAUGES: Sequence[tuple[str, str, Callable[[WorkerView], float]]] = (
    ("healthy", "1 while the gateway routes to the worker, else 0.",
     lambda w: 1.0 if w.healthy else 0.0),
    ("running", "Requests the worker's engine is running.", lambda w: w.reported("running")),
    ("waiting", "Requests queued in the worker's engine.", lambda w: w.reported("waiting")),
    ("in_flight", "This gateway's requests on the worker now.", lambda w: float(w.in_flight)),
    ("kv_usage", "Fraction of the worker's KV cache in use (0..1).",
     lambda w: w.reported("kv_usage")),
    ("pinned_blocks", "KV blocks the worker holds for transfers (prefill: pinned for decode "
     "workers; decode: allocated for pulls in progress).",
     lambda w: w.reported("pinned_blocks")),
    ("leases", "Requests holding such blocks (prefill: pinned hand-offs; decode: hand-offs "
     "not pulled yet or being pulled).", lambda w: w.reported("leases")),
    ("engine_steps", "Engine iterations of the worker since it started.",
     lambda w: w.reported("engine_steps")),
)  # fmt: skip


# Counters of the worker's own (since it started; a restart starts them over, which
# Prometheus' rate() handles): vLLM's NIXL transfer statistics (pdserve.worker.nixl_stats).
# With pdserve's connector they stay 0: its transfers are per request, in
# pdserve_gateway_kv_transfer_bytes / _seconds.
COUNTERS: Sequence[tuple[str, str, str]] = (
    ("kv_transfers", "kv_transfers", "KV transfers the worker's NIXL connector finished "
     "(decode workers: reads from prefill workers)."),
    ("kv_transfer_bytes", "kv_bytes", "Bytes of KV cache those transfers moved."),
    ("kv_transfer_seconds", "kv_transfer_seconds", "Seconds those transfers took (NIXL's "
     "own measurement); bytes / seconds is the KV throughput."),
    ("kv_transfer_failures", "kv_transfer_failures", "Failed NIXL transfers, handshakes and "
     "notifications."),
    ("kv_leases_expired", "kv_leases_expired", "Prefill workers: hand-offs whose KV blocks "
     "were freed at the end of their lease, unread."),
    ("cpu_lent_steps", "cpu_lent_steps", "Prefill workers on the CPU (core lending): decode "
     "engine steps computed on the worker's cores while its engine had nothing to compute."),
    ("cpu_lend_wait_seconds", "cpu_lend_wait_seconds", "Prefill workers on the CPU: seconds "
     "its engine waited for a decode engine's step on its cores to end."),
    ("cpu_lend_reclaims", "cpu_lend_reclaims", "Prefill workers on the CPU: times the worker "
     "took its cores back from a decode engine that was gone or too slow."),
    ("lora_requests", "lora_requests", "Requests the worker ran with a LoRA adapter."),
    ("lora_loads", "lora_loads", "Those of them whose adapter the worker's engine had to load "
     "first (not resident in its LoRA cache); / lora_requests: the share that needed a load."),
)  # fmt: skip


class WorkerCollector(Collector):
    def __init__(self, workers: Callable[[], Iterable[WorkerView]]) -> None:
        self.workers = workers

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        workers = list(self.workers())
        for suffix, text, read in GAUGES:
            family = GaugeMetricFamily(f"pdserve_gateway_worker_{suffix}", text, labels=LABELS)
            for worker in workers:
                family.add_metric([worker.role_name, worker.worker_id], read(worker))
            yield family
        for suffix, field, text in COUNTERS:
            counter = CounterMetricFamily(f"pdserve_gateway_worker_{suffix}", text, labels=LABELS)
            for worker in workers:
                counter.add_metric([worker.role_name, worker.worker_id], worker.reported(field))
            yield counter
