"""The gateway's public gRPC API (pdserve.v1.Generation) and its grpc.health.v1 service."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.bench.fake_worker import DEFAULT_PIECES, KV_BYTES_PER_TOKEN, FakeDecode
from protos.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.helpers import chat_ids, dead_address, gateway_cluster, served_name, tokenizer

CHAT = generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(role="user", content="Hi!")])


async def _generate(
    target: str, request: generate_pb2.GenerateRequest, request_id: str = ""
) -> tuple[list[generate_pb2.GenerateResponse], dict[str, str]]:
    metadata = (("x-request-id", request_id),) if request_id else ()
    async with grpc.aio.insecure_channel(target) as channel:
        call = generate_pb2_grpc.GenerationStub(channel).Generate(
            request, metadata=metadata, timeout=10
        )
        responses = [r async for r in call]
        initial = {k: str(v) for k, v in (await call.initial_metadata()) or ()}
    return responses, initial


async def test_generate_chat_streams_tokens_then_final() -> None:
    request = generate_pb2.GenerateRequest(
        model=served_name(), chat=CHAT, params=common_pb2.SamplingParams(temperature=0.5)
    )
    async with gateway_cluster() as c:
        responses, initial = await _generate(c.grpc_target, request, request_id="grpc-req-1")
        prefill_address = c.gateway.settings.prefill_workers[0]
        decode_address = c.gateway.settings.decode_workers[0]
    assert initial["x-request-id"] == "grpc-req-1"
    *tokens, final = responses
    assert [t for r in tokens for t in r.token_ids] == [t for t, _ in DEFAULT_PIECES]
    assert "".join(r.text for r in tokens) == "".join(text for _, text in DEFAULT_PIECES)
    assert all(not r.finish_reason for r in tokens)
    assert final.finish_reason == "stop" and not final.token_ids
    ids = chat_ids([{"role": "user", "content": "Hi!"}])
    assert final.usage.prompt_tokens == len(ids)
    assert final.usage.completion_tokens == len(DEFAULT_PIECES)
    assert final.usage.cached_tokens == 3
    assert final.prefill_worker == prefill_address
    assert final.decode_worker == decode_address
    assert final.transfer.kv_bytes_received == (len(ids) - 1) * KV_BYTES_PER_TOKEN
    assert final.transfer.kv_blocks_received == (len(ids) + 15) // 16
    assert c.decode is not None and c.prefill is not None
    assert c.decode.seen.requests[0].request_id == c.prefill.seen.requests[0].request_id
    assert "grpc-req-1" not in c.decode.seen.requests[0].request_id
    assert list(c.prefill.seen.requests[0].prompt_token_ids) == ids
    assert c.prefill.seen.requests[0].params.temperature == 0.5


async def test_generate_text_and_token_ids_local_path() -> None:
    ids = tokenizer().encode_text("Count to three:")
    async with gateway_cluster(prefill=None) as c:
        by_text, _ = await _generate(
            c.grpc_target, generate_pb2.GenerateRequest(text="Count to three:")
        )
        by_ids, _ = await _generate(
            c.grpc_target,
            generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=ids),
                params=common_pb2.SamplingParams(max_tokens=2),
            ),
        )
    assert by_text[-1].prefill_worker == "local"
    assert by_text[-1].transfer.kv_bytes_received == 0
    assert by_ids[-1].finish_reason == "length" and by_ids[-1].usage.completion_tokens == 2
    assert c.decode is not None
    sent = [list(r.prompt_token_ids) for r in c.decode.seen.requests]
    assert sent == [ids, ids]


async def test_list_models_and_health() -> None:
    async with gateway_cluster() as c, grpc.aio.insecure_channel(c.grpc_target) as channel:
        models = await generate_pb2_grpc.GenerationStub(channel).ListModels(
            generate_pb2.ListModelsRequest(), timeout=5
        )
        health = health_pb2_grpc.HealthStub(channel)
        overall = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        generation = await health.Check(
            health_pb2.HealthCheckRequest(service="pdserve.v1.Generation"), timeout=5
        )
    assert [(m.id, m.max_model_len) for m in models.models] == [(served_name(), 2048)]
    assert overall.status == health_pb2.HealthCheckResponse.SERVING
    assert generation.status == health_pb2.HealthCheckResponse.SERVING


async def test_generation_not_serving_without_decode_worker() -> None:
    async with (
        gateway_cluster(decode=None, extra_decode=[dead_address()]) as c,
        grpc.aio.insecure_channel(c.grpc_target) as channel,
    ):
        await asyncio.sleep(0.05)  # health is set from a pool listener task
        status = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="pdserve.v1.Generation"), timeout=5
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _generate(c.grpc_target, generate_pb2.GenerateRequest(text="hi"))
    assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        (generate_pb2.GenerateRequest(model="nope", text="hi"), grpc.StatusCode.NOT_FOUND),
        (generate_pb2.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT),
        (
            generate_pb2.GenerateRequest(text="hi", params=common_pb2.SamplingParams(top_p=2.0)),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            generate_pb2.GenerateRequest(text="hi", params=common_pb2.SamplingParams(logprobs=21)),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
    ],
)
async def test_generate_errors_are_status_codes(
    request_: generate_pb2.GenerateRequest, code: grpc.StatusCode
) -> None:
    async with gateway_cluster() as c:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _generate(c.grpc_target, request_)
    assert err.value.code() == code
    assert err.value.details()


async def test_grpc_client_cancel_aborts_workers() -> None:
    decode = FakeDecode(delay_s=0.05)
    decode.pieces = [(100 + i, f" w{i}") for i in range(200)]
    async with gateway_cluster(decode=decode) as c, grpc.aio.insecure_channel(c.grpc_target) as ch:
        call = generate_pb2_grpc.GenerationStub(ch).Generate(
            generate_pb2.GenerateRequest(text="go"), timeout=10
        )
        async for _ in call:
            break
        call.cancel()
        await asyncio.wait_for(decode.cancelled.wait(), 5)
        await asyncio.wait_for(decode.seen.aborted.wait(), 5)
        assert c.prefill is not None
        await asyncio.wait_for(c.prefill.seen.aborted.wait(), 5)
