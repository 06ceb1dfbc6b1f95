"""Anthropic's Messages API (``POST /v1/messages``, ``gateway.anthropic_api``) against fake
workers: vLLM's conversion of the request and of the answer (whole and streamed), tool use by
vLLM's hermes parser, Anthropic's error shape. What the real model answers, compared with
``vllm serve``, is the e2e conformance battery's (tests/e2e/conformance.py)."""

from __future__ import annotations

import json
from typing import Any

import httpx

from pdserve.bench.fake_worker import DEFAULT_PIECES
from tests.helpers import chat_ids, gateway_cluster, served_name
from tests.integration.test_gateway_tools import CALL, HERMES, TWO_CALLS, scripted

ANSWER = "".join(text for _, text in DEFAULT_PIECES)
HI = [{"role": "user", "content": "Hi"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def events_of(body: str) -> list[tuple[str, dict[str, Any]]]:
    """Anthropic's SSE: (event name, data) per event, the framing checked."""
    assert body.endswith("\n\n"), body[-50:]
    out = []
    for block in body[:-2].split("\n\n"):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        payload = json.loads(data[len("data: ") :])
        assert payload["type"] == name[len("event: ") :]
        out.append((payload["type"], payload))
    return out


async def _messages(base_url: str, headers: dict[str, str] | None = None, **body: Any) -> Any:
    request = {"model": served_name(), "max_tokens": 16, "messages": HI, **body}
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        return await http.post("/v1/messages", json=request, headers=headers)


async def test_a_message_whole_and_streamed() -> None:
    async with gateway_cluster() as c:
        whole = await _messages(c.base_url, system="Be brief.")
        streamed = await _messages(c.base_url, system="Be brief.", stream=True)
    assert whole.status_code == 200, whole.text
    message = whole.json()
    prompt = [{"role": "system", "content": "Be brief."}, *HI]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["content"] == [{"type": "text", "text": ANSWER}]
    assert message["stop_reason"] == "end_turn"
    usage = message["usage"]  # Anthropic's: the cache reads apart from the input tokens
    read = usage.get("cache_read_input_tokens", 0)
    assert usage["input_tokens"] + read == len(chat_ids(prompt))
    assert usage["output_tokens"] == len(DEFAULT_PIECES)
    assert whole.headers["x-request-id"]
    events = events_of(streamed.text)
    kinds = [kind for kind, _ in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    text = "".join(e["delta"]["text"] for kind, e in events if kind == "content_block_delta")
    assert text == ANSWER
    assert events[-2][1]["delta"]["stop_reason"] == "end_turn"


async def test_count_tokens_is_the_prompt_the_workers_get() -> None:
    async with gateway_cluster() as c, httpx.AsyncClient(base_url=c.base_url) as http:
        body = {"model": served_name(), "system": "Be brief.", "messages": HI}
        counted = await http.post("/v1/messages/count_tokens", json=body)
        whole = await _messages(c.base_url, system="Be brief.")
        unknown = await http.post("/v1/messages/count_tokens", json={**body, "model": "x"})
    prompt = [{"role": "system", "content": "Be brief."}, *HI]
    assert counted.json()["input_tokens"] == len(chat_ids(prompt))
    assert c.prefill is not None
    assert counted.json()["input_tokens"] == len(c.prefill.seen.requests[-1].prompt_token_ids)
    assert whole.status_code == 200
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"


async def test_tool_use_by_the_parser_whole_and_streamed() -> None:
    async with gateway_cluster(decode=scripted(TWO_CALLS), **HERMES) as c:
        whole = await _messages(c.base_url, tools=[WEATHER], max_tokens=64)
        streamed = await _messages(c.base_url, tools=[WEATHER], max_tokens=64, stream=True)
    message = whole.json()
    uses = [(b["name"], b["input"]) for b in message["content"] if b["type"] == "tool_use"]
    assert uses == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert all(b["id"] for b in message["content"] if b["type"] == "tool_use")
    assert message["stop_reason"] == "tool_use"
    events = events_of(streamed.text)
    inputs: dict[int, str] = {}
    for kind, event in events:
        if kind == "content_block_delta" and event["delta"]["type"] == "input_json_delta":
            inputs[event["index"]] = inputs.get(event["index"], "") + event["delta"]["partial_json"]
    assert [json.loads(v) for v in inputs.values()] == [{"city": "Paris"}, {"city": "Rome"}]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


async def test_tool_choice_any_forces_the_call() -> None:
    async with gateway_cluster(decode=scripted(CALL.format("Paris")), **HERMES) as c:
        forced = await _messages(
            c.base_url, tools=[WEATHER], tool_choice={"type": "any"}, max_tokens=64
        )
    assert c.decode is not None
    params = c.decode.seen.requests[-1].params
    assert params.structured_output.structural_tag  # the call is forced on the decode worker
    blocks = forced.json()["content"]
    assert [(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"] == [
        ("get_weather", {"city": "Paris"})
    ]


async def test_a_call_that_is_no_message_is_vllms_400() -> None:
    """Arguments that are not a JSON object (a tool without ``strict`` leaves them free) cannot
    be a ``tool_use`` block: vLLM's converter refuses them and vllm serve answers 400."""
    loose = '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>'
    async with (
        gateway_cluster(decode=scripted(loose), **HERMES) as c,
        httpx.AsyncClient(base_url=c.base_url, timeout=60) as http,
    ):
        body = {"model": served_name(), "max_tokens": 64, "messages": HI}
        refused = await http.post("/v1/messages", json={**body, "tools": [WEATHER]})
        after = await http.post("/v1/messages", json=body)  # the same connection
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["type"] == "invalid_request_error"
    assert after.status_code == 200


async def test_errors_have_anthropics_shape() -> None:
    async with gateway_cluster(api_keys=["k"]) as c:
        key = {"authorization": "Bearer k"}
        unauthenticated = await _messages(c.base_url)
        async with httpx.AsyncClient(base_url=c.base_url) as http:
            no_max_tokens = await http.post(
                "/v1/messages", json={"model": served_name(), "messages": HI}, headers=key
            )
            not_json = await http.post("/v1/messages", content=b"{", headers=key)
        unknown_model = await _messages(c.base_url, key, model="nope")
        chat = await _messages(c.base_url, key, temperature=-1)
    expected = [
        (unauthenticated, 401, "authentication_error"),
        (no_max_tokens, 400, "invalid_request_error"),
        (not_json, 400, "invalid_request_error"),
        (unknown_model, 404, "not_found_error"),
        (chat, 400, "invalid_request_error"),
    ]
    for response, status, kind in expected:
        assert response.status_code == status, response.text
        body = response.json()
        assert body["type"] == "error" and body["error"]["type"] == kind, body
        assert body["error"]["message"]
    assert "max_tokens" in no_max_tokens.json()["error"]["message"]
