"""gRPC's ChatTemplateOptions become the chat rendering options HTTP's fields give
(``gateway.grpc_api._chat_options``; the ids are compared end to end in
tests/integration/test_gateway_client.py)."""

from __future__ import annotations

import json

import pytest

from gateway.errors import InvalidRequest
from gateway.grpc_api import _chat_options
from gateway.interfaces import DEFAULT_CHAT
from gateway.openai_models import ChatCompletionRequest
from protos.v1 import generate_pb2

MESSAGES = [{"role": "user", "content": "Hi"}]


def test_unset_options_are_vllms_defaults() -> None:
    assert _chat_options(generate_pb2.ChatTemplateOptions()) == DEFAULT_CHAT


@pytest.mark.parametrize(
    "kwargs, effort",
    [({"custom": 1}, "low"), ({"enable_thinking": True}, "none"), (None, "high"), ({"a": 2}, "")],
)
def test_options_give_the_template_what_the_http_fields_give(
    kwargs: dict | None, effort: str
) -> None:
    options = generate_pb2.ChatTemplateOptions(
        add_generation_prompt=False,
        continue_final_message=True,
        chat_template_kwargs_json=json.dumps(kwargs) if kwargs else "",
        reasoning_effort=effort,
    )
    body = ChatCompletionRequest(
        messages=MESSAGES,
        add_generation_prompt=False,
        continue_final_message=True,
        chat_template_kwargs=kwargs,
        reasoning_effort=effort or None,
    )
    assert _chat_options(options) == body.to_prompt().chat


@pytest.mark.parametrize(
    "options, param",
    [
        (generate_pb2.ChatTemplateOptions(reasoning_effort="extreme"), "reasoning_effort"),
        (
            generate_pb2.ChatTemplateOptions(chat_template_kwargs_json="[1]"),
            "chat_template_kwargs_json",
        ),
        (
            generate_pb2.ChatTemplateOptions(chat_template_kwargs_json="{"),
            "chat_template_kwargs_json",
        ),
    ],
)
def test_bad_options_are_refused_naming_the_field(
    options: generate_pb2.ChatTemplateOptions, param: str
) -> None:
    with pytest.raises(InvalidRequest) as err:
        _chat_options(options)
    assert err.value.param == param
