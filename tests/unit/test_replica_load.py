"""What a gateway replica routes on: a worker's load counts the other gateways' requests in
flight, and each replica's prefix picker starts its tie-break rotation at its own place."""

from __future__ import annotations

from typing import Any

from gateway.config import GatewaySettings
from gateway.metrics import GatewayMetrics
from gateway.pool import WorkerPool
from gateway.routing.interfaces import RouteRequest
from gateway.routing.prefix import PrefixPicker
from gateway.routing.registry import PickerContext
from tests.unit.test_prefix_picker import StandIn

REPLICAS = 20  # all starting at one place by chance: 4 x (1/4)^20


def always(p: Any, d: Any) -> bool:
    return True


async def test_a_workers_load_counts_every_gateways_requests() -> None:
    settings = GatewaySettings(model="unused", decode_workers=["10.0.0.1:1", "10.0.0.2:1"])
    pool = WorkerPool(settings)
    try:
        one, two = pool.decode
        one.in_flight = 2
        assert pool.local_in_flight() == {"10.0.0.1:1": 2}  # workers with none left out
        pool.set_peer_in_flight({"10.0.0.1:1": 3, "10.0.0.2:1": 1, "gone:1": 9})
        assert (one.load(), two.load()) == (5.0, 1.0)
        pool.set_peer_in_flight({})  # the other gateways went quiet (or aged out)
        assert (one.load(), two.load()) == (2.0, 0.0)
    finally:
        await pool.close()


async def test_replicas_start_their_tie_rotation_at_different_places() -> None:
    decode = [StandIn(f"d{i}", "decode") for i in range(4)]
    settings = GatewaySettings(model="unused")
    request = RouteRequest("r", "m", list(range(10)))
    first = set()
    for _ in range(REPLICAS):  # the prefix picker: the one replicas sharing Redis use
        picker = PrefixPicker(PickerContext(settings, GatewayMetrics(), None))
        first.add((await picker.pick(request, [], decode, always)).decode.worker_id)
    # Identical views, identical idle workers: the replicas' first picks still differ.
    assert len(first) > 1
