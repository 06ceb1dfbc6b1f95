"""Errors of the gateway's HTTP API: OpenAI-shaped JSON with the right status, never a 500."""

from __future__ import annotations

from typing import Any

import grpc
import httpx
import openai
import pytest

from pdserve.bench.fake_worker import FakeDecode, FakePrefill
from tests.helpers import REQUESTS, counted, dead_address, gateway_cluster, served_name

CHAT = [{"role": "user", "content": "Hi"}]


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["x-request-id"]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return dict(error)


async def _post(base_url: str, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=base_url) as http:
        return await http.post(path, json=body, **kwargs)


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, None),  # vLLM names no field
        (
            {"messages": [{"content": "no role"}]},
            "messages.0.ChatCompletionDeveloperMessageParam.role",  # vLLM's
        ),
        ({"messages": CHAT, "temperature": -1}, "temperature"),
        ({"messages": CHAT, "top_p": 1.5}, "top_p"),
        ({"messages": CHAT, "max_tokens": "many"}, "max_tokens"),
        ({"messages": CHAT, "n": 0}, None),
        ({"messages": CHAT, "n": 1000}, "n"),
        ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "logprobs"),
        ({"messages": CHAT, "tools": [{"type": "function"}]}, "tools.0.function"),
        ({"messages": CHAT, "tool_choice": "required", "tools": []}, "tools"),
        ({"messages": CHAT, "tool_choice": "required"}, "tool_choice"),
        ({"messages": CHAT, "tool_choice": "sometimes", "tools": TOOLS}, "tool_choice"),
        ({"messages": CHAT, "response_format": {"type": "xml"}}, "response_format.type"),
        ({"messages": CHAT, "response_format": {"type": "json_schema"}}, "response_format"),
        ({"messages": CHAT, "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"messages": CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None),
        ({}, "messages"),
        ({"messages": CHAT, "cache_salt": ""}, "cache_salt"),
        ({"messages": CHAT, "cache_salt": "a/b"}, "cache_salt"),
        ({"messages": CHAT, "cache_salt": "x" * 129}, "cache_salt"),
        # vLLM's fields pdserve does not honour yet: refused, never dropped (openai_fields)
        ({"messages": CHAT, "priority": 2}, "priority"),
        ({"messages": CHAT, "continue_final_message": True}, None),  # with a generation prompt
        ({"messages": CHAT, "kv_transfer_params": {"remote_host": "x"}}, "kv_transfer_params"),
        (
            {
                "messages": CHAT,
                "structured_outputs": {"regex": "a", "disable_any_whitespace": True},
            },
            "structured_outputs.disable_any_whitespace",
        ),
        (
            {"messages": CHAT, "structured_outputs": {"regex": "a", "structural_tag": "{}"}},
            "structured_outputs",  # one kind at a time
        ),
        ({"messages": CHAT, "allowed_token_ids": []}, "allowed_token_ids"),
    ],
)
async def test_bad_chat_bodies_are_400(body: dict, param: str | None) -> None:
    async with gateway_cluster() as c:
        response = await _post(c.base_url, "/v1/chat/completions", body)
    error = assert_openai_error(response, 400, param)
    assert error["type"] == "invalid_request_error"
    assert c.decode is not None and not c.decode.seen.requests


async def test_bad_completion_bodies_are_400() -> None:
    async with gateway_cluster() as c:
        json_header = {"content-type": "application/json"}
        not_json = await _post(
            c.base_url, "/v1/completions", None, content=b"{not json", headers=json_header
        )
        not_object = await _post(c.base_url, "/v1/completions", ["prompt"])
        no_prompt = await _post(c.base_url, "/v1/completions", {"max_tokens": 3})
        empty = await _post(c.base_url, "/v1/completions", {"prompt": ""})
        empty_list = await _post(c.base_url, "/v1/completions", {"prompt": []})
        bad_id = await _post(c.base_url, "/v1/completions", {"prompt": [1, 10**9]})
        logprobs = await _post(c.base_url, "/v1/completions", {"prompt": "x", "logprobs": 21})
        suffix = await _post(c.base_url, "/v1/completions", {"prompt": "x", "suffix": "y"})
        truncate = await _post(
            c.base_url, "/v1/completions", {"prompt": "x", "truncate_prompt_tokens": -2}
        )
        # vLLM's defaults of refused fields and fields vLLM does not know go through
        defaults = await _post(
            c.base_url,
            "/v1/completions",
            {"prompt": "x", "max_tokens": 2, "use_beam_search": False, "unknown_field": 1},
        )
    assert "JSON" in assert_openai_error(not_json, 400)["message"]
    assert "JSON object" in assert_openai_error(not_object, 400)["message"]
    assert_openai_error(no_prompt, 400, "prompt")
    assert_openai_error(empty, 400, "prompt")
    assert_openai_error(empty_list, 400)
    assert "vocabulary" in assert_openai_error(bad_id, 400, "prompt")["message"]
    assert_openai_error(logprobs, 400, "logprobs")
    assert_openai_error(suffix, 400, "suffix")
    assert_openai_error(truncate, 400, "truncate_prompt_tokens")
    assert defaults.status_code == 200, defaults.text


async def test_unknown_model_is_404() -> None:
    async with gateway_cluster() as c:
        response = await _post(
            c.base_url, "/v1/chat/completions", {"model": "gpt-4o", "messages": CHAT}
        )
        client = c.openai()
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="gpt-4o", messages=CHAT)  # type: ignore[arg-type]
        await client.close()
    error = assert_openai_error(response, 404, "model")
    assert error["code"] == "model_not_found"
    assert "gpt-4o" in error["message"]


async def test_prompt_too_long_is_400() -> None:
    prefill, decode = FakePrefill(max_model_len=32), FakeDecode(max_model_len=32)
    async with gateway_cluster(prefill=prefill, decode=decode) as c:
        long_chat = [{"role": "user", "content": "word " * 100}]
        too_long = await _post(
            c.base_url, "/v1/chat/completions", {"model": served_name(), "messages": long_chat}
        )
        too_many = await _post(
            c.base_url, "/v1/completions", {"prompt": "Hello", "max_tokens": 1000, "stream": True}
        )
        client = c.openai()
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model=served_name(), messages=long_chat)  # type: ignore[arg-type]
        await client.close()
    error = assert_openai_error(too_long, 400, "input_tokens")  # vLLM's
    assert error["code"] == "context_length_exceeded" and "32" in error["message"]
    assert_openai_error(too_many, 400, "max_tokens")
    assert not prefill.seen.requests and not decode.seen.requests


async def test_no_decode_worker_is_503_and_unhealthy() -> None:
    async with gateway_cluster(decode=None, extra_decode=[dead_address()]) as c:
        chat = await _post(c.base_url, "/v1/chat/completions", {"messages": CHAT})
        stream = await _post(c.base_url, "/v1/completions", {"prompt": "x", "stream": True})
        async with httpx.AsyncClient(base_url=c.base_url) as http:
            health = await http.get("/health")
            metrics = (await http.get("/metrics")).text
    assert assert_openai_error(chat, 503)["code"] == "no_worker_available"
    assert_openai_error(stream, 503)
    assert health.status_code == 503
    labels = {"endpoint": "chat_completions", "outcome": "unavailable", "path": "none"}
    assert counted(metrics, REQUESTS, model=served_name(), **labels) == 1


async def test_unknown_route_and_method_are_openai_shaped() -> None:
    async with gateway_cluster() as c, httpx.AsyncClient(base_url=c.base_url) as http:
        missing = await http.get("/v1/nothing")
        wrong_method = await http.get("/v1/chat/completions")
    assert_openai_error(missing, 404)
    assert_openai_error(wrong_method, 405)


async def test_an_unexpected_error_is_a_500_and_the_connection_stays_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug is one 500 (its traceback logged once) and costs the client's keep-alive
    connection nothing: the next request on it is answered."""
    async with gateway_cluster() as c, httpx.AsyncClient(base_url=c.base_url) as http:
        assert c.gateway.service is not None

        def broken() -> None:
            raise RuntimeError("a bug")

        monkeypatch.setattr(c.gateway.service, "models", broken)
        failed = await http.get("/v1/models")
        after = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    error = assert_openai_error(failed, 500)
    assert error["type"] == "server_error" and "a bug" not in error["message"]
    assert after.status_code == 200, after.text


async def test_worker_refusing_the_request_is_400_not_a_fallback() -> None:
    prefill = FakePrefill()
    prefill.fail_with = grpc.StatusCode.INVALID_ARGUMENT
    async with gateway_cluster(prefill=prefill) as c:
        response = await _post(c.base_url, "/v1/chat/completions", {"messages": CHAT})
    error = assert_openai_error(response, 400)
    assert "scripted prefill failure" in error["message"]
    assert c.decode is not None and not c.decode.seen.requests


async def test_truncated_prompts_reach_the_workers_truncated() -> None:
    ids = list(range(100, 130))
    async with gateway_cluster() as c:
        answers = []
        for side in ("left", "right"):
            body = {"prompt": ids, "max_tokens": 2, "truncate_prompt_tokens": 8}
            answers.append(
                await _post(c.base_url, "/v1/completions", {**body, "truncation_side": side})
            )
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
        assert answers[0].json()["usage"]["prompt_tokens"] == 8
        assert c.decode is not None
        seen = [list(r.prompt_token_ids) for r in c.decode.seen.requests]
    assert ids[-8:] in seen and ids[:8] in seen


async def test_a_cache_salt_reaches_both_workers() -> None:
    async with gateway_cluster() as c:
        body = {"messages": CHAT, "max_tokens": 2, "cache_salt": "tenant-a"}
        salted = await _post(c.base_url, "/v1/chat/completions", body)
        plain = await _post(c.base_url, "/v1/chat/completions", {**body, "cache_salt": None})
    assert salted.status_code == plain.status_code == 200
    assert c.prefill is not None and c.decode is not None
    for seen in (c.prefill.seen.requests, c.decode.seen.requests):
        assert [r.params.cache_salt if r.params.HasField("cache_salt") else None for r in seen] == [
            "tenant-a",
            None,
        ]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("shown", [True, False])
async def test_errors_name_no_worker_address_when_routing_headers_are_off(
    shown: bool, stream: bool
) -> None:
    failing = FakeDecode(fail_after=1)  # one token out: a stream fails in-band
    async with gateway_cluster(decode=failing, routing_headers=shown) as c:
        address = c.gateway.settings.decode_workers[0]
        body = {"prompt": "x", "max_tokens": 4, "stream": stream}
        reply = await _post(c.base_url, "/v1/completions", body)
    text = reply.text if stream else assert_openai_error(reply, 503)["message"]
    assert "decode worker" in text and (address in text) == shown, text
