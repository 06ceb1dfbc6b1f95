"""The official OpenAI SDK's tool-calling loop against the shared cluster (real workers, the
default model, KV moved between them), with vLLM's hermes parser in the gateway as ``make up``
runs it: the model is made to call a tool, the tool's result goes back in the history, and the
model answers. SmolLM2's chat template does not show tools to the model, so the calls are
forced ("required" and a named function: vLLM's structural tag constrains the output); strict
parameters make the arguments follow the tool's schema."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.e2e.conformance import ASK, WEATHER
from tests.e2e.conftest import RealCluster
from tests.helpers import served_name

CLOCK = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _client(cluster: RealCluster) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0)


def _streamed_call(stream: Any) -> tuple[str, str, str, str | None]:
    """(id, name, arguments, finish_reason) of the one call a stream makes."""
    call_id, name, arguments, finish = "", "", "", None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                assert delta.index == 0, "one call asked for, more streamed"
                call_id = call_id or (delta.id or "")
                if delta.function is not None:
                    name += delta.function.name or ""
                    arguments += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return call_id, name, arguments, finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_sdk_tool_loop_calls_a_tool_and_answers_with_its_result(
    cluster: RealCluster, stream: bool
) -> None:
    client = _client(cluster)
    ask: dict[str, Any] = {
        "model": served_name(),
        "messages": ASK,
        "tools": [WEATHER, CLOCK],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_tokens": 64,
    }
    if stream:
        call_id, name, arguments, finish = _streamed_call(
            client.chat.completions.create(**ask, stream=True)
        )
    else:
        reply = client.chat.completions.create(**ask)
        message = reply.choices[0].message
        assert message.tool_calls is not None and len(message.tool_calls) == 1
        call = message.tool_calls[0]
        call_id, name, arguments = call.id, call.function.name, call.function.arguments
        finish = reply.choices[0].finish_reason
    assert finish == "tool_calls"
    assert call_id and name in ("get_weather", "get_time")
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"city"} and isinstance(args["city"], str)
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                },
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "Sunny and 21 degrees."},
    ]
    final = client.chat.completions.create(
        model=served_name(), messages=history, tools=[WEATHER, CLOCK], temperature=0,
        max_tokens=24,
    )  # fmt: skip
    client.close()
    assert final.choices[0].message.content
    assert not final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.usage is not None and final.usage.prompt_tokens > 0


def test_a_named_tool_choice_calls_that_tool(cluster: RealCluster) -> None:
    client = _client(cluster)
    reply = client.chat.completions.create(
        model=served_name(), messages=ASK, tools=[CLOCK, WEATHER], tool_choice=NAMED,
        temperature=0, max_tokens=64,
    )  # fmt: skip
    client.close()
    calls = reply.choices[0].message.tool_calls
    assert calls is not None and [c.function.name for c in calls] == ["get_weather"]
    assert set(json.loads(calls[0].function.arguments)) == {"city"}
    assert reply.choices[0].finish_reason == "stop"  # OpenAI's finish of a named call
