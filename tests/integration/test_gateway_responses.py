"""OpenAI's Responses API (``POST /v1/responses``, ``gateway.responses_api``) against fake
workers: vLLM's renderer renders it, the gateway generates it (one prefill, one decode), vLLM's
Responses serving answers it, whole and streamed, with vLLM's hermes parser's function calls
and logprobs; pdserve stores no responses. What the real model answers, compared with
``vllm serve``, is the e2e conformance battery's (tests/e2e/conformance.py)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from pdserve.bench.fake_worker import DEFAULT_PIECES, FakeDecode
from tests.helpers import gateway_cluster, served_name, tokenizer
from tests.integration.test_gateway_tools import HERMES, TWO_CALLS, scripted

ANSWER = "".join(text for _, text in DEFAULT_PIECES)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def events_of(body: str) -> list[dict[str, Any]]:
    """The Responses API's SSE: each event's data, its ``event:`` line checked against its type
    and the sequence numbers counted from 0."""
    assert body.endswith("\n\n"), body[-50:]
    out = []
    for block in body[:-2].split("\n\n"):
        name, data = block.split("\n")
        payload = json.loads(data[len("data: ") :])
        assert name == f"event: {payload['type']}", block
        out.append(payload)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


async def _responses(base_url: str, **body: Any) -> httpx.Response:
    request = {"model": served_name(), "input": "Hi", "max_output_tokens": 16, **body}
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        return await http.post("/v1/responses", json=request)


async def test_a_response_whole_and_streamed_from_one_prefill() -> None:
    async with gateway_cluster() as c:
        whole = await _responses(c.base_url, instructions="Be brief.", temperature=0)
        streamed = await _responses(c.base_url, stream=True, temperature=0)
        prefills = c.prefill.seen.requests
        decodes = c.decode.seen.requests
    assert whole.status_code == 200, whole.text
    body = whole.json()
    assert body["object"] == "response" and body["status"] == "completed"
    assert body["id"].startswith("resp_") and body["instructions"] == "Be brief."
    (message,) = body["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert [p["text"] for p in message["content"]] == [ANSWER]
    usage = body["usage"]
    assert usage["output_tokens"] == len(DEFAULT_PIECES)
    assert usage["input_tokens_details"]["cached_tokens"] == 3  # the fake prefill's
    # vLLM's chat template with the instructions as the system turn: the ids reached both
    assert len(prefills) == 2 and len(decodes) == 2
    prompt = list(prefills[0].prompt_token_ids)
    assert usage["input_tokens"] == len(prompt) and prompt == list(decodes[0].prompt_token_ids)
    assert "system\nBe brief.<|im_end|>" in tokenizer().decode(prompt)
    events = events_of(streamed.text)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == ANSWER and len(deltas) == len(DEFAULT_PIECES)
    done = events[-1]["response"]
    assert done["output"][0]["content"][0]["text"] == ANSWER
    assert done["usage"]["output_tokens"] == len(DEFAULT_PIECES)


async def test_function_calls_by_vllms_parser_whole_and_streamed() -> None:
    async with gateway_cluster(decode=scripted(TWO_CALLS), **HERMES) as c:
        whole = await _responses(c.base_url, tools=[WEATHER], max_output_tokens=128)
        streamed = await _responses(c.base_url, tools=[WEATHER], max_output_tokens=128, stream=True)
        single = await _responses(
            c.base_url, tools=[WEATHER], max_output_tokens=128, parallel_tool_calls=False
        )
    expected = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]

    def calls(output: list[dict[str, Any]]) -> list[tuple[str, Any]]:
        assert all(o["type"] == "function_call" and o["call_id"] for o in output), output
        return [(o["name"], json.loads(o["arguments"])) for o in output]

    assert whole.status_code == 200, whole.text
    assert calls(whole.json()["output"]) == expected
    assert calls(single.json()["output"]) == expected[:1]
    events = events_of(streamed.text)
    arguments = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [(e["name"], json.loads(e["arguments"])) for e in arguments] == expected
    assert calls(events[-1]["response"]["output"]) == expected


async def test_logprobs_as_vllm_writes_them() -> None:
    async with gateway_cluster() as c:
        reply = await _responses(
            c.base_url, include=["message.output_text.logprobs"], top_logprobs=2, temperature=0
        )
        asked = c.decode.seen.requests[0].params
    assert reply.status_code == 200, reply.text
    assert asked.logprobs == 2  # vLLM's sampling parameters reached the worker
    (part,) = reply.json()["output"][0]["content"]
    tokens = [entry["token"] for entry in part["logprobs"]]
    assert "".join(tokens) == ANSWER
    assert all(len(entry["top_logprobs"]) == 2 for entry in part["logprobs"])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        # vLLM would run it in the background, stored nowhere (store false); pdserve refuses
        ({"background": True, "store": False}, "background"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"kv_transfer_params": {"do_remote_prefill": True}}, "kv_transfer_params"),
        ({"temperature": -1}, "temperature"),
        ({"input": 3}, "input"),
    ],
)
async def test_refused_requests_name_their_field(body: dict[str, Any], param: str) -> None:
    async with gateway_cluster() as c:
        reply = await _responses(c.base_url, **body)
        generated = len(c.decode.seen.requests)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param
    if param in ("background", "previous_response_id"):
        assert "pdserve stores no responses" in error["message"]
    assert generated == 0


async def test_no_response_is_stored() -> None:
    async with gateway_cluster() as c, httpx.AsyncClient(base_url=c.base_url, timeout=60) as http:
        made = (await _responses(c.base_url)).json()["id"]
        fetched = await http.get(f"/v1/responses/{made}")
        cancelled = await http.post(f"/v1/responses/{made}/cancel")
    for reply in (fetched, cancelled):
        assert reply.status_code == 404, reply.text
        error = reply.json()["error"]
        assert error["param"] == "response_id" and made in error["message"]


async def test_a_stream_that_fails_ends_with_an_error_event() -> None:
    async with gateway_cluster(decode=FakeDecode(fail_after=1)) as c:
        reply = await _responses(c.base_url, stream=True)
    assert reply.status_code == 200
    events = events_of(reply.text)
    assert events[-1]["type"] == "error", events[-1]
    assert "decode worker" in events[-1]["message"]
    assert "response.completed" not in [e["type"] for e in events]
