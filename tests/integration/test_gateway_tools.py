"""Tool calls and reasoning, parsed by vLLM's own parsers in the gateway
(``gateway.chat_parsing``), against fake workers that generate a scripted text: the hermes
tool-call format, a qwen3-style thought. What the real model generates is the e2e tier's
(tests/e2e/test_tools.py); here the text is fixed so every branch is checked exactly."""

from __future__ import annotations

import json
from typing import Any

import grpc
import httpx
import pytest

from pdserve.bench.fake_worker import FakeDecode
from protos.v1 import generate_pb2, generate_pb2_grpc
from tests.helpers import chat_ids, gateway_cluster, parse_sse, tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris and in Rome?"}]
CALL = '<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{}"}}}}\n</tool_call>'
TWO_CALLS = CALL.format("Paris") + "\n" + CALL.format("Rome")
HERMES = {"tool_call_parser": "hermes", "enable_auto_tool_choice": True}


def scripted(text: str) -> FakeDecode:
    """A decode worker that generates ``text``, one token per chunk."""
    tok = tokenizer()
    ids = tok.encode_text(text, add_special_tokens=False)
    return FakeDecode(tokens=[(i, tok.decode([i])) for i in ids])


def calls_of(message: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message.get("tool_calls") or []
    ]


def streamed_calls(chunks: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The tool calls of a stream, assembled from their deltas by index."""
    calls: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            for delta in choice["delta"].get("tool_calls") or []:
                call = calls.setdefault(delta["index"], {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or delta.get("id")
                function = delta.get("function") or {}
                call["name"] += function.get("name") or ""
                call["arguments"] += function.get("arguments") or ""
    return calls


async def _chat(base_url: str, **body: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        return await http.post("/v1/chat/completions", json={"messages": ASK, **body})


@pytest.mark.parametrize(
    ("choice", "message"),
    [
        (None, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser'),
        ("auto", '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser'),
        ("required", 'tool_choice="required" requires --tool-call-parser to be set'),
        (
            {"type": "function", "function": {"name": "get_weather"}},
            'tool_choice=function "get_weather" requires --tool-call-parser to be set',
        ),
    ],
)
async def test_without_a_parser_a_tool_choice_is_vllms_400(choice: Any, message: str) -> None:
    body: dict[str, Any] = {"tools": [WEATHER]}
    if choice is not None:
        body["tool_choice"] = choice
    async with gateway_cluster() as c:
        response = await _chat(c.base_url, **body)
        served = await _chat(c.base_url, tools=[WEATHER], tool_choice="none")
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"].startswith(message) and error["param"] is None  # as vLLM names none
    assert served.status_code == 200  # "none": the tools are templated, nothing is parsed


async def test_tool_choice_values_are_checked_as_vllm_checks_them() -> None:
    async with gateway_cluster(**HERMES) as c:
        unknown = await _chat(
            c.base_url,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
        no_tools = await _chat(c.base_url, tool_choice="required")
        empty = await _chat(c.base_url, tools=[])
    assert unknown.status_code == 400 and "does not match any" in unknown.json()["error"]["message"]
    assert no_tools.status_code == 400 and "`tools` must be set" in no_tools.text
    assert empty.status_code == 400 and "must not be an empty array" in empty.text


async def test_auto_tool_calls_whole_and_streamed() -> None:
    async with gateway_cluster(decode=scripted(TWO_CALLS), **HERMES) as c:
        whole = await _chat(c.base_url, tools=[WEATHER])
        stream = await _chat(c.base_url, tools=[WEATHER], stream=True)
        single = await _chat(c.base_url, tools=[WEATHER], parallel_tool_calls=False)
    choice = whole.json()["choices"][0]
    expected = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert calls_of(choice["message"]) == expected
    assert choice["message"]["content"] is None
    assert all(c["id"] and c["type"] == "function" for c in choice["message"]["tool_calls"])
    assert choice["finish_reason"] == "tool_calls"
    events = parse_sse(stream.text)
    assert events[-1] == "[DONE]"
    calls = streamed_calls(events[:-1])
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == expected
    assert all(c["id"] for c in calls.values())
    finishes = [ch["finish_reason"] for e in events[:-1] for ch in e["choices"]]
    assert finishes[-1] == "tool_calls" and not any(finishes[:-1])
    assert not any(ch["delta"].get("content") for e in events[:-1] for ch in e["choices"])
    assert calls_of(single.json()["choices"][0]["message"]) == expected[:1]


async def test_required_and_named_force_the_call_on_the_worker() -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    decode = scripted(CALL.format("Paris"))
    async with gateway_cluster(decode=decode, **HERMES) as c:
        required = await _chat(c.base_url, tools=[WEATHER], tool_choice="required")
        by_name = await _chat(c.base_url, tools=[WEATHER], tool_choice=named, stream=True)
    body = required.json()["choices"][0]
    assert calls_of(body["message"]) == [("get_weather", {"city": "Paris"})]
    assert body["message"]["content"] == "" and body["finish_reason"] == "tool_calls"
    events = parse_sse(by_name.text)[:-1]
    assert [c["name"] for c in streamed_calls(events).values()] == ["get_weather"]
    assert [ch["finish_reason"] for e in events for ch in e["choices"]][-1] == "stop"
    for seen in decode.seen.requests:
        # vLLM's structural tag of the hermes call format constrains the worker's output,
        # and special tokens stay in the text for the parser.
        tag = json.loads(seen.params.structured_output.structural_tag)
        assert "<tool_call>" in json.dumps(tag) and "get_weather" in json.dumps(tag)
        assert seen.params.HasField("skip_special_tokens") and not seen.params.skip_special_tokens


async def test_a_tool_result_in_the_history_is_templated() -> None:
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call-1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call-1", "content": "Sunny, 21 C"},
    ]
    decode = scripted("It is sunny.")
    async with gateway_cluster(decode=decode, **HERMES) as c:
        response = await _chat(c.base_url, messages=history, tools=[WEATHER])
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    assert message["content"] == "It is sunny." and "tool_calls" not in message
    assert response.json()["choices"][0]["finish_reason"] == "stop"
    sent = list(decode.seen.requests[0].prompt_token_ids)
    templated = [{**m, "content": m["content"] or ""} for m in history]  # None: no text
    assert sent == chat_ids(templated, tools=[WEATHER])
    assert "Sunny, 21 C" in tokenizer().decode(sent)


async def test_reasoning_is_split_from_the_content() -> None:
    decode = scripted("<think>Paris is in France.</think>The capital is Paris.")
    async with gateway_cluster(decode=decode, reasoning_parser="qwen3") as c:
        whole = await _chat(c.base_url)
        stream = await _chat(c.base_url, stream=True)
        hidden = await _chat(c.base_url, include_reasoning=False)
    message = whole.json()["choices"][0]["message"]
    assert message["reasoning"] == "Paris is in France."
    assert message["content"] == "The capital is Paris."
    deltas = [ch["delta"] for e in parse_sse(stream.text)[:-1] for ch in e["choices"]]
    assert "".join(d.get("reasoning") or "" for d in deltas) == "Paris is in France."
    assert "".join(d.get("content") or "" for d in deltas) == "The capital is Paris."
    hidden_message = hidden.json()["choices"][0]["message"]
    assert hidden_message["reasoning"] is None
    assert hidden_message["content"] == "The capital is Paris."


async def test_a_tool_parser_without_auto_tool_choice_parses_nothing_as_in_vllm() -> None:
    async with gateway_cluster(tool_call_parser="hermes") as c:
        response = await _chat(c.base_url, tools=[WEATHER], tool_choice="required")
    assert response.status_code == 400
    assert "requires --tool-call-parser" in response.json()["error"]["message"]


async def test_an_unknown_parser_stops_the_gateway_with_its_name() -> None:
    with pytest.raises(ValueError, match="no_such_parser"):
        async with gateway_cluster(tool_call_parser="no_such_parser", enable_auto_tool_choice=True):
            pass


async def _grpc_generate(target: str, **fields: Any) -> list[generate_pb2.GenerateResponse]:
    messages = [
        generate_pb2.ChatMessage(**{k: v for k, v in m.items() if v is not None})
        for m in fields.pop("messages", ASK)
    ]
    request = generate_pb2.GenerateRequest(
        chat=generate_pb2.ChatMessages(messages=messages), **fields
    )
    async with grpc.aio.insecure_channel(target) as channel:
        return [r async for r in generate_pb2_grpc.GenerationStub(channel).Generate(request)]


async def test_grpc_streams_tool_calls_and_reasoning() -> None:
    tools = json.dumps([WEATHER])
    async with gateway_cluster(decode=scripted(TWO_CALLS), **HERMES) as c:
        calls = await _grpc_generate(c.grpc_target, tools_json=tools)
        single = await _grpc_generate(c.grpc_target, tools_json=tools, parallel_tool_calls=False)
    pieces: dict[int, list[str]] = {}
    for message in calls:
        for delta in message.tool_calls:
            piece = pieces.setdefault(delta.index, [delta.id, delta.name, ""])
            piece[2] += delta.arguments
    assert [(name, json.loads(args)) for _, name, args in pieces.values()] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Rome"}),
    ]
    assert all(call_id for call_id, _, _ in pieces.values())
    assert calls[-1].finish_reason == "tool_calls" and not "".join(m.text for m in calls)
    assert {d.index for m in single for d in m.tool_calls} == {0}
    decode = scripted("<think>Paris is in France.</think>The capital is Paris.")
    async with gateway_cluster(decode=decode, reasoning_parser="qwen3") as c:
        thought = await _grpc_generate(c.grpc_target)
    assert "".join(m.reasoning for m in thought) == "Paris is in France."
    assert "".join(m.text for m in thought) == "The capital is Paris."
    assert sum(len(m.token_ids) for m in thought) == len(decode.pieces)  # ids of every token


async def test_grpc_history_with_a_call_and_tool_choice_without_a_parser() -> None:
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls_json": json.dumps([call])},
        {"role": "tool", "content": "Sunny", "tool_call_id": "c1"},
    ]
    decode = FakeDecode()
    async with gateway_cluster(decode=decode) as c:
        await _grpc_generate(c.grpc_target, messages=history, tools_json=json.dumps([WEATHER]),
                             tool_choice_json='"none"')  # fmt: skip
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _grpc_generate(c.grpc_target, tools_json=json.dumps([WEATHER]),
                                 tool_choice_json='"required"')  # fmt: skip
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "requires --tool-call-parser" in str(refused.value.details())
    templated = [{"role": "user", "content": "Weather in Paris?"},
                 {"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "content": "Sunny", "tool_call_id": "c1"}]  # fmt: skip
    sent = list(decode.seen.requests[0].prompt_token_ids)
    assert sent == chat_ids(templated, tools=[WEATHER])
