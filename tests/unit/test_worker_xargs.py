"""vLLM's ``vllm_xargs`` reaches the decode engine's ``SamplingParams.extra_args`` (where custom
logits processors read it), beside pdserve's own KV hand-off, which wins a name clash."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.worker.errors import InvalidRequest
from pdserve.worker.sampling import to_vllm
from protos.v1 import common_pb2
from tests.helpers import renderer

MESSAGES = [{"role": "user", "content": "hi"}]


def test_xargs_travel_from_the_request_to_the_engines_extra_args() -> None:
    xargs = {"target_token": 7, "words": ["a", "b"], "kv_transfer_params": "theirs"}
    _, rendered = asyncio.run(renderer().chat({"messages": MESSAGES, "vllm_xargs": xargs}))
    params = rendered.params
    assert json.loads(params.vllm_xargs_json) == xargs
    ours = {"kv_transfer_params": {"do_remote_prefill": True}}
    sampling = to_vllm(params, 100, 10, extra_args=ours)
    assert sampling.extra_args == {"target_token": 7, "words": ["a", "b"], **ours}
    assert to_vllm(common_pb2.SamplingParams(), 100, 10).extra_args in (None, {})


@pytest.mark.parametrize("text", ["[1]", "{"])
def test_xargs_that_are_not_an_object_are_refused(text: str) -> None:
    with pytest.raises(InvalidRequest):
        to_vllm(common_pb2.SamplingParams(vllm_xargs_json=text), 100, 10)
