"""Mutual TLS between the gateway and a worker's gRPC server (``pdserve.rpc.tls``).

The worker server runs in its own process, built as a real worker builds it
(``GrpcServer`` with the deployment secret from ``PDSERVE_SECRET_FILE`` and the identity
from ``PDSERVE_TLS_DIR``, the fake prefill servicer in place of the engine's). It prints a
line for every call that reaches grpc's handlers (its auth interceptor, which sees every
call, health checks included), so a test can tell a call refused at the TLS handshake from
one refused later. The certificates are made by ``pdserve.rpc.ca``, as ``pdserve up`` makes
them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kv_transfer.auth import load_secret
from pdserve.rpc import tls as rpc_tls
from pdserve.rpc.auth import call_metadata
from pdserve.rpc.ca import Authority, write_set
from pdserve.rpc.client import RpcCallError
from pdserve.rpc.secret import SECRET_FILE_ENV, write_new
from prefill_service.client import PrefillClient
from protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc

SERVER = """
import asyncio
import sys
from pdserve.bench.fake_worker import FakePrefill
from pdserve.rpc import auth
from pdserve.rpc.secret import deployment_secret
from pdserve.rpc.server import GrpcServer, stop_event_on_signals
from pdserve.rpc.tls import deployment_tls
from pdserve.worker.server import PREFILL_SERVICE
from protos.v1 import worker_pb2_grpc

seen = auth.AuthInterceptor.intercept_service

async def intercept(self, continuation, details):
    print("call", details.method, flush=True)
    return await seen(self, continuation, details)

auth.AuthInterceptor.intercept_service = intercept

async def main():
    stop = stop_event_on_signals()
    prefill = FakePrefill(record=False)
    add = worker_pb2_grpc.add_PrefillWorkerServicer_to_server
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    server = GrpcServer("127.0.0.1", port, [lambda s: add(prefill, s)], [PREFILL_SERVICE],
                        deployment_secret(), worker_id="prefill-0", tls=deployment_tls())
    await server.start()
    print(server.port, flush=True)
    await stop.wait()
    await server.stop(0)

asyncio.run(main())
"""
PREFILL = "/pdserve.v1.PrefillWorker/Prefill"
HEALTH = "/grpc.health.v1.Health/Check"


@dataclass
class Worker:
    port: int
    secret: bytes
    identity: rpc_tls.TlsIdentity  # the gateway's: a certificate of the worker's CA
    calls: list[str] = field(default_factory=list)  # methods that reached grpc's handlers

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_for_call(self, method: str, timeout_s: float = 10.0) -> list[str]:
        """The calls seen up to and including the first of ``method``."""
        deadline = time.monotonic() + timeout_s
        while method not in self.calls:
            assert time.monotonic() < deadline, f"no call of {method}: {self.calls}"
            time.sleep(0.01)
        return self.calls[: self.calls.index(method) + 1]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The deployment's set (worker, gateway) and another CA's "gateway"."""
    ours = write_set(tmp_path_factory.mktemp("tls"), ["prefill-0", "gateway"])
    theirs = write_set(tmp_path_factory.mktemp("other-tls"), ["gateway"])
    return {"worker": ours["prefill-0"], "gateway": ours["gateway"], "other": theirs["gateway"]}


@pytest.fixture
def worker(tmp_path: Path, certs: dict[str, Path]) -> Iterator[Worker]:
    with serve(tmp_path, certs["worker"], certs["gateway"]) as found:
        yield found


@contextlib.contextmanager
def serve(tmp_path: Path, worker_tls: Path, gateway_tls: Path, port: int = 0) -> Iterator[Worker]:
    """The worker process with the identity in ``worker_tls`` (on ``port``, 0: a free one) and
    the secret in ``tmp_path`` (made by the first worker there); its ``identity`` is
    ``gateway_tls``'s."""
    path = tmp_path / "secret"
    if not path.exists():
        write_new(path)
    env = {**os.environ, SECRET_FILE_ENV: str(path), rpc_tls.TLS_DIR_ENV: str(worker_tls)}
    process = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(port)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.strip().isdigit(), f"the worker did not start (exit {process.poll()})"
        secret = load_secret(path)
        assert secret is not None
        found = Worker(int(line), secret, rpc_tls.load(gateway_tls))
        stdout = process.stdout

        def read() -> None:
            for text in stdout:
                if text.startswith("call "):
                    found.calls.append(text.split()[1])

        threading.Thread(target=read, daemon=True).start()
        yield found
    finally:
        process.terminate()
        process.wait(10)


def secure(address: str, credentials: grpc.ChannelCredentials) -> grpc.aio.Channel:
    return grpc.aio.secure_channel(address, credentials, options=rpc_tls.CHANNEL_OPTIONS)


async def health(channel: grpc.aio.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    return int(reply.status)


async def authenticated_prefill(channel: grpc.aio.Channel, secret: bytes) -> None:
    request = worker_pb2.PrefillRequest(request_id="r-1", prompt_token_ids=[1, 2, 3])
    metadata = call_metadata(secret, "Prefill", request.SerializeToString())
    await worker_pb2_grpc.PrefillWorkerStub(channel).Prefill(request, metadata=metadata, timeout=5)


async def test_a_client_with_a_certificate_of_the_ca_is_served(worker: Worker) -> None:
    async with PrefillClient(worker.address, secret=worker.secret, tls=worker.identity) as client:
        caps = await client.capabilities()
        assert caps.worker_id
        reply = await client.prefill("r-1", [1, 2, 3], common_pb2.SamplingParams())
        assert reply.request_id == "r-1"
    assert worker.wait_for_call(PREFILL)[-1] == PREFILL


async def test_a_certificate_without_the_secret_is_refused(worker: Worker) -> None:
    """Defence in depth: past the handshake, the deployment secret's token is still checked."""
    async with PrefillClient(worker.address, secret=None, tls=worker.identity) as client:
        with pytest.raises(RpcCallError) as info:
            await client.prefill("r-1", [1, 2, 3], common_pb2.SamplingParams())
        assert info.value.code == "UNAUTHENTICATED"
    assert worker.wait_for_call(PREFILL) == [PREFILL], "it passed the handshake, not the token"


def _no_certificate(worker: Worker, certs: dict[str, Path]) -> grpc.aio.Channel:
    return secure(worker.address, grpc.ssl_channel_credentials(worker.identity.ca))


def _another_cas_certificate(worker: Worker, certs: dict[str, Path]) -> grpc.aio.Channel:
    # Trusts the worker's CA, presents a certificate (with the internal name) of another CA.
    other = rpc_tls.load(certs["other"])
    return secure(worker.address, grpc.ssl_channel_credentials(worker.identity.ca,
                                                                other.key, other.cert))  # fmt: skip


def _plain_text(worker: Worker, certs: dict[str, Path]) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(worker.address)


@pytest.mark.parametrize(
    "dial", [_no_certificate, _another_cas_certificate, _plain_text],
    ids=["no-certificate", "another-ca", "plain-text"],
)  # fmt: skip
async def test_clients_without_a_certificate_of_the_ca_are_refused_at_the_handshake(
    worker: Worker, certs: dict[str, Path], dial: object
) -> None:
    """Not even a health check (open to everyone inside TLS) or a call with a valid token
    reaches grpc's handlers: the connection ends in the handshake."""
    async with dial(worker, certs) as channel:  # type: ignore[operator]
        for call in (health(channel), authenticated_prefill(channel, worker.secret)):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
    # A call that does get through, after the refused ones: it is the first the server saw.
    async with secure(worker.address, worker.identity.channel_credentials()) as channel:
        assert await health(channel) == health_pb2.HealthCheckResponse.SERVING
    assert worker.wait_for_call(HEALTH) == [HEALTH]


async def test_the_gateway_refuses_a_server_of_another_ca(
    worker: Worker, certs: dict[str, Path]
) -> None:
    """A client trusting only another CA does not talk to the worker (nor hand it a token)."""
    other = rpc_tls.load(certs["other"])
    async with PrefillClient(worker.address, secret=worker.secret, tls=other) as client:
        with pytest.raises(RpcCallError) as info:
            await client.capabilities(timeout=5)
        assert info.value.code == "UNAVAILABLE"
    await asyncio.sleep(0.2)
    assert worker.calls == []


def test_a_server_certificate_without_the_internal_name_is_refused(tmp_path: Path) -> None:
    identity = rpc_tls.load(Authority().issue("prefill-0").write(tmp_path))
    assert rpc_tls.SERVER_NAME in identity.names
    # As one issued by other means for its host name only would read.
    with pytest.raises(ValueError, match=rpc_tls.SERVER_NAME):
        replace(identity, names=("prefill-0",)).server_credentials()


def _copy_identity(source: Path, target: Path, files: tuple[str, ...] = ()) -> None:
    """Rewrite ``target``'s files (all, or ``files``) with ``source``'s, in place, as a renewal
    does."""
    for name in files or (rpc_tls.CA_FILE, rpc_tls.CERT_FILE, rpc_tls.KEY_FILE):
        (target / name).write_bytes((source / name).read_bytes())


async def _health_with(worker: Worker, identity: rpc_tls.TlsIdentity) -> int:
    """Health through a new connection of its own (no subchannel shared with earlier ones)."""
    options = [*rpc_tls.CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
    credentials = identity.channel_credentials()
    async with grpc.aio.secure_channel(worker.address, credentials, options=options) as channel:
        return await health(channel)


async def test_a_renewed_identity_serves_new_connections_without_a_restart(tmp_path: Path) -> None:
    """The worker's identity files rewritten in place (a Secret renewed by cert-manager, here
    with a new CA so that the old and new identities cannot be confused) serve the next
    handshake; a set caught half written is not taken, the last whole one serves on."""
    old = write_set(tmp_path / "old", ["prefill-0", "gateway"])
    new = write_set(tmp_path / "new", ["prefill-0", "gateway"])
    live = tmp_path / "live"
    live.mkdir()
    _copy_identity(old["prefill-0"], live)
    serving = health_pb2.HealthCheckResponse.SERVING
    with serve(tmp_path, live, old["gateway"]) as worker:
        assert await _health_with(worker, rpc_tls.load(old["gateway"])) == serving
        _copy_identity(new["prefill-0"], live)
        renewed = rpc_tls.load(new["gateway"])
        assert await _health_with(worker, renewed) == serving
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _health_with(worker, rpc_tls.load(old["gateway"]))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        # Half a renewal: a certificate of the old CA beside the new key. Not taken.
        _copy_identity(old["prefill-0"], live, (rpc_tls.CERT_FILE,))
        with pytest.raises(ValueError, match="is not the key of"):
            rpc_tls.load(live)
        assert await _health_with(worker, renewed) == serving
        # The rest of it (the old CA and key): taken at the next handshake.
        _copy_identity(old["prefill-0"], live)
        assert await _health_with(worker, rpc_tls.load(old["gateway"])) == serving


async def test_a_running_gateway_dials_with_its_renewed_identity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CA rotated under a running gateway: the worker restarts with a certificate of the new
    CA, and the gateway's client of it, whose identity files were rewritten meanwhile, dials
    the next call with the new identity (a client still trusting only the old CA fails the
    handshake with the new worker)."""
    monkeypatch.setattr(rpc_tls, "CLIENT_CHECK_S", 0.0)  # look at every call
    old = write_set(tmp_path / "old", ["prefill-0", "gateway"])
    new = write_set(tmp_path / "new", ["prefill-0", "gateway"])
    worker_live, gateway_live = tmp_path / "worker", tmp_path / "gateway"
    for live, name in ((worker_live, "prefill-0"), (gateway_live, "gateway")):
        live.mkdir()
        _copy_identity(old[name], live)
    with serve(tmp_path, worker_live, gateway_live) as worker:
        client = PrefillClient(worker.address, secret=worker.secret, tls=rpc_tls.load(gateway_live))
        first = await client.prefill("r-1", [1, 2, 3], common_pb2.SamplingParams())
        assert first.request_id == "r-1"
        port = worker.port
    try:
        _copy_identity(new["prefill-0"], worker_live)
        _copy_identity(new["gateway"], gateway_live)
        with serve(tmp_path, worker_live, gateway_live, port) as worker:
            # The client trusting only the old CA, as the gateway had before: refused.
            async with PrefillClient(
                worker.address, secret=worker.secret, tls=rpc_tls.load(old["gateway"])
            ) as stale:
                with pytest.raises(RpcCallError) as info:
                    await stale.capabilities(timeout=5)
                assert info.value.code == "UNAVAILABLE"
            reply = await client.prefill("r-2", [1, 2, 3], common_pb2.SamplingParams(), timeout=10)
            assert reply.request_id == "r-2"
            assert client.tls is not None and client.tls.cert == rpc_tls.load(new["gateway"]).cert
    finally:
        await client.close()
