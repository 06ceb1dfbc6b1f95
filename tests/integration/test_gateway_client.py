"""The typed gRPC client (``pdserve.cli.client``), the ``pdserve generate`` / ``pdserve chat``
commands, and the gRPC API's auth, Tokenize, logprobs, saturation and deadlines."""

from __future__ import annotations

import asyncio
import json
import sys

import grpc
import httpx
import pytest

from pdserve.bench.fake_worker import DEFAULT_PIECES, FakeDecode
from pdserve.cli.client import GatewayCallError, GatewayClient
from protos.v1 import generate_pb2, generate_pb2_grpc
from tests.helpers import chat_ids, dead_address, gateway_cluster, served_name, tokenizer

ANSWER = "".join(text for _, text in DEFAULT_PIECES)
CHAT = [{"role": "user", "content": "Hi"}]


async def test_client_generate_tokenize_and_models() -> None:
    async with gateway_cluster() as c, GatewayClient(c.grpc_target) as client:
        text, last = await client.complete(text="Hello", max_tokens=4, temperature=0.0)
        pieces = [p async for p in client.generate(messages=CHAT, logprobs=1)]
        ids = await client.tokenize(messages=CHAT)
        models = await client.list_models()
        with pytest.raises(GatewayCallError) as missing:
            await client.complete(text="x", model="other")
        with pytest.raises(GatewayCallError) as empty:
            await client.complete(text="")
    assert text == ANSWER and last.finish_reason == "stop"
    assert last.usage is not None and last.usage.completion_tokens == 4
    assert [lp.token_id for p in pieces for lp in p.logprobs] == [t for t, _ in DEFAULT_PIECES]
    assert ids == chat_ids(CHAT)
    assert [m.id for m in models] == [served_name()]
    assert missing.value.code == "NOT_FOUND"
    assert empty.value.code == "INVALID_ARGUMENT"


async def test_grpc_tokenize_takes_the_tools_generate_takes() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    async with gateway_cluster() as c, grpc.aio.insecure_channel(c.grpc_target) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        request = generate_pb2.TokenizeRequest(tools_json=json.dumps(tools))
        request.chat.messages.add(role="user", content="Hi")
        reply = await stub.Tokenize(request)
        request.tools_json = "[not json"
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await stub.Tokenize(request)
    assert list(reply.token_ids) == chat_ids(CHAT, tools=tools)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tools_json" in (bad.value.details() or "")


async def test_grpc_api_keys_as_metadata() -> None:
    async with gateway_cluster(api_keys=["k1"]) as c:
        async with GatewayClient(c.grpc_target) as anonymous:
            with pytest.raises(GatewayCallError) as err:
                await anonymous.list_models()
            with pytest.raises(GatewayCallError):
                await anonymous.complete(text="x")
        async with GatewayClient(c.grpc_target, api_key="k1") as client:
            text, _ = await client.complete(text="x")
    assert err.value.code == "UNAUTHENTICATED"
    assert text == ANSWER


async def test_grpc_saturation_and_deadline() -> None:
    decode = FakeDecode(delay_s=0.5)
    async with (
        gateway_cluster(decode=decode, max_concurrent_requests=1) as c,
        GatewayClient(c.grpc_target) as client,
    ):
        slow = asyncio.ensure_future(client.complete(text="x"))
        await decode.started.wait()
        with pytest.raises(GatewayCallError) as busy:
            await client.complete(text="x")
        await slow
        with pytest.raises(GatewayCallError) as late:
            await client.complete(text="x", timeout_s=0.3)
        await asyncio.wait_for(decode.seen.aborted.wait(), 5)
    assert busy.value.code == "RESOURCE_EXHAUSTED"
    assert late.value.code == "DEADLINE_EXCEEDED"
    assert decode.seen.requests[-1].request_id in decode.seen.aborts


async def _run_cli(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "pdserve",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_generate_and_chat_commands() -> None:
    async with gateway_cluster() as c:
        code, out, err = await _run_cli("generate", "Hello", "--target", c.grpc_target, "--usage")
        assert code == 0, err
        assert out.strip() == ANSWER and "completion 4 tokens" in err
        code, out, err = await _run_cli("chat", "-m", "Hi", "--target", c.grpc_target)
        assert code == 0, err
        assert out.strip() == ANSWER
    code, out, err = await _run_cli("generate", "x", "--target", dead_address())
    assert code == 1
    assert "cannot reach the gateway" in err and "Traceback" not in err


async def test_grpc_final_message_hides_workers_when_routing_headers_are_off() -> None:
    for shown in (True, False):
        async with (
            gateway_cluster(routing_headers=shown) as c,
            GatewayClient(c.grpc_target) as client,
        ):
            _, last = await client.complete(text="Hello", max_tokens=2)
        assert bool(last.raw.prefill_worker) == bool(last.raw.decode_worker) == shown, last.raw


async def test_grpc_chat_options_render_the_chat_as_the_http_fields_do() -> None:
    """continue_final_message, add_generation_prompt, chat_template_kwargs and
    reasoning_effort reach the chat template from gRPC as from HTTP: the prefill worker gets
    the same ids, and Tokenize returns them."""
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I"}]
    fields = {
        "add_generation_prompt": False,
        "continue_final_message": True,
        "chat_template_kwargs": {"custom": 1},
        "reasoning_effort": "low",
    }
    options = generate_pb2.ChatTemplateOptions(
        add_generation_prompt=False,
        continue_final_message=True,
        chat_template_kwargs_json=json.dumps({"custom": 1}),
        reasoning_effort="low",
    )
    async with gateway_cluster() as c, grpc.aio.insecure_channel(c.grpc_target) as channel:
        async with httpx.AsyncClient(base_url=c.base_url) as http:
            answer = await http.post(
                "/v1/chat/completions", json={"messages": chat, "max_tokens": 2, **fields}
            )
        assert answer.status_code == 200, answer.text
        stub = generate_pb2_grpc.GenerationStub(channel)
        request = generate_pb2.GenerateRequest(chat_options=options)
        request.chat.messages.extend(generate_pb2.ChatMessage(**m) for m in chat)
        request.params.max_tokens = 2
        _ = [r async for r in stub.Generate(request)]
        tokenize = generate_pb2.TokenizeRequest(chat_options=options)
        tokenize.chat.messages.extend(generate_pb2.ChatMessage(**m) for m in chat)
        ids = list((await stub.Tokenize(tokenize)).token_ids)
        plain = generate_pb2.TokenizeRequest()
        plain.chat.messages.extend(generate_pb2.ChatMessage(**m) for m in chat)
        default_ids = list((await stub.Tokenize(plain)).token_ids)
        tokenize.chat_options.reasoning_effort = "extreme"
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await stub.Tokenize(tokenize)
    over_http, over_grpc = (list(r.prompt_token_ids) for r in c.prefill.seen.requests)
    assert over_grpc == over_http == ids
    assert default_ids != ids  # without the options the final message is closed
    assert tokenizer().decode(ids).endswith("Hello, I")
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "reasoning_effort" in (bad.value.details() or "")
