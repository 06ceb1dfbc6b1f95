"""The API-surface cases: the requests tests/e2e/test_api_surface.py sends to the cluster and
tests/e2e/reference.py to one monolithic engine (the ``api_reference`` fixture)."""

from __future__ import annotations

from typing import Any

TEXT = "The capital of France is"
COLORS = [{"role": "user", "content": "Name three colors."}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
PREFILLED = [
    {"role": "user", "content": "Name three colors."},
    {"role": "assistant", "content": "Red, green and"},
]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}
JSON_ASK = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]

CASES: list[dict[str, Any]] = [
    {"name": "plain", "text": TEXT, "params": {"temperature": 0, "max_tokens": 24}},
    {
        "name": "chat_logprobs",
        "messages": COLORS,
        "params": {"temperature": 0, "max_tokens": 12, "logprobs": 2},
    },
    {
        "name": "penalties",
        "text": TEXT,
        "params": {
            "temperature": 0,
            "max_tokens": 24,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.5,
            "repetition_penalty": 1.3,
        },
    },
    {
        "name": "allowed_token_ids",
        "text": TEXT,
        "params": {"temperature": 0, "max_tokens": 5, "allowed_token_ids": [17, 28]},
    },
    {
        "name": "bad_words",
        "text": TEXT,
        "params": {"temperature": 0, "max_tokens": 24, "bad_words": ["Paris"]},
    },
    {"name": "stop", "text": TEXT, "params": {"temperature": 0, "max_tokens": 32, "stop": ["."]}},
    {
        "name": "min_tokens",
        "messages": [{"role": "user", "content": "Say yes."}],
        "params": {"temperature": 0, "max_tokens": 20, "min_tokens": 20, "ignore_eos": True},
    },
    {
        "name": "seeded",
        "text": TEXT,
        "params": {
            "temperature": 0.8,
            "top_k": 20,
            "top_p": 0.9,
            "min_p": 0.05,
            "seed": 1234,
            "max_tokens": 16,
        },
    },
    {
        "name": "continue_final",
        "messages": PREFILLED,
        "chat": CONTINUE,
        "params": {"temperature": 0, "max_tokens": 12},
    },
    {
        "name": "json_object",
        "messages": JSON_ASK,
        "params": {"temperature": 0, "max_tokens": 40, "structured_outputs": {"json_object": True}},
    },
    {
        "name": "json_schema",
        "messages": JSON_ASK,
        "params": {"temperature": 0, "max_tokens": 40, "structured_outputs": {"json": SCHEMA}},
    },
    {
        "name": "choice",
        "text": "Is the sky blue? Answer:",
        "params": {
            "temperature": 0,
            "max_tokens": 5,
            "structured_outputs": {"choice": ["yes", "no"]},
        },
    },
    {
        "name": "echo_logprobs",
        "text": TEXT,
        "params": {"temperature": 0, "max_tokens": 6, "logprobs": 1, "prompt_logprobs": 1},
    },
]
