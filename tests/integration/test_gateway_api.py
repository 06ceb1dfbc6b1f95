"""The OpenAI API surface beyond the basics, against fake workers: n and prompt lists,
echo, logprobs, structured outputs, tools, tokenize/detokenize, API keys, 429, OpenAPI."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import httpx
import openai
import pytest

from pdserve.bench.fake_worker import DEFAULT_PIECES, FakeDecode
from protos.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.helpers import (
    REQUESTS,
    GatedDecode,
    chat_ids,
    counted,
    gateway_cluster,
    parse_sse,
    served_name,
    tokenizer,
)

ANSWER = "".join(text for _, text in DEFAULT_PIECES)
CHAT = [{"role": "user", "content": "Hi"}]


async def test_n_and_prompt_lists_fan_out_one_prefill_per_prompt() -> None:
    async with gateway_cluster() as c:
        client = c.openai()
        response = await client.completions.with_raw_response.create(
            model=served_name(), prompt=["One", "Two words"], n=2, seed=5
        )
        body = response.parse()
        await client.close()
    assert [ch.index for ch in body.choices] == [0, 1, 2, 3]
    assert all(ch.text == ANSWER for ch in body.choices)
    assert c.decode is not None and c.prefill is not None
    request_id = response.headers["x-request-id"]
    ids = {r.request_id for r in c.decode.seen.requests}
    assert len(ids) == 4 and not any(request_id in i for i in ids)  # the gateway's own, each
    # one prefill per prompt: its first choice; the others decode on the same worker from
    # its cache (no hand-off)
    prefilled = {r.request_id for r in c.prefill.seen.requests}
    assert len(prefilled) == 2 and prefilled < ids
    handed = {r.request_id for r in c.decode.seen.requests if r.HasField("kv_transfer_params")}
    assert handed == prefilled
    seeds = sorted(r.params.seed for r in c.decode.seen.requests)
    assert seeds == [5, 5, 6, 6]  # choice j of a prompt samples with seed + j
    prompt_tokens = len(tokenizer().encode_text("One")) + len(tokenizer().encode_text("Two words"))
    assert body.usage is not None
    assert body.usage.prompt_tokens == prompt_tokens  # each prompt once
    assert body.usage.completion_tokens == 4 * len(DEFAULT_PIECES)


async def test_chat_n_streams_every_choice_with_role_first_and_finish_last() -> None:
    async with gateway_cluster() as c, httpx.AsyncClient(base_url=c.base_url) as http:
        body = {"messages": CHAT, "n": 3, "stream": True, "stream_options": {"include_usage": True}}
        response = await http.post("/v1/chat/completions", json=body)
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for index in range(3):
        mine = [
            ch["choices"][0]
            for ch in chunks
            if ch["choices"] and ch["choices"][0]["index"] == index
        ]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(m["delta"].get("content", "") for m in mine) == ANSWER
        assert mine[-1]["finish_reason"] == "stop"
        assert not any(m["finish_reason"] for m in mine[:-1])
    assert chunks[-1]["usage"]["completion_tokens"] == 3 * len(DEFAULT_PIECES)


async def test_completion_logprobs_and_echo() -> None:
    async with gateway_cluster() as c:
        client = c.openai()
        plain = await client.completions.create(
            model=served_name(), prompt="Say it", logprobs=2, max_tokens=4
        )
        echoed = await client.completions.create(
            model=served_name(), prompt="Say it", logprobs=1, echo=True, max_tokens=4
        )
        echo_only = await client.completions.create(
            model=served_name(), prompt="Say it", echo=True, max_tokens=4
        )
        await client.close()
    lp = plain.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert "".join(lp.tokens) == ANSWER
    assert lp.token_logprobs == [-0.5] * 4
    assert lp.text_offset == [0, 5, 6, 12]
    assert lp.top_logprobs is not None and len(lp.top_logprobs[0]) == 2
    prompt_ids = tokenizer().encode_text("Say it")
    e = echoed.choices[0]
    assert e.text == "Say it" + ANSWER
    assert e.logprobs is not None and e.logprobs.token_logprobs is not None
    assert len(e.logprobs.token_logprobs) == len(prompt_ids) + 4
    assert e.logprobs.token_logprobs[0] is None  # the first prompt token has none
    assert echo_only.choices[0].text == "Say it" + ANSWER
    assert c.decode is not None and c.prefill is not None
    # echo + logprobs needs prompt logprobs: the decode worker computed the prompt itself
    echo_request = c.decode.seen.requests[1]
    assert echo_request.params.prompt_logprobs == 1
    assert not echo_request.HasField("kv_transfer_params")
    assert len(c.prefill.seen.requests) == 2


async def test_echo_with_max_tokens_0_returns_the_prompt_alone() -> None:
    """The scoring call of evaluation harnesses: as vLLM, one token is generated and only the
    prompt (with its logprobs) comes back; without echo, max_tokens 0 is a 400."""
    body = {"prompt": "Say it", "max_tokens": 0, "echo": True, "logprobs": 1}
    async with gateway_cluster() as c, httpx.AsyncClient(base_url=c.base_url) as http:
        whole = await http.post("/v1/completions", json=body)
        stream = await http.post("/v1/completions", json={**body, "stream": True})
        refused = await http.post("/v1/completions", json={"prompt": "Say it", "max_tokens": 0})
    prompt_ids = tokenizer().encode_text("Say it")
    choice = whole.json()["choices"][0]
    assert choice["text"] == "Say it"
    assert len(choice["logprobs"]["token_logprobs"]) == len(prompt_ids)
    chunks = [e for e in parse_sse(stream.text)[:-1] if e["choices"]]
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == "Say it"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert c.decode is not None
    assert [r.params.max_tokens for r in c.decode.seen.requests] == [1, 1]
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


async def test_a_token_with_no_text_yet_still_streams_its_chunk() -> None:
    """A token that ends inside a UTF-8 character has an empty text delta; the stream sends
    its chunk anyway, as vLLM does, so a client sees every token when it is generated."""
    pieces = [(101, "a"), (102, ""), (103, "\u00e9"), (104, "b")]
    cluster = gateway_cluster(decode=FakeDecode(tokens=pieces))
    async with cluster as c, httpx.AsyncClient(base_url=c.base_url) as http:
        completion = await http.post(
            "/v1/completions",
            json={"prompt": "Hi", "max_tokens": 4, "stream": True, "ignore_eos": True},
        )
        chat = await http.post(
            "/v1/chat/completions",
            json={"messages": CHAT, "max_tokens": 4, "stream": True, "ignore_eos": True},
        )
    texts = [ch["choices"][0]["text"] for ch in parse_sse(completion.text)[:-1] if ch["choices"]]
    assert texts[:4] == ["a", "", "\u00e9", "b"]
    deltas = [ch["choices"][0]["delta"] for ch in parse_sse(chat.text)[:-1] if ch["choices"]]
    assert [d.get("content") for d in deltas[1:5]] == ["a", "", "\u00e9", "b"]  # after the role


async def test_chat_logprobs_stream_and_whole() -> None:
    async with gateway_cluster() as c:
        client = c.openai()
        reply = await client.chat.completions.create(
            model=served_name(), messages=CHAT, logprobs=True, top_logprobs=2
        )
        stream = await client.chat.completions.create(
            model=served_name(), messages=CHAT, logprobs=True, stream=True
        )
        streamed = [chunk async for chunk in stream]
        await client.close()
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    assert [e.token for e in content] == [t for _, t in DEFAULT_PIECES]
    assert all(len(e.top_logprobs) == 2 for e in content)
    assert content[0].bytes == list(b"Hello")
    tokens = [
        e.token
        for ch in streamed
        if ch.choices and ch.choices[0].logprobs and ch.choices[0].logprobs.content
        for e in ch.choices[0].logprobs.content
    ]
    assert tokens == [t for _, t in DEFAULT_PIECES]


async def test_structured_outputs_and_tools_reach_the_workers() -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    async with gateway_cluster() as c:
        client = c.openai()
        await client.chat.completions.create(
            model=served_name(),
            messages=CHAT,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        )
        await client.chat.completions.create(
            model=served_name(), messages=CHAT, response_format={"type": "json_object"}
        )
        await client.completions.create(
            model=served_name(),
            prompt="Pick",
            extra_body={"structured_outputs": {"choice": ["a", "b"]}, "logit_bias": {"7": 5}},
        )
        await client.chat.completions.create(
            model=served_name(),
            messages=CHAT,
            tools=tools,
            tool_choice="none",  # templated, no call asked for: served without a parser
        )
        await client.close()
    assert c.decode is not None
    first, second, third, fourth = (r.params for r in c.decode.seen.requests)
    assert json.loads(first.structured_output.json_schema) == schema
    assert second.structured_output.json_object
    # vLLM's check of a choice makes it xgrammar's grammar, which the engine is given
    assert third.structured_output.grammar == 'root ::= "a" | "b"'
    assert dict(third.logit_bias) == {7: 5.0}
    assert not fourth.HasField("structured_output")
    with_tools = chat_ids(CHAT, tools=tools)
    assert list(c.decode.seen.requests[3].prompt_token_ids) == with_tools


async def test_tokenize_and_detokenize() -> None:
    async with gateway_cluster() as c, httpx.AsyncClient(base_url=c.base_url) as http:
        text = await http.post("/tokenize", json={"prompt": "Hello world"})
        chat = await http.post("/tokenize", json={"messages": CHAT})
        back = await http.post("/detokenize", json={"tokens": text.json()["tokens"]})
        neither = await http.post("/tokenize", json={})
        bad = await http.post("/detokenize", json={"tokens": [-1]})
    assert text.json()["tokens"] == tokenizer().encode_text("Hello world")
    assert text.json()["count"] == len(text.json()["tokens"])
    assert text.json()["max_model_len"] == 2048
    assert chat.json()["tokens"] == chat_ids(CHAT)
    assert back.json()["prompt"].endswith("Hello world")
    assert neither.status_code == 400 and bad.status_code == 400


async def test_api_keys_http(tmp_path) -> None:  # type: ignore[no-untyped-def]
    keys = tmp_path / "keys"
    keys.write_text("# comment\nfile-key\n\n")
    async with gateway_cluster(api_keys=["env-key"], api_keys_file=str(keys)) as c:
        async with httpx.AsyncClient(base_url=c.base_url) as http:
            none = await http.get("/v1/models")
            wrong = await http.get("/v1/models", headers={"authorization": "Bearer nope"})
            env = await http.get("/v1/models", headers={"authorization": "Bearer env-key"})
            health = await http.get("/health")
            metrics = await http.get("/metrics")
            tok = await http.post("/tokenize", json={"prompt": "x"})
        client = openai.AsyncOpenAI(base_url=c.base_url + "/v1", api_key="file-key", max_retries=0)
        reply = await client.completions.create(model=served_name(), prompt="x")
        bad = openai.AsyncOpenAI(base_url=c.base_url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad.completions.create(model=served_name(), prompt="x")
        await client.close()
        await bad.close()
    for response in (none, wrong, tok):
        assert response.status_code == 401, response.text
        assert response.json()["error"]["type"] == "authentication_error"
    assert env.status_code == 200 and health.status_code == 200 and metrics.status_code == 200
    assert reply.choices[0].text == ANSWER


async def test_saturated_gateway_answers_429_with_retry_after() -> None:
    async with (
        gateway_cluster(decode=GatedDecode(), max_concurrent_requests=1, retry_after_s=2) as c,
        httpx.AsyncClient(base_url=c.base_url, timeout=60) as http,
    ):
        body = {"prompt": "x", "max_tokens": 4}
        slow = asyncio.ensure_future(http.post("/v1/completions", json=body))
        while not c.decode or not c.decode.seen.requests:  # the first one holds the slot
            await asyncio.sleep(0.01)
        refused = await http.post("/v1/completions", json=body)
        assert isinstance(c.decode, GatedDecode)
        c.decode.gate.set()  # only now the first one may finish
        assert (await slow).status_code == 200
        after = await http.post("/v1/completions", json=body)
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "2"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert after.status_code == 200  # the slot came back


async def test_a_burst_cannot_pass_max_concurrent_requests() -> None:
    """All requests arrive before any is tokenized: the limit still holds (the slot is taken
    at admission, before the awaits of tokenization and routing)."""
    async with (
        gateway_cluster(decode=GatedDecode(), max_concurrent_requests=2) as c,
        httpx.AsyncClient(base_url=c.base_url, timeout=60) as http,
    ):
        body = {"prompt": "x " * 200, "max_tokens": 4}
        burst = [asyncio.ensure_future(http.post("/v1/completions", json=body)) for _ in range(8)]
        assert isinstance(c.decode, GatedDecode)
        # each request is either answered (refused) or held at the decode worker's gate
        while sum(f.done() for f in burst) + len(c.decode.seen.requests) < len(burst):
            await asyncio.sleep(0.01)
        c.decode.gate.set()
        codes = sorted(r.status_code for r in await asyncio.gather(*burst))
        metrics = (await http.get("/metrics")).text
    assert codes == [200, 200] + [429] * 6, codes
    assert len(c.decode.seen.requests) == 2
    assert 'pdserve_gateway_rejected_total{reason="gateway_limit"} 6.0' in metrics


async def test_every_choice_takes_a_slot_and_a_burst_of_n_cannot_pass_the_limit() -> None:
    """n = 2 takes two slots at once: with a limit of 5, two of four such requests fit."""
    async with (
        gateway_cluster(decode=GatedDecode(free=1), max_concurrent_requests=5) as c,
        httpx.AsyncClient(base_url=c.base_url, timeout=60) as http,
    ):
        body = {"prompt": "x " * 200, "max_tokens": 4, "n": 2}
        burst = [asyncio.ensure_future(http.post("/v1/completions", json=body)) for _ in range(4)]
        assert isinstance(c.decode, GatedDecode)
        # each request is either answered (refused) or has both choices at the decode worker
        while 2 * sum(f.done() for f in burst) + len(c.decode.seen.requests) < 2 * len(burst):
            await asyncio.sleep(0.01)
        assert c.gateway.service is not None and c.gateway.service.active == 4
        c.decode.gate.set()
        codes = sorted(r.status_code for r in await asyncio.gather(*burst))
        metrics = (await http.get("/metrics")).text
    assert codes == [200, 200, 429, 429], codes
    assert len(c.decode.seen.requests) == 4
    assert 'pdserve_gateway_rejected_total{reason="gateway_limit"} 2.0' in metrics
    assert counted(metrics, REQUESTS, endpoint="completions", outcome="ok", path="sibling") == 2


async def test_openapi_describes_every_route_and_errors() -> None:
    async with gateway_cluster() as c, httpx.AsyncClient(base_url=c.base_url) as http:
        doc = (await http.get("/openapi.json")).json()
    paths = doc["paths"]
    for path in (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses",
        "/tokenize",
        "/detokenize",
        "/health",
        "/metrics",
    ):
        assert path in paths, path
    chat = paths["/v1/chat/completions"]["post"]
    assert {"400", "401", "404", "429", "503"} <= set(chat["responses"])
    schemas = doc["components"]["schemas"]
    assert {"ChatCompletionRequest", "CompletionRequest", "ErrorResponse"} <= set(schemas)
    responses = paths["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]
    assert responses["schema"]["$ref"] == "#/components/schemas/ResponsesRequest"
    assert "ResponsesRequest" in schemas


async def test_disconnect_mid_stream_aborts_every_choice_on_every_worker() -> None:
    decode = FakeDecode(delay_s=0.05)
    decode.pieces = [(100 + i, f" w{i}") for i in range(200)]
    async with gateway_cluster(decode=decode) as c:
        async with httpx.AsyncClient(base_url=c.base_url) as http:
            body = {"prompt": "x", "n": 3, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as response:
                request_id = response.headers["x-request-id"]
                lines = response.aiter_lines()
                for _ in range(6):
                    await anext(lines)
        expected = sorted(r.request_id for r in decode.seen.requests)
        assert len(set(expected)) == 3 and request_id not in expected
        assert c.prefill is not None
        for _ in range(100):
            if len(decode.seen.aborts) == 3 and len(c.prefill.seen.aborts) == 1:
                break
            await asyncio.sleep(0.05)
        assert c.gateway.service is not None and c.gateway.service.active == 0
        prefilled = [r.request_id for r in c.prefill.seen.requests]  # the first choice only
    assert sorted(decode.seen.aborts) == expected
    assert c.prefill.seen.aborts == prefilled and prefilled[0] in expected


async def test_a_generation_config_gives_the_workers_its_defaults(tmp_path: Any) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.25, "top_k": 3}))
    async with (
        gateway_cluster(generation_config=str(tmp_path)) as c,
        httpx.AsyncClient(base_url=c.base_url) as http,
    ):
        body = {"prompt": "x", "max_tokens": 2}
        assert (await http.post("/v1/completions", json=body)).status_code == 200
        body = {**body, "temperature": 0.9}
        assert (await http.post("/v1/completions", json=body)).status_code == 200
        async with grpc.aio.insecure_channel(c.grpc_target) as channel:
            request = generate_pb2.GenerateRequest(
                text="x", params=common_pb2.SamplingParams(max_tokens=2)
            )
            replies = [r async for r in generate_pb2_grpc.GenerationStub(channel).Generate(request)]
            assert replies[-1].finish_reason
    assert c.decode is not None
    first, second, over_grpc = (r.params for r in c.decode.seen.requests)
    assert first.temperature == pytest.approx(0.25) and first.top_k == 3
    assert second.temperature == pytest.approx(0.9) and second.top_k == 3
    assert over_grpc.temperature == pytest.approx(0.25) and over_grpc.top_k == 3


async def test_return_token_ids_streamed_and_whole() -> None:
    """vLLM's return_token_ids: the generated ids per choice (per chunk when streamed) and the
    prompt's ids (a completion choice's first chunk; a chat response's top level)."""
    generated = [t for t, _ in DEFAULT_PIECES]
    prompt = tokenizer().encode_text("Say it")
    chat_prompt = chat_ids(CHAT)
    async with gateway_cluster() as c, httpx.AsyncClient(base_url=c.base_url) as http:
        base = {"max_tokens": len(generated), "return_token_ids": True}
        text = (await http.post("/v1/completions", json={**base, "prompt": "Say it"})).json()
        chat = (await http.post("/v1/chat/completions", json={**base, "messages": CHAT})).json()
        text_stream = await http.post(
            "/v1/completions", json={**base, "prompt": "Say it", "stream": True}
        )
        chat_stream = await http.post(
            "/v1/chat/completions", json={**base, "messages": CHAT, "stream": True}
        )
        plain = (await http.post("/v1/completions", json={"prompt": "Say it"})).json()
        echoed = await http.post("/v1/completions", json={**base, "prompt": "x", "echo": True})
    assert text["choices"][0]["token_ids"] == generated
    assert text["choices"][0]["prompt_token_ids"] == prompt
    assert chat["choices"][0]["token_ids"] == generated
    assert chat["prompt_token_ids"] == chat_prompt
    chunks = [e for e in parse_sse(text_stream.text)[:-1] if e["choices"]]
    assert [t for ch in chunks for t in ch["choices"][0]["token_ids"]] == generated
    assert chunks[0]["choices"][0]["prompt_token_ids"] == prompt
    assert not any("prompt_token_ids" in ch["choices"][0] for ch in chunks[1:])
    events = [e for e in parse_sse(chat_stream.text)[:-1] if e["choices"]]
    assert events[0]["prompt_token_ids"] == chat_prompt
    assert [t for e in events[1:] for t in e["choices"][0]["token_ids"]] == generated
    assert "token_ids" not in plain["choices"][0]
    assert echoed.status_code == 400 and echoed.json()["error"]["param"] == "return_token_ids"


async def test_continuous_usage_stats_count_every_chunk() -> None:
    body = {
        "messages": CHAT,
        "max_tokens": len(DEFAULT_PIECES),
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    async with gateway_cluster() as c, httpx.AsyncClient(base_url=c.base_url) as http:
        response = await http.post("/v1/chat/completions", json=body)
    prompt = len(chat_ids(CHAT))
    chunks = [e for e in parse_sse(response.text)[:-1] if e["choices"]]
    counts = [ch["usage"]["completion_tokens"] for ch in chunks]
    assert counts == [*range(len(DEFAULT_PIECES) + 1), len(DEFAULT_PIECES)]  # role, tokens, finish
    assert all(ch["usage"]["prompt_tokens"] == prompt for ch in chunks)
    assert all(
        ch["usage"]["total_tokens"] == prompt + ch["usage"]["completion_tokens"] for ch in chunks
    )
