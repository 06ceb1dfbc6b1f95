"""``pdserve bench kv`` end to end at a small size: real transfer processes with and without
the block tags, the raw socket, every pull checked byte for byte (``Pair.check``)."""

from __future__ import annotations

import math

from kv_transfer.bench import bench_size


def test_bench_kv_measures_the_connector_the_unchecked_baseline_and_the_raw_socket() -> None:
    row = bench_size(1.0, repeat=3)
    assert row["blocks"] == 1 and row["mb"] > 0.9
    for name in ("connector_gbps", "raw_gbps", "unchecked_gbps", "ratio"):
        assert row[name] > 0, name
    assert math.isfinite(row["mac_cost"]) and row["mac_cost"] < 1
