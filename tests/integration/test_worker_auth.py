"""Worker gRPC calls with the deployment secret: real grpc.aio servers and clients on loopback
(the worker servicer is a fake; the part under test is the server's auth interceptor and the
client's token)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_service.client import DecodeClient
from kv_transfer.auth import new_secret
from pdserve.bench.fake_worker import FakeDecode, FakePrefill
from pdserve.rpc.client import RpcCallError
from pdserve.rpc.server import GrpcServer
from prefill_service.client import PrefillClient
from protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc

SECRET = new_secret().encode()


async def serve(
    servicer: FakePrefill | FakeDecode, secret: bytes | None, worker_id: str = ""
) -> GrpcServer:
    if isinstance(servicer, FakePrefill):
        add, name = worker_pb2_grpc.add_PrefillWorkerServicer_to_server, "pdserve.v1.PrefillWorker"
    else:
        add, name = worker_pb2_grpc.add_DecodeWorkerServicer_to_server, "pdserve.v1.DecodeWorker"  # type: ignore[assignment]
    server = GrpcServer("127.0.0.1", 0, [lambda s: add(servicer, s)], [name], secret, worker_id)  # type: ignore[arg-type]
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
    from pdserve.rpc.auth import AUTH_METADATA, call_metadata, token

    server = await serve(FakePrefill(), SECRET)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = worker_pb2_grpc.PrefillWorkerStub(channel)
            body = worker_pb2.CapabilitiesRequest().SerializeToString()
            stolen = call_metadata(SECRET, "GetCapabilities", body)
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


async def test_a_token_bound_to_one_worker_does_not_open_another() -> None:
    from pdserve.rpc.auth import AUTH_METADATA

    prefill_a, prefill_b = FakePrefill(), FakePrefill()
    a = await serve(prefill_a, SECRET, worker_id="prefill-a")
    b = await serve(prefill_b, SECRET, worker_id="prefill-b")
    try:
        async with PrefillClient(f"127.0.0.1:{a.port}", secret=SECRET) as client:
            assert client.worker_id == ""
            await client.capabilities()  # worker A announces its id
            assert client.worker_id == "prefill-a"
            await client.prefill("r-1", [1, 2, 3], common_pb2.SamplingParams())
        recorded = prefill_a.seen.metadata[-1][AUTH_METADATA]
        assert recorded.endswith(".prefill-a")
        replay = ((AUTH_METADATA, recorded),)
        request = worker_pb2.PrefillRequest(request_id="r-2", prompt_token_ids=[1, 2])
        async with grpc.aio.insecure_channel(f"127.0.0.1:{b.port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await worker_pb2_grpc.PrefillWorkerStub(channel).Prefill(request, metadata=replay)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "another worker" in (info.value.details() or "")
        assert prefill_b.seen.requests == []
    finally:
        await a.stop(0)
        await b.stop(0)


async def test_a_recorded_token_does_not_carry_another_body() -> None:
    """A token and its body HMAC, recorded from a call, repeat that call and nothing else:
    another body is refused before it is deserialized or reaches the servicer."""
    from pdserve.rpc.auth import AUTH_METADATA, BODY_METADATA

    prefill = FakePrefill()
    server = await serve(prefill, SECRET, worker_id="prefill-a")
    try:
        async with PrefillClient(f"127.0.0.1:{server.port}", secret=SECRET) as client:
            await client.capabilities()
            await client.prefill("r-1", [1, 2, 3], common_pb2.SamplingParams())
        recorded = prefill.seen.metadata[-1]
        replay = (
            (AUTH_METADATA, recorded[AUTH_METADATA]),
            (BODY_METADATA, recorded[BODY_METADATA]),
        )
        same_call = prefill.seen.requests[-1]
        other = worker_pb2.PrefillRequest(request_id="r-2", prompt_token_ids=[9, 9, 9, 9])
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = worker_pb2_grpc.PrefillWorkerStub(channel)
            for metadata in (replay, replay[:1]):  # another body; no body HMAC at all
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Prefill(other, metadata=metadata)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "does not match its token" in (info.value.details() or "")
            assert [r.request_id for r in prefill.seen.requests] == ["r-1"]
            reply = await stub.Prefill(same_call, metadata=replay)  # the same call, repeated
            assert reply.request_id == "r-1"
    finally:
        await server.stop(0)


async def test_a_client_binds_only_to_an_announced_id_and_unbinds_when_refused() -> None:
    anonymous = await serve(FakeDecode(), SECRET)  # given no id: announces none (old workers)
    b = await serve(FakeDecode(), SECRET, worker_id="decode-b")
    try:
        async with DecodeClient(f"127.0.0.1:{anonymous.port}", secret=SECRET) as client:
            await client.capabilities()
            assert client.worker_id == ""
            assert [c async for c in client.decode("r-1", [1, 2], common_pb2.SamplingParams())]
        async with DecodeClient(f"127.0.0.1:{b.port}", secret=SECRET) as client:
            client.worker_id = "decode-a"  # as if decode-a had answered at this address before
            with pytest.raises(RpcCallError) as info:
                async for _ in client.decode("r-2", [1, 2], common_pb2.SamplingParams()):
                    pass
            assert info.value.code == "UNAUTHENTICATED"
            assert client.worker_id == ""  # unbound: the next call passes
            assert [c async for c in client.decode("r-3", [1, 2], common_pb2.SamplingParams())]
            await client.capabilities()
            assert client.worker_id == "decode-b"
            assert [c async for c in client.decode("r-4", [1, 2], common_pb2.SamplingParams())]
    finally:
        await anonymous.stop(0)
        await b.stop(0)


class CountingDecode(FakeDecode):
    """A fake decode worker that counts the Decode calls it serves at once (``peak``)."""

    serving = peak = 0

    async def Decode(self, request, context):  # type: ignore[no-untyped-def]
        self.serving += 1
        self.peak = max(self.peak, self.serving)
        try:
            async for chunk in super().Decode(request, context):
                yield chunk
        finally:
            self.serving -= 1


async def test_a_connection_has_at_most_the_bound_streams_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past the bound a call waits for a stream to end or (grpc's client racing the server's
    count) is refused UNAVAILABLE before it reaches the servicer."""
    from pdserve.rpc import server as rpc_server

    bound = [("grpc.max_concurrent_streams", 2) if k == "grpc.max_concurrent_streams" else (k, v)
             for k, v in rpc_server.WORKER_OPTIONS]  # fmt: skip
    monkeypatch.setattr(rpc_server, "WORKER_OPTIONS", bound)
    decode = CountingDecode(delay_s=0.2, tokens=[(1, "a"), (2, "b")])
    server = await serve(decode, SECRET)

    async def one(client: DecodeClient, i: int) -> str:
        try:
            async for _ in client.decode(f"r-{i}", [1, 2], common_pb2.SamplingParams()):
                pass
            return "OK"
        except RpcCallError as err:
            return err.code

    try:
        async with DecodeClient(f"127.0.0.1:{server.port}", secret=SECRET) as client:
            await client.capabilities()
            codes = await asyncio.gather(*(one(client, i) for i in range(6)))
        assert decode.peak == 2
        assert set(codes) <= {"OK", "UNAVAILABLE"} and codes.count("OK") >= 2, codes
        assert len(decode.seen.requests) == codes.count("OK")  # the refused ones never ran
    finally:
        await server.stop(0)
