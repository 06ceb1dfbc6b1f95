"""The model's generation config as the default of what a gRPC request leaves unset (as vLLM;
vLLM's renderer applies it to OpenAI requests itself)."""

from __future__ import annotations

import pytest

from gateway.sampling_defaults import with_defaults
from protos.v1 import common_pb2


def test_the_defaults_fill_what_the_request_leaves_unset() -> None:
    defaults = {"temperature": 0.3, "top_k": 5, "max_tokens": 7}
    filled = with_defaults(common_pb2.SamplingParams(top_k=9), defaults)
    assert filled.temperature == pytest.approx(0.3) and filled.top_k == 9
    assert filled.max_tokens == 7 and not filled.HasField("top_p")
    assert with_defaults(common_pb2.SamplingParams(max_tokens=3), defaults).max_tokens == 3
    params = common_pb2.SamplingParams()
    assert with_defaults(params, {}) is params


def test_the_default_model_has_no_sampling_defaults() -> None:
    from tests.helpers import renderer

    assert renderer().default_sampling_params == {}
