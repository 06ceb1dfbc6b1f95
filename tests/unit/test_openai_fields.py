"""No vLLM request field is silently dropped: each is honoured or refused with a 400."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
from typing import Any

import pytest
from pydantic_core import PydanticUndefined

from gateway.errors import InvalidRequest
from gateway.openai_fields import (
    CHAT,
    COMPLETION,
    HONOURED_CHAT,
    HONOURED_COMPLETION,
    HONOURED_RESPONSES,
    RESPONSES,
    STRUCTURED,
    refuse_unsupported,
)
from gateway.render import Renderer
from gateway.vllm_params import CARRIED, NOT_CARRIED, to_wire
from tests.helpers import renderer

MESSAGES = [{"role": "user", "content": "Hi"}]


def _vllm_default(field: Any) -> Any:
    if field.default is not PydanticUndefined:
        return field.default
    return None  # a factory (a fresh list, a random id) or required: nothing asked


@pytest.mark.parametrize(
    ("model", "vllm_path", "honoured", "refused"),
    [
        ("ChatCompletionRequest", "chat_completion", HONOURED_CHAT, CHAT),
        ("CompletionRequest", "completion", HONOURED_COMPLETION, COMPLETION),
        ("ResponsesRequest", "responses", HONOURED_RESPONSES, RESPONSES),
    ],
)
def test_every_vllm_field_is_honoured_or_refused(
    model: str, vllm_path: str, honoured: frozenset[str], refused: dict[str, tuple[Any, str]]
) -> None:
    protocol = importlib.import_module(f"vllm.entrypoints.openai.{vllm_path}.protocol")
    theirs = getattr(protocol, model).model_fields
    neither = sorted(set(theirs) - honoured - set(refused))
    assert not neither, f"vLLM fields pdserve neither honours nor refuses: {neither}"
    both = sorted(honoured & set(refused))
    assert not both, f"fields both honoured and refused: {both}"
    stale = sorted((honoured | set(refused)) - set(theirs))
    assert not stale, f"fields vLLM does not have: {stale}"
    for name, (default, _) in refused.items():
        expected = _vllm_default(theirs[name])
        assert default == expected or (default is None and expected in ([], {})), name


def test_every_sampling_field_is_carried_or_refused() -> None:
    """The wire carries every field of vLLM's SamplingParams a request can set; vLLM's new
    fields are refused by to_wire until they are carried (no silent drop)."""
    import msgspec
    from vllm import SamplingParams

    names = {f.name for f in msgspec.structs.fields(SamplingParams) if not f.name.startswith("_")}
    assert names >= CARRIED and names >= NOT_CARRIED
    assert not CARRIED & NOT_CARRIED
    with pytest.raises(InvalidRequest) as raised:
        to_wire(SamplingParams(thinking_token_budget=8))
    assert raised.value.param == "thinking_token_budget"
    wire = to_wire(SamplingParams(temperature=0.5, stop=["x"], logit_bias={3: 1.5}), "salt")
    assert wire.temperature == 0.5 and list(wire.stop) == ["x"] and wire.logit_bias[3] == 1.5
    assert wire.cache_salt == "salt" and wire.max_tokens == 16


def test_structured_outputs_fields_are_carried_or_refused() -> None:
    from vllm.sampling_params import StructuredOutputsParams

    theirs = {f.name: f.default for f in dataclasses.fields(StructuredOutputsParams)}
    kinds = {"json", "regex", "choice", "grammar", "json_object", "structural_tag"}
    public = {name for name in theirs if not name.startswith("_")}
    assert public - kinds == set(STRUCTURED)
    for name, (default, _) in STRUCTURED.items():
        assert theirs[name] == default, name


def _chat(body: dict[str, Any]) -> Any:
    return asyncio.run(renderer().chat({"messages": MESSAGES, **body}))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logprob_token_ids", [1, 2]),
        ("priority", 1),
        ("kv_transfer_params", {"do_remote_decode": True}),
        ("use_beam_search", True),
    ],
)
def test_a_refused_chat_field_is_a_400_naming_it(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequest) as raised:
        _chat({field: value})
    assert raised.value.param == field and field in str(raised.value)


def test_defaults_nulls_and_unknown_fields_pass() -> None:
    body: dict[str, Any] = {
        "cache_salt": None,
        "use_beam_search": False,
        "add_generation_prompt": True,
        "bad_words": [],
        "priority": 0,
        "vllm_xargs": {},
        "not_a_vllm_field": 7,
    }
    _chat(body)
    render: Renderer = renderer()
    asyncio.run(render.completion({"prompt": "x", "echo": False, "prompt_embeds": None}))
    with pytest.raises(InvalidRequest) as raised:
        asyncio.run(render.completion({"prompt": "x", "prompt_embeds": "abc"}))
    assert raised.value.param == "prompt_embeds"


def test_nested_fields_are_refused_by_their_path() -> None:
    tag = {"json": {"type": "object"}, "disable_any_whitespace": True}
    with pytest.raises(InvalidRequest) as raised:
        _chat({"structured_outputs": tag})
    assert raised.value.param == "structured_outputs.disable_any_whitespace"


def test_honoured_fields_reach_the_workers_message() -> None:
    body = {"allowed_token_ids": [17, 28], "bad_words": ["hello"]}
    _, rendered = _chat({**body, "spaces_between_special_tokens": False})
    params = rendered.params
    assert list(params.allowed_token_ids) == [17, 28]
    assert list(params.bad_words) == ["hello"]
    assert params.HasField("spaces_between_special_tokens")
    assert not params.spaces_between_special_tokens


def test_refuse_unsupported_names_the_first_non_default_field() -> None:
    table = {"a": (0, "why"), "b": (True, "why not")}
    refuse_unsupported({"a": 0, "b": True, "c": 5}, table)
    refuse_unsupported(None, table)
    with pytest.raises(InvalidRequest) as raised:
        refuse_unsupported({"a": 0, "b": False}, table, prefix="x.")
    assert raised.value.param == "x.b" and "why not" in str(raised.value)
