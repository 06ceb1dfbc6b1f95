"""The connector's ``kv_connector_extra_config`` reaches the transfer process: every timeout
and bound of ``AgentConfig`` can be set there, and a bad value is a clear error."""

from __future__ import annotations

import pytest

from kv_transfer.agent_context import AgentConfig, agent_settings
from kv_transfer.layout import Layout


def test_every_bound_and_timeout_reaches_the_transfer_process() -> None:
    extra = {
        "kv_port": 16000, "kv_bind_host": "10.0.0.5", "max_peer_connections": 2,
        "idle_timeout_s": "60", "max_connections": 512, "handshake_timeout_s": 2.5,
        "max_unauthenticated": 32, "max_unauthenticated_per_address": 4, "max_parallel": 3,
        "lease_s": 12, "connect_timeout_s": 1.5, "kv_host": "ignored-here",
    }  # fmt: skip
    settings = agent_settings(extra, producer=True, rank=1, secret_file="/s")
    config = AgentConfig("producer", Layout((), (), 0), (), {}, **settings)
    assert (config.port, config.bind_host, config.secret_file) == (16001, "10.0.0.5", "/s")
    assert (config.max_peer_connections, config.idle_timeout_s, config.max_connections) == (
        2, 60.0, 512,
    )  # fmt: skip
    assert (config.handshake_timeout_s, config.max_unauthenticated) == (2.5, 32)
    assert (config.max_unauthenticated_per_address, config.max_parallel) == (4, 3)
    assert (config.lease_s, config.connect_timeout_s) == (12.0, 1.5)
    assert agent_settings({}, producer=False, rank=0, secret_file="")["port"] == 0
    assert AgentConfig("consumer", Layout((), (), 0), (), {}).max_peer_connections == 4


@pytest.mark.parametrize("value", ["many", -1, 2.5, None])
def test_a_bad_value_names_the_setting(value: object) -> None:
    with pytest.raises(ValueError, match="max_peer_connections"):
        agent_settings({"max_peer_connections": value}, producer=False, rank=0, secret_file="")
