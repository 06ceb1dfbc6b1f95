"""Sampling checks and the max_tokens rule of the gateway core."""

from __future__ import annotations

import pytest

from gateway.errors import InvalidRequest, PromptTooLong
from gateway.params import check_sampling, resolve_max_tokens
from protos.v1 import common_pb2


def test_absent_max_tokens_fills_the_context_or_the_default() -> None:
    params = common_pb2.SamplingParams(temperature=0.7)
    assert resolve_max_tokens(params, 10, 100, 0).max_tokens == 90
    assert resolve_max_tokens(params, 10, 100, 16).max_tokens == 16
    assert resolve_max_tokens(params, 95, 100, 16).max_tokens == 5
    assert resolve_max_tokens(params, 10, 0, 16).max_tokens == 16  # context unknown
    assert resolve_max_tokens(params, 10, 0, 0).max_tokens == 0
    resolved = resolve_max_tokens(params, 10, 100, 0)
    assert resolved.temperature == pytest.approx(0.7)
    assert params.max_tokens == 0  # the request's message is not mutated


def test_context_overflow_is_prompt_too_long() -> None:
    with pytest.raises(PromptTooLong) as err:
        resolve_max_tokens(common_pb2.SamplingParams(), 100, 100, 0, prompt_param="messages")
    assert err.value.param == "messages"
    with pytest.raises(PromptTooLong) as err:
        resolve_max_tokens(common_pb2.SamplingParams(max_tokens=101), 10, 100, 0)
    assert err.value.param == "max_tokens" and "max_model_len=100" in str(err.value)
    # beyond the room the prompt leaves but within the context: clamped, as vLLM does
    assert resolve_max_tokens(common_pb2.SamplingParams(max_tokens=91), 10, 100, 0).max_tokens == 90
    assert resolve_max_tokens(common_pb2.SamplingParams(max_tokens=90), 10, 100, 0).max_tokens == 90
    assert resolve_max_tokens(common_pb2.SamplingParams(max_tokens=100), 10, 0, 0).max_tokens == 100


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (common_pb2.SamplingParams(temperature=-0.1), "temperature"),
        (common_pb2.SamplingParams(top_p=0.0), "top_p"),
        (common_pb2.SamplingParams(top_k=-2), "top_k"),
        (common_pb2.SamplingParams(min_p=1.5), "min_p"),
        (common_pb2.SamplingParams(presence_penalty=3), "presence_penalty"),
        (common_pb2.SamplingParams(repetition_penalty=0), "repetition_penalty"),
        (common_pb2.SamplingParams(logprobs=21), "logprobs"),
        (common_pb2.SamplingParams(prompt_logprobs=21), "prompt_logprobs"),
        (common_pb2.SamplingParams(max_tokens=2, min_tokens=3), "min_tokens"),
    ],
)
def test_bad_sampling_names_the_field(params: common_pb2.SamplingParams, field: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        check_sampling(params)
    assert err.value.param == field


def test_good_sampling_passes() -> None:
    check_sampling(common_pb2.SamplingParams(temperature=0, top_p=1, top_k=-1, min_p=0, seed=1))


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "min_tokens", "top_k"])
def test_integers_wider_than_their_proto_field_are_refused(field: str) -> None:
    """A value that does not fit the worker API's field is a 400 naming it (or vLLM's clamp to
    the context), never an overflow inside the gateway (it was a 500)."""
    import asyncio

    from tests.helpers import renderer

    body = {"messages": [{"role": "user", "content": "x"}], field: 5_057_919_199}
    try:
        _, rendered = asyncio.run(renderer().chat(body))
    except InvalidRequest as err:
        assert field in str(err) or err.param == field
        return
    assert rendered.params.max_tokens < 2**32  # vLLM clamped it to the context
