"""No vLLM request field is silently dropped: each is honoured or refused with a 400."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticUndefined

from gateway.errors import InvalidRequest
from gateway.openai_fields import CHAT, COMPLETION, STRUCTURED, refuse_unsupported
from gateway.openai_models import ChatCompletionRequest, CompletionRequest

MESSAGES = [{"role": "user", "content": "Hi"}]


def _vllm_default(field: Any) -> Any:
    if field.default is not PydanticUndefined:
        return field.default
    return None  # a factory (a fresh list, a random id) or required: nothing asked


def _ours(model: type[BaseModel]) -> set[str]:
    return {f.alias or name for name, f in model.model_fields.items()}


@pytest.mark.parametrize(
    ("ours", "vllm_path", "refused"),
    [
        (ChatCompletionRequest, "chat_completion", CHAT),
        (CompletionRequest, "completion", COMPLETION),
    ],
)
def test_every_vllm_field_is_honoured_or_refused(
    ours: type[BaseModel], vllm_path: str, refused: dict[str, tuple[Any, str]]
) -> None:
    import importlib

    protocol = importlib.import_module(f"vllm.entrypoints.openai.{vllm_path}.protocol")
    theirs = getattr(protocol, ours.__name__).model_fields
    honoured = _ours(ours)
    neither = sorted(set(theirs) - honoured - set(refused))
    assert not neither, f"vLLM fields pdserve neither honours nor refuses: {neither}"
    both = sorted(honoured & set(refused))
    assert not both, f"fields both honoured and refused: {both}"
    stale = sorted(set(refused) - set(theirs))
    assert not stale, f"refused fields vLLM does not have: {stale}"
    for name, (default, _) in refused.items():
        expected = _vllm_default(theirs[name])
        assert default == expected or (default is None and expected in ([], {})), name


def test_structured_outputs_fields_are_honoured_or_refused() -> None:
    import dataclasses

    from vllm.sampling_params import StructuredOutputsParams

    from gateway.openai_models import StructuredOutputs

    theirs = {f.name: f.default for f in dataclasses.fields(StructuredOutputsParams)}
    public = {name for name in theirs if not name.startswith("_")}
    assert public - _ours(StructuredOutputs) == set(STRUCTURED)
    for name, (default, _) in STRUCTURED.items():
        assert theirs[name] == default, name


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
    request = ChatCompletionRequest(messages=MESSAGES, **{field: value})  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest) as raised:
        request.sampling_params()
    assert raised.value.param == field and field in str(raised.value)


def test_defaults_nulls_and_unknown_fields_pass() -> None:
    body: dict[str, Any] = {
        "messages": MESSAGES,
        "cache_salt": None,
        "use_beam_search": False,
        "add_generation_prompt": True,
        "bad_words": [],
        "priority": 0,
        "vllm_xargs": {},
        "not_a_vllm_field": 7,
    }
    ChatCompletionRequest(**body).sampling_params()
    CompletionRequest(prompt="x", echo=False, prompt_embeds=None).sampling_params()  # type: ignore[call-arg]
    with pytest.raises(InvalidRequest) as raised:
        CompletionRequest(prompt="x", prompt_embeds="abc").sampling_params()  # type: ignore[call-arg]
    assert raised.value.param == "prompt_embeds"


def test_nested_fields_are_refused_by_their_path() -> None:
    tag = {"json": {"type": "object"}, "disable_any_whitespace": True}
    with pytest.raises(InvalidRequest) as raised:
        ChatCompletionRequest(messages=MESSAGES, structured_outputs=tag).sampling_params()  # type: ignore[arg-type]
    assert raised.value.param == "structured_outputs.disable_any_whitespace"
    usage = {"include_usage": True, "continuous_usage_stats": True}
    asked = ChatCompletionRequest(
        messages=MESSAGES,  # type: ignore[arg-type]
        stream=True,
        stream_options=usage,  # type: ignore[arg-type]
    )
    assert asked.continuous_usage
    alone = {"continuous_usage_stats": True}  # vLLM: only together with include_usage
    assert not ChatCompletionRequest(
        messages=MESSAGES,  # type: ignore[arg-type]
        stream=True,
        stream_options=alone,  # type: ignore[arg-type]
    ).continuous_usage


def test_chat_rendering_fields_reach_the_prompt() -> None:
    request = ChatCompletionRequest(
        messages=[*MESSAGES, {"role": "assistant", "content": "Hel"}],  # type: ignore[list-item]
        add_generation_prompt=False,
        continue_final_message=True,
        add_special_tokens=True,
        documents=[{"title": "t", "text": "x"}],
        chat_template_kwargs={"enable_thinking": False},
    )
    chat = request.to_prompt().chat
    assert not chat.add_generation_prompt and chat.continue_final_message
    assert chat.add_special_tokens and chat.documents == ({"title": "t", "text": "x"},)
    assert chat.template_kwargs == {"enable_thinking": False}
    assert ChatCompletionRequest(messages=MESSAGES).to_prompt().chat.add_generation_prompt  # type: ignore[arg-type]
    prompts = CompletionRequest(prompt=["a", "b"], add_special_tokens=False).prompts()
    assert not prompts[0].add_special_tokens


def test_reasoning_effort_reaches_the_template_as_vllm_passes_it() -> None:
    def kwargs(**body: Any) -> Any:
        return ChatCompletionRequest(messages=MESSAGES, **body).to_prompt().chat.template_kwargs

    assert kwargs() is None
    assert kwargs(reasoning_effort="low") == {"reasoning_effort": "low", "enable_thinking": True}
    assert kwargs(reasoning_effort="none")["enable_thinking"] is False
    # the request's own enable_thinking wins; its reasoning_effort does not
    mine = {"enable_thinking": False, "reasoning_effort": "high"}
    assert kwargs(reasoning_effort="low", chat_template_kwargs=mine) == {
        "enable_thinking": False,
        "reasoning_effort": "low",
    }
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=MESSAGES, reasoning_effort="extreme")  # type: ignore[arg-type]


def test_honoured_fields_reach_the_workers_message() -> None:
    params = ChatCompletionRequest(
        messages=MESSAGES,  # type: ignore[arg-type]
        allowed_token_ids=[17, 28],
        bad_words=["hello"],
        spaces_between_special_tokens=False,
    ).sampling_params()
    assert list(params.allowed_token_ids) == [17, 28]
    assert list(params.bad_words) == ["hello"]
    assert params.HasField("spaces_between_special_tokens")
    assert not params.spaces_between_special_tokens
    for bad in ([], [-1]):
        with pytest.raises(InvalidRequest) as raised:
            CompletionRequest(prompt="x", allowed_token_ids=bad).sampling_params()
        assert raised.value.param == "allowed_token_ids"


def test_refuse_unsupported_names_the_first_non_default_field() -> None:
    table = {"a": (0, "why"), "b": (True, "why not")}
    refuse_unsupported({"a": 0, "b": True, "c": 5}, table)
    refuse_unsupported(None, table)
    with pytest.raises(InvalidRequest) as raised:
        refuse_unsupported({"a": 0, "b": False}, table, prefix="x.")
    assert raised.value.param == "x.b" and "why not" in str(raised.value)
