"""gRPC's chat fields become the OpenAI body HTTP clients send, so vLLM's renderer gives a gRPC
chat the ids it gives the same chat over HTTP (``gateway.grpc_api.chat_body``; compared end to
end in tests/integration/test_gateway_client.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway.errors import InvalidRequest
from gateway.grpc_api import chat_body
from protos.v1 import generate_pb2
from tests.helpers import renderer

MESSAGES = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]


def _request(**options: object) -> generate_pb2.GenerateRequest:
    chat = generate_pb2.ChatMessages(
        messages=[generate_pb2.ChatMessage(**m) for m in MESSAGES]  # type: ignore[arg-type]
    )
    return generate_pb2.GenerateRequest(
        chat=chat,
        chat_options=generate_pb2.ChatTemplateOptions(**options),  # type: ignore[arg-type]
    )


def _ids(body: dict) -> list[int]:
    return asyncio.run(renderer().chat(body))[1].token_ids


def test_unset_options_are_vllms_defaults() -> None:
    body = chat_body(_request())
    assert body == {"messages": MESSAGES, "max_completion_tokens": 1}


@pytest.mark.parametrize(
    "kwargs, effort",
    [({"custom": 1}, "low"), ({"enable_thinking": True}, "none"), (None, "high"), ({"a": 2}, "")],
)
def test_options_give_the_template_what_the_http_fields_give(
    kwargs: dict | None, effort: str
) -> None:
    grpc_body = chat_body(
        _request(
            add_generation_prompt=False,
            continue_final_message=True,
            chat_template_kwargs_json=json.dumps(kwargs) if kwargs else "",
            reasoning_effort=effort,
        )
    )
    http_body = {
        "messages": MESSAGES,
        "max_completion_tokens": 1,
        "add_generation_prompt": False,
        "continue_final_message": True,
        **({"chat_template_kwargs": kwargs} if kwargs else {}),
        **({"reasoning_effort": effort} if effort else {}),
    }
    assert grpc_body == http_body
    assert _ids(grpc_body) == _ids(http_body)


@pytest.mark.parametrize(
    "options, param",
    [
        ({"chat_template_kwargs_json": "[1]"}, "chat_template_kwargs_json"),
        ({"chat_template_kwargs_json": "{"}, "chat_template_kwargs_json"),
    ],
)
def test_bad_options_are_refused_naming_the_field(options: dict, param: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        chat_body(_request(**options))
    assert err.value.param == param


def test_a_bad_reasoning_effort_is_vllms_400() -> None:
    with pytest.raises(InvalidRequest) as err:
        _ids(chat_body(_request(reasoning_effort="extreme")))
    assert err.value.param == "reasoning_effort"
