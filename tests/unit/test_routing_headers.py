"""The routing headers of a generation, on and off (``routing_headers`` setting)."""

from __future__ import annotations

from types import SimpleNamespace

from gateway.generation import Generation


def generation(headers_on: bool, prefill: object) -> object:
    return SimpleNamespace(
        _settings=SimpleNamespace(routing_headers=headers_on),
        prefill=prefill,
        decode=SimpleNamespace(worker_id="decode-0"),
    )


def test_headers_name_both_workers_or_local() -> None:
    on = Generation.routing_headers(generation(True, SimpleNamespace(worker_id="prefill-1")))  # type: ignore[arg-type]
    assert on == {"x-pdserve-prefill-worker": "prefill-1", "x-pdserve-decode-worker": "decode-0"}
    local = Generation.routing_headers(generation(True, None))  # type: ignore[arg-type]
    assert local["x-pdserve-prefill-worker"] == "local"


def test_headers_can_be_turned_off() -> None:
    assert Generation.routing_headers(generation(False, None)) == {}  # type: ignore[arg-type]
