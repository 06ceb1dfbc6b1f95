"""Worker gRPC calls with the deployment secret: real grpc.aio servers and clients on loopback
(the worker servicer is a fake; the part under test is the server's auth interceptor and the
client's token)."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_service.client import DecodeClient
from kv_transfer.auth import new_secret
from pdserve.bench.fake_worker import FakeDecode, FakePrefill
from pdserve.rpc.client import RpcCallError
from pdserve.rpc.server import GrpcServer
from prefill_service.client import PrefillClient
from protos.v1 import common_pb2, worker_pb2_grpc

SECRET = new_secret().encode()


async def serve(servicer: FakePrefill | FakeDecode, secret: bytes | None) -> GrpcServer:
    if isinstance(servicer, FakePrefill):
        add, name = worker_pb2_grpc.add_PrefillWorkerServicer_to_server, "pdserve.v1.PrefillWorker"
    else:
        add, name = worker_pb2_grpc.add_DecodeWorkerServicer_to_server, "pdserve.v1.DecodeWorker"  # type: ignore[assignment]
    server = GrpcServer("127.0.0.1", 0, [lambda s: add(servicer, s)], [name], secret)  # type: ignore[arg-type]
    await server.start()
    return server


async def test_calls_with_the_secret_are_served() -> None:
    server = await serve(FakePrefill(), SECRET)
    try:
        async with PrefillClient(f"127.0.0.1:{server.port}", secret=SECRET) as client:
            caps = await client.capabilities()
            assert caps.worker_id
            reply = await client.prefill("r-1", [1, 2, 3], common_pb2.SamplingParams())
            assert reply.request_id == "r-1"
    finally:
        await server.stop(0)


@pytest.mark.parametrize("secret", [None, new_secret().encode()], ids=["none", "wrong"])
async def test_calls_without_or_with_a_wrong_secret_are_refused(secret: bytes | None) -> None:
    prefill = FakePrefill()
    server = await serve(prefill, SECRET)
    decode_server = await serve(FakeDecode(), SECRET)
    try:
        async with PrefillClient(f"127.0.0.1:{server.port}", secret=secret) as client:
            for call in (
                client.capabilities(),
                client.prefill("r-1", [1, 2, 3], common_pb2.SamplingParams()),
                client.abort("r-1"),
            ):
                with pytest.raises(RpcCallError) as info:
                    await call
                assert info.value.code == "UNAUTHENTICATED", info.value
                assert "deployment secret" in info.value.details
        async with DecodeClient(f"127.0.0.1:{decode_server.port}", secret=secret) as client:
            with pytest.raises(RpcCallError) as info:
                async for _ in client.decode("r-2", [1, 2], common_pb2.SamplingParams()):
                    pass
            assert info.value.code == "UNAUTHENTICATED"
    finally:
        await server.stop(0)
        await decode_server.stop(0)


async def test_a_token_for_one_rpc_does_not_open_another() -> None:
    from pdserve.rpc.auth import AUTH_METADATA, token

    server = await serve(FakePrefill(), SECRET)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = worker_pb2_grpc.PrefillWorkerStub(channel)
            from protos.v1 import worker_pb2

            stolen = ((AUTH_METADATA, token(SECRET, "GetCapabilities")),)
            await stub.GetCapabilities(worker_pb2.CapabilitiesRequest(), metadata=stolen)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Abort(worker_pb2.AbortRequest(request_id="x"), metadata=stolen)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            stale = ((AUTH_METADATA, token(SECRET, "Abort", now=1_000_000)),)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Abort(worker_pb2.AbortRequest(request_id="x"), metadata=stale)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await server.stop(0)


async def test_health_checks_stay_open() -> None:
    server = await serve(FakeDecode(), SECRET)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(0)
