"""The model's generation config as the default of what a request leaves unset (as vLLM)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.sampling_defaults import load_defaults, with_defaults
from protos.v1 import common_pb2


def _model(tmp_path: Path, config: dict) -> str:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_the_models_generation_config_fills_what_the_request_leaves_unset(
    tmp_path: Path,
) -> None:
    model = _model(
        tmp_path,
        {"temperature": 0.3, "top_k": 5, "max_new_tokens": 7, "eos_token_id": 2, "top_p": None},
    )
    defaults = load_defaults("auto", model)
    assert defaults == {"temperature": 0.3, "top_k": 5, "max_tokens": 7}
    filled = with_defaults(common_pb2.SamplingParams(top_k=9), defaults)
    assert filled.temperature == pytest.approx(0.3) and filled.top_k == 9
    assert filled.max_tokens == 7 and not filled.HasField("top_p")
    assert with_defaults(common_pb2.SamplingParams(max_tokens=3), defaults).max_tokens == 3
    assert load_defaults("vllm", model) == {}  # vLLM's neutral defaults
    assert load_defaults(model, "/nonexistent") == defaults  # a directory named by the flag


def test_no_generation_config_means_no_defaults(tmp_path: Path) -> None:
    assert load_defaults("auto", str(tmp_path)) == {}
    with pytest.raises(ValueError, match=r"generation_config\.json"):
        load_defaults(str(tmp_path), "/nonexistent")
    params = common_pb2.SamplingParams()
    assert with_defaults(params, {}) is params


def test_the_default_model_has_no_sampling_defaults() -> None:
    from tests.helpers import model_dir

    assert load_defaults("auto", model_dir()) == {}
