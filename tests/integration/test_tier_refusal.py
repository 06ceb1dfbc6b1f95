"""A worker whose KV tier cannot start exits with the reason; it never serves without it.

The worker's start-up (``pdserve.worker.server.serve``, what ``pdserve decode`` runs) with an
engine whose start fails as the tier connector fails it (``TierUnavailable``,
tests/unit/test_tier_compat.py shows the connector raising it from LMCache's own failure): the
worker answers its health check NOT_SERVING meanwhile, then stops its gRPC server and returns
exit code 1, having logged why.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

import pytest

from decode_service.config import DecodeSettings
from kv_transfer.lmcache_tier import TierUnavailable
from pdserve.worker import engine as worker_engine
from pdserve.worker import server as worker_server
from tests.helpers import model_dir

REASON = (
    "the KV tier (LMCache) failed to start: UnsupportedKVCache: LMCache layerwise and blending "
    "modes need a GPU. Check the tier's settings (--kv-tier, --kv-tier-url) and that `make "
    "install` completed, or run with --kv-tier off"
)


async def test_a_worker_whose_tier_cannot_start_exits_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    bound: list[int] = []
    real_server = worker_server.GrpcServer

    class RecordedServer(real_server):  # type: ignore[misc,valid-type]
        async def start(self, *args: Any, **kw: Any) -> None:
            await super().start(*args, **kw)
            bound.append(self.port)

    def start_engine(settings: Any, model: str, **kw: Any) -> Any:
        assert settings.kv_tier == "cpu"
        raise TierUnavailable(REASON)

    monkeypatch.setattr(worker_server, "GrpcServer", RecordedServer)
    monkeypatch.setattr(worker_engine, "start_engine", start_engine)
    settings = DecodeSettings(host="127.0.0.1", port=0, model=model_dir(), kv_tier="cpu")
    with caplog.at_level(logging.ERROR):
        code = await worker_server.serve(
            settings, object(), lambda server: None, "pdserve.v1.DecodeWorker",
            lambda *args: pytest.fail("a service was made without an engine"),
        )  # fmt: skip
    assert code == 1
    (error,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert error.startswith("the vLLM engine failed to start: the KV tier (LMCache) failed")
    assert "--kv-tier off" in error
    (port,) = bound
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), 5):
        pass  # the gRPC server is gone
