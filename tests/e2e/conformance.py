"""The conformance battery: the same requests sent to plain ``vllm serve`` and to pdserve (same
model, same dtype, vLLM's hermes tool parser on both), answers compared field by field.

``answers(base_url)`` sends every case of ``BATTERY`` and keeps what came back; ``differences``
compares two such answer sets after ``project`` has dropped what legitimately differs between
two servers (ids, timestamps, the tool calls' random ids) and turned a stream into what a client
assembles from it. The differences pdserve intends are listed in ``INTENDED`` with their reason
(docs/api.md repeats them); anything else is a failure.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import httpx

from pdserve.bench.systems import _wait_http, child_process, monolith_argv
from tests.e2e.cases import DTYPE
from tests.helpers import model_dir, served_name

SERVE_ARGS = (
    f"--dtype {DTYPE} --tool-call-parser hermes --enable-auto-tool-choice "
    "--enable-tokenizer-info-endpoint"
)

# The e2e adapter (pdserve model lora) as vLLM serves it, with the flags pdserve's workers turn
# on for it and for adapters loaded at run time (pdserve.worker.lora.engine_flags); a second
# one (another seed) is loaded and unloaded at run time by the battery: LORA_PATH_2 in a body
# stands for its directory.
LORA_NAME = "colors-lora"
LORA_ARGS = "--enable-lora --max-loras 4 --max-lora-rank 16"
LORA_NAME_2 = "colors-lora-2"
LORA_PATH_2 = "<the second adapter's directory>"

TEXT = "The capital of France is"
COLORS = [{"role": "user", "content": "Name three colors."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
RESPONSE_WEATHER = {"type": "function", "name": "get_weather", **WEATHER["function"]}  # type: ignore[dict-item]
GREEDY = {"temperature": 0}


def _chat(**body: Any) -> dict[str, Any]:
    return {"messages": COLORS, "max_tokens": 16, **GREEDY, **body}


def _response(**body: Any) -> dict[str, Any]:
    return {"input": "Name three colors.", "max_output_tokens": 16, **GREEDY, **body}


RESPONSE_REQUIRED = _response(
    input=ASK[0]["content"],
    tools=[RESPONSE_WEATHER],
    tool_choice="required",
    parallel_tool_calls=False,
    max_output_tokens=96,
)


def _completion(**body: Any) -> dict[str, Any]:
    return {"prompt": TEXT, "max_tokens": 16, **GREEDY, **body}


REQUIRED = _chat(
    messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=48
)
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = "/v1/messages"  # Anthropic's
RESPONSES = "/v1/responses"  # OpenAI's Responses API, stateless
ANTHROPIC_WEATHER = {
    "name": "get_weather",
    "input_schema": WEATHER["function"]["parameters"],  # type: ignore[index]
    "strict": True,  # the arguments follow the schema (vLLM's tool_strict_level auto)
}
# Without strict the model's arguments are free: SmolLM2 writes a string, which vLLM's
# converter cannot make a tool_use block (vllm serve: 400)
LOOSE_WEATHER = {k: v for k, v in ANTHROPIC_WEATHER.items() if k != "strict"}
# A pre-filled assistant turn, continued rather than closed.
CONTINUED: dict[str, Any] = {
    "messages": [*COLORS, {"role": "assistant", "content": "Red, blue"}],
    "add_generation_prompt": False,
    "continue_final_message": True,
}
# name -> (path, body without "model", or None for a GET)
BATTERY: dict[str, tuple[str, dict[str, Any] | None]] = {
    "chat": (CHAT, _chat()),
    "chat_streamed": (CHAT, _chat(stream=True, stream_options={"include_usage": True})),
    "chat_logprobs": (CHAT, _chat(logprobs=True, top_logprobs=2, max_tokens=6)),
    "chat_logprobs_token_ids": (
        CHAT,
        _chat(logprobs=True, top_logprobs=2, max_tokens=6, return_tokens_as_token_ids=True),
    ),
    "chat_stop": (CHAT, _chat(stop=["."], max_tokens=32)),
    "chat_stop_token": (CHAT, _chat(stop_token_ids=[28], max_tokens=32)),
    "chat_continue": (CHAT, _chat(**CONTINUED)),
    "chat_echo": (CHAT, _chat(**CONTINUED, echo=True)),
    "chat_echo_streamed": (CHAT, _chat(**CONTINUED, echo=True, stream=True)),
    "chat_no_generation_prompt": (CHAT, _chat(add_generation_prompt=False)),
    "chat_vllm_xargs": (CHAT, _chat(vllm_xargs={"unused_by_any_processor": 1})),
    "chat_allowed_tokens": (CHAT, _chat(allowed_token_ids=[17, 28], max_tokens=5)),
    "chat_bad_words": (CHAT, _chat(bad_words=["red", "Red"])),
    "chat_n2_seeded": (CHAT, _chat(n=2, temperature=0.8, seed=11, max_tokens=8)),
    "chat_json_schema": (
        CHAT,
        _chat(
            max_tokens=32,
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "c",
                    "schema": {
                        "type": "object",
                        "properties": {"color": {"type": "string"}},
                        "required": ["color"],
                    },
                },
            },
        ),
    ),
    "chat_tool_required": (CHAT, REQUIRED),
    "chat_tool_required_streamed": (CHAT, {**REQUIRED, "stream": True}),
    "chat_tool_named": (
        CHAT,
        _chat(
            messages=ASK,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=48,
        ),
    ),
    "chat_tool_auto": (CHAT, _chat(messages=ASK, tools=[WEATHER])),
    "completion": (COMPLETIONS, _completion()),
    "completion_default_max_tokens": (COMPLETIONS, {"prompt": TEXT, **GREEDY}),
    "completion_streamed": (COMPLETIONS, _completion(stream=True)),
    "completion_logprobs": (COMPLETIONS, _completion(logprobs=2, max_tokens=6)),
    "completion_logprobs_token_ids": (
        COMPLETIONS,
        _completion(logprobs=2, max_tokens=6, return_tokens_as_token_ids=True),
    ),
    "completion_echo_scoring": (COMPLETIONS, _completion(echo=True, max_tokens=0, logprobs=1)),
    "completion_truncated": (
        COMPLETIONS,
        _completion(
            prompt="one two three four five six seven eight nine ten " * 8,
            truncate_prompt_tokens=20,
        ),
    ),
    "completion_token_ids": (COMPLETIONS, _completion(prompt=[504, 3575, 282], max_tokens=8)),
    "completion_return_token_ids": (COMPLETIONS, _completion(return_token_ids=True, max_tokens=4)),
    "completion_too_long": (COMPLETIONS, _completion(max_tokens=10**6)),
    "chat_reasoning_effort": (CHAT, _chat(reasoning_effort="low")),
    "error_reasoning_effort": (CHAT, _chat(reasoning_effort="extreme")),
    "error_chat_template_untrusted": (CHAT, _chat(chat_template="{{ messages }}")),
    "error_temperature": (CHAT, _chat(temperature=-1)),
    "error_no_messages": (CHAT, {"max_tokens": 4}),
    "error_n_greedy": (COMPLETIONS, _completion(n=2)),  # vLLM: n must be 1 when greedy
    "error_tool_choice": (CHAT, _chat(tools=[WEATHER], tool_choice="sometimes")),
    "error_unknown_model": (CHAT, {**_chat(), "model": "no-such-model"}),
    "models": ("/v1/models", None),
    "tokenizer_info": ("/tokenizer_info", None),
    "messages": (MESSAGES, {"max_tokens": 16, "messages": COLORS, **GREEDY}),
    "messages_streamed": (
        MESSAGES,
        {"max_tokens": 16, "messages": COLORS, "system": "Be brief.", "stream": True, **GREEDY},
    ),
    "messages_tool_any": (
        MESSAGES,
        {
            "max_tokens": 48,
            "messages": ASK,
            "tools": [ANTHROPIC_WEATHER],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            **GREEDY,
        },
    ),
    "messages_tool_any_streamed": (
        MESSAGES,
        {
            "max_tokens": 48,
            "messages": ASK,
            "tools": [ANTHROPIC_WEATHER],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "stream": True,
            **GREEDY,
        },
    ),
    "messages_tool_loose": (
        MESSAGES,
        {
            "max_tokens": 48,
            "messages": ASK,
            "tools": [LOOSE_WEATHER],
            "tool_choice": {"type": "any"},
            **GREEDY,
        },
    ),
    "messages_count_tokens": (
        MESSAGES + "/count_tokens",
        {"messages": ASK, "system": "Be brief.", "tools": [ANTHROPIC_WEATHER]},
    ),
    "error_messages_no_max_tokens": (MESSAGES, {"messages": COLORS}),
    "responses": (RESPONSES, _response()),
    "responses_streamed": (RESPONSES, _response(instructions="Be brief.", stream=True)),
    "responses_conversation": (
        RESPONSES,
        _response(
            input=[
                *COLORS,
                {"role": "assistant", "content": "Red, blue and green."},
                {"role": "user", "content": "One more?"},
            ]
        ),
    ),
    "responses_logprobs": (
        RESPONSES,
        _response(include=["message.output_text.logprobs"], top_logprobs=2, max_output_tokens=6),
    ),
    "responses_stop": (RESPONSES, _response(stop=["."], max_output_tokens=32)),
    "responses_tool_required": (RESPONSES, RESPONSE_REQUIRED),
    "responses_tool_required_streamed": (RESPONSES, {**RESPONSE_REQUIRED, "stream": True}),
    "lora_chat": (CHAT, _chat(model=LORA_NAME)),
    "lora_chat_streamed": (
        CHAT,
        _chat(model=LORA_NAME, stream=True, stream_options={"include_usage": True}),
    ),
    "lora_completion": (COMPLETIONS, _completion(model=LORA_NAME)),
    "lora_completion_logprobs": (
        COMPLETIONS,
        _completion(model=LORA_NAME, logprobs=2, max_tokens=6),
    ),
    "lora_responses": (RESPONSES, _response(model=LORA_NAME)),
    "lora_messages": (
        MESSAGES,
        {"model": LORA_NAME, "max_tokens": 16, "messages": COLORS, **GREEDY},
    ),
    "lora_load": ("/v1/load_lora_adapter", {"lora_name": LORA_NAME_2, "lora_path": LORA_PATH_2}),
    "error_lora_load_again": (
        "/v1/load_lora_adapter",
        {"lora_name": LORA_NAME_2, "lora_path": LORA_PATH_2},
    ),
    "lora_loaded_chat": (CHAT, _chat(model=LORA_NAME_2)),
    "lora_unload": ("/v1/unload_lora_adapter", {"lora_name": LORA_NAME_2}),
    "error_lora_unloaded_chat": (CHAT, _chat(model=LORA_NAME_2)),
    "error_lora_unload_unknown": ("/v1/unload_lora_adapter", {"lora_name": LORA_NAME_2}),
    "error_responses_background": (RESPONSES, _response(background=True)),
    "error_responses_temperature": (RESPONSES, _response(temperature=-1)),
}

# Differences pdserve means to have, each with its reason; the test fails on any other.
# key: (case or "*", a path of the projection that differs)
INTENDED: dict[tuple[str, str], str] = {
    ("*", ".body.usage.prompt_tokens_details"): "pdserve always reports cached_tokens (the "
    "prefix-cache hits of its workers); vLLM only with --enable-prompt-tokens-details",
    ("*", ".stream.usage.prompt_tokens_details"): "as above, in a stream's usage",
    ("*", ".body.usage.cache_read_input_tokens"): "the same cached tokens in Anthropic's usage "
    "(vLLM's converter writes them when the chat usage has them)",
    ("*", ".stream.final.usage.cache_read_input_tokens"): "as above, in Anthropic's stream",
    ("*", ".error_type"): "OpenAI's error types (invalid_request_error, ...), which OpenAI "
    "clients know; vLLM 0.32 writes exception names (BadRequestError, NotFoundError). The "
    "status codes are the same",
    ("models", ".body.data[0].owned_by"): "pdserve serves the model, not vllm serve",
    ("models", ".body.data[1].owned_by"): "and the LoRA adapter",
}


def vllm_serve_battery(log: Path, port: int, adapters: tuple[str, str]) -> dict[str, Any]:
    """The battery's answers from plain ``vllm serve`` on ``port`` (pdserve's CPU engine
    arguments, the e2e dtype, vLLM's hermes parser, the first of the LoRA ``adapters`` as
    ``LORA_NAME``, the second loaded at run time), started and stopped here."""
    from pdserve.worker.engine import cpu_engine_env

    lora_adapter, second = adapters
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    cpu_engine_env(env)
    lora = f" {LORA_ARGS} --lora-modules {LORA_NAME}={lora_adapter}"
    argv = monolith_argv(model_dir(), served_name(), port, engine_args=SERVE_ARGS + lora)
    with child_process(argv, env, log) as process:
        try:
            _wait_http(f"http://127.0.0.1:{port}/health", process, 600, "vllm serve")
        except RuntimeError as err:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{err}:\n{tail}") from err
        return asyncio.run(answers(f"http://127.0.0.1:{port}", served_name(), second))


async def answers(base_url: str, model: str, second_adapter: str) -> dict[str, Any]:
    """Every case of the battery, sent one after the other: {name: {"status", "body"}} with
    a stream's body the list of its events (``second_adapter``: LORA_PATH_2's directory)."""
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as http:
        for name, (path, body) in BATTERY.items():
            if body is None:
                response = await http.get(path)
            else:
                sent = {"model": model, **body}
                sent = {k: second_adapter if v == LORA_PATH_2 else v for k, v in sent.items()}
                response = await http.post(path, json=sent)
            out[name] = {"status": response.status_code, "body": _body(response)}
    return out


def _body(response: httpx.Response) -> Any:
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        events = []
        for block in response.text.split("\n\n"):
            for line in block.split("\n"):  # Anthropic's events have an "event:" line first
                if line.startswith("data: "):
                    data = line[len("data: ") :]
                    events.append(data if data == "[DONE]" else json.loads(data))
        return events
    try:
        return response.json()
    except ValueError:
        return response.text


VOLATILE = {"id", "created", "created_at", "system_fingerprint"}


def project(answer: dict[str, Any]) -> dict[str, Any]:
    """What a client reads from an answer: status, an error's type; a body without ids and
    timestamps; a stream as the text, calls, finish and usage it assembles to; tool call ids
    reduced to their presence."""
    status, body = answer["status"], answer["body"]
    if status != 200:
        error = body.get("error", body) if isinstance(body, dict) else {}
        return {"status": status, "error_type": error.get("type")}
    if isinstance(body, list) and body and isinstance(body[0], dict) and "type" in body[0]:
        if str(body[0]["type"]).startswith("response."):
            return {"status": status, "stream": _assembled_response(body)}
        return {"status": status, "stream": _assembled_message(body)}
    if isinstance(body, list):
        return {"status": status, "stream": _assembled(body)}
    return {"status": status, "body": _stable(body)}


def _stable(value: Any) -> Any:
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key not in VOLATILE:
                out[key] = _stable(item)
        if "function" in out and "type" in out and "id" in value:
            out["id"] = bool(value["id"])  # a call's id: random on both servers
        if "call_id" in out:
            out["call_id"] = bool(value["call_id"])  # a Responses function call's, as well
        return out
    if isinstance(value, list):
        return [_stable(v) for v in value]
    return value


def _assembled(events: list[Any]) -> dict[str, Any]:
    """A stream as a client assembles it, per choice index: text, reasoning, calls, the
    finish; the last usage; whether it ended with [DONE]; the keys its chunks use."""
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    keys: set[str] = set()
    for event in events:
        if event == "[DONE]":
            continue
        keys |= {k for k, v in event.items() if v is not None and k not in VOLATILE}
        usage = event.get("usage") or usage
        for choice in event.get("choices") or []:
            mine = choices.setdefault(
                choice["index"],
                {"text": "", "reasoning": "", "calls": {}, "finish": None, "stop_reason": None},
            )
            delta = choice.get("delta") or {}
            mine["text"] += choice.get("text") or delta.get("content") or ""
            mine["reasoning"] += delta.get("reasoning") or ""
            for call in delta.get("tool_calls") or []:
                entry = mine["calls"].setdefault(str(call["index"]), {"name": "", "args": ""})
                function = call.get("function") or {}
                entry["name"] += function.get("name") or ""
                entry["args"] += function.get("arguments") or ""
            mine["finish"] = choice.get("finish_reason") or mine["finish"]
            mine["stop_reason"] = choice.get("stop_reason") or mine["stop_reason"]
    return {
        "choices": choices,
        "usage": usage,
        "done": events[-1:] == ["[DONE]"],
        "keys": sorted(keys),
    }


def _assembled_message(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Anthropic's stream as a client assembles it: the event types in order, the message of
    ``message_start``, each content block (its text, or its call's name and input), the
    ``message_delta``; tool use ids reduced to their presence."""
    blocks: dict[int, dict[str, Any]] = {}
    final: dict[str, Any] = {}
    start: dict[str, Any] = {}
    for event in events:
        kind = event["type"]
        if kind == "message_start":
            start = _stable(event["message"])
        elif kind == "content_block_start":
            blocks[event["index"]] = _stable(event["content_block"])
        elif kind == "content_block_delta":
            block, delta = blocks[event["index"]], event["delta"]
            if delta["type"] == "text_delta":
                block["text"] = block.get("text", "") + delta["text"]
            elif delta["type"] == "input_json_delta":
                block["input_json"] = block.get("input_json", "") + delta["partial_json"]
            else:
                block.setdefault("other", []).append(delta)
        elif kind == "message_delta":
            final = _stable(event)
    for block in blocks.values():
        if "id" in block:
            block["id"] = bool(block["id"])
    return {
        "types": [e["type"] for e in events],
        "start": start,
        "blocks": blocks,
        "final": final,
    }


def _assembled_response(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The Responses API's stream as a client assembles it: the event types in order, the text
    and the function call arguments of the deltas, the response of ``response.completed``."""
    text = arguments = ""
    final: dict[str, Any] = {}
    for event in events:
        if event["type"] == "response.output_text.delta":
            text += event["delta"]
        elif event["type"] == "response.function_call_arguments.delta":
            arguments += event["delta"]
        elif event["type"] == "response.completed":
            final = _stable(event["response"])
    return {
        "types": [e["type"] for e in events],
        "text": text,
        "arguments": arguments,
        "final": final,
    }


def differences(reference: Any, ours: Any, path: str = "") -> list[str]:
    """Where ``ours`` differs from ``reference`` (floats within 0.01: two engines, one with
    KV moved in)."""
    if isinstance(reference, dict) and isinstance(ours, dict):
        found = []
        for key in sorted(set(reference) | set(ours), key=str):
            if reference.get(key) is None and ours.get(key) is None:
                continue  # absent or null: a client reads None from either
            if key not in ours:
                found.append(f"{path}.{key}: missing (vllm serve: {_short(reference[key])})")
            elif key not in reference:
                found.append(f"{path}.{key}: extra ({_short(ours[key])})")
            else:
                found += differences(reference[key], ours[key], f"{path}.{key}")
        return found
    if isinstance(reference, list) and isinstance(ours, list):
        if len(reference) != len(ours):
            return [f"{path}: {len(ours)} items, vllm serve {len(reference)}"]
        return [d for i, (a, b) in enumerate(zip(reference, ours, strict=True)) for d in
                differences(a, b, f"{path}[{i}]")]  # fmt: skip
    if isinstance(reference, float) and isinstance(ours, (float, int)):
        return [] if abs(reference - ours) <= 0.01 else [f"{path}: {ours} vs {reference}"]
    if reference != ours:
        return [f"{path}: {_short(ours)} vs vllm serve {_short(reference)}"]
    return []


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 120 else text[:117] + "..."


def intended(case: str, difference: str) -> bool:
    """Whether ``difference`` (a line of ``differences``) is one of ``INTENDED``."""
    return any((c in ("*", case)) and difference.startswith(path) for c, path in INTENDED)
