"""A request's own ``chat_template`` as vLLM's: refused with vLLM's 400 unless the gateway
trusts request templates (``trust_request_chat_template``), then the chat is rendered with it,
over HTTP, ``/tokenize`` and gRPC alike; ``/tokenize`` takes vLLM's chat fields."""

from __future__ import annotations

import grpc
import httpx
import pytest

from protos.v1 import generate_pb2, generate_pb2_grpc
from tests.helpers import gateway_cluster, tokenizer

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
MESSAGES = [{"role": "user", "content": "Hi"}]
RENDERED = "<user>Hi"
# vLLM's answer to a request's own chat template without --trust-request-chat-template.
UNTRUSTED_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)


async def test_an_untrusted_request_template_is_vllms_400() -> None:
    async with gateway_cluster() as c, httpx.AsyncClient(base_url=c.base_url) as http:
        chat = await http.post(
            "/v1/chat/completions",
            json={"messages": MESSAGES, "max_tokens": 2, "chat_template": TEMPLATE},
        )
        tokenized = await http.post(
            "/tokenize", json={"messages": MESSAGES, "chat_template": TEMPLATE}
        )
    for answer in (chat, tokenized):
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["message"] == UNTRUSTED_TEMPLATE
    assert not c.prefill.seen.requests


async def test_a_trusted_request_template_renders_the_chat_everywhere() -> None:
    expected = tokenizer().encode_text(RENDERED, add_special_tokens=False)
    async with (
        gateway_cluster(trust_request_chat_template=True) as c,
        httpx.AsyncClient(base_url=c.base_url) as http,
        grpc.aio.insecure_channel(c.grpc_target) as channel,
    ):
        chat = await http.post(
            "/v1/chat/completions",
            json={"messages": MESSAGES, "max_tokens": 2, "chat_template": TEMPLATE},
        )
        assert chat.status_code == 200, chat.text
        tokenized = await http.post(
            "/tokenize", json={"messages": MESSAGES, "chat_template": TEMPLATE}
        )
        request = generate_pb2.TokenizeRequest(
            chat_options=generate_pb2.ChatTemplateOptions(chat_template=TEMPLATE)
        )
        request.chat.messages.add(role="user", content="Hi")
        over_grpc = await generate_pb2_grpc.GenerationStub(channel).Tokenize(request)
    assert list(c.prefill.seen.requests[0].prompt_token_ids) == expected
    assert tokenized.json()["tokens"] == expected
    assert list(over_grpc.token_ids) == expected


@pytest.mark.parametrize(
    "fields, rendered",
    [
        ({}, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
        ({"add_generation_prompt": False}, "<|im_start|>user\nHi<|im_end|>\n"),
    ],
)
async def test_tokenize_renders_a_chat_with_vllms_fields(fields: dict, rendered: str) -> None:
    async with gateway_cluster() as c, httpx.AsyncClient(base_url=c.base_url) as http:
        answer = await http.post("/tokenize", json={"messages": MESSAGES, **fields})
    assert answer.status_code == 200, answer.text
    assert tokenizer().decode(answer.json()["tokens"]).endswith(rendered)
