"""The waterfall script: rows follow the span tree, and it draws a PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pdserve.telemetry.trace_waterfall import main, tree_order


def span(span_id: str, parent: str, start: int, service: str = "pdserve-gateway") -> dict[str, Any]:
    return {"service": service, "name": f"s{span_id}", "span_id": span_id,
            "parent_span_id": parent, "start_ns": start, "end_ns": start + 5_000_000,
            "attributes": {}}  # fmt: skip


def test_children_follow_their_parent_by_start_time() -> None:
    spans = [span("c2", "r", 30), span("r", "client", 0), span("g", "c1", 25), span("c1", "r", 20)]
    order = [(depth, s["span_id"]) for depth, s in tree_order(spans)]
    assert order == [(0, "r"), (1, "c1"), (2, "g"), (1, "c2")]


def test_it_draws_a_png(tmp_path: Path) -> None:
    spans = [span("r", "", 0), span("k", "r", 1_000_000, "pdserve-decode")]
    spans[1]["name"], spans[1]["attributes"] = "kv.pull", {"pdserve.kv.bytes": 2_000_000,
                                                         "pdserve.kv.blocks": 4}  # fmt: skip
    (tmp_path / "spans.json").write_text(json.dumps(spans))
    assert main([str(tmp_path / "spans.json"), str(tmp_path / "out.png")]) == 0
    assert (tmp_path / "out.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "empty.json").write_text("[]")
    assert main([str(tmp_path / "empty.json"), str(tmp_path / "x.png")]) == 2
