"""A KV connection dropped in the middle of a pull's blocks (real producer and consumer
transfer processes, a TCP proxy between them that closes the connection there)."""

from __future__ import annotations

from pathlib import Path

from kv_transfer import bench
from tests.integration.test_kv_integrity import FlipProxy
from tests.integration.test_kv_security import Agents, next_message, write_secret


def test_a_connection_dropped_mid_pull_fails_that_pull_only(tmp_path: Path) -> None:
    """The pull whose connection closed mid-blocks is reported once, failed, with the reason
    (the decode engine then computes the prompt itself and caches nothing of it); the prefill
    side ends the job and unpins its blocks; the next pull is exact."""
    agents = Agents(write_secret(tmp_path / "secret"))
    proxy = FlipProxy(agents.producer.port, cut=True)
    try:
        agents.serve("r1", [1, 2])
        agents.pull("r1", [1, 2], [3, 4], port=proxy.port)
        done = next_message(agents.consumer)
        assert proxy.flipped.is_set(), "the connection was not cut"
        assert done["op"] == "done" and done["req"] == "r1" and not done["ok"], done
        assert "peer closed the connection" in done["error"], done
        ended = next_message(agents.producer)  # no acknowledgement: the job failed
        assert ended["op"] == "finished" and ended["req"] == "r1", ended
        assert ended["reason"] == "error", ended
        agents.serve("r2", [1, 2])
        agents.pull("r2", [1, 2], [5, 6])
        assert next_message(agents.consumer)["ok"]
        src = bench.blocks_digest(agents.p_mem, agents.p_layout, [1, 2])
        assert bench.blocks_digest(agents.c_mem, agents.c_layout, [5, 6]) == src
    finally:
        proxy.close()
        agents.close()
