"""The model's own sampling defaults for what a gRPC request leaves unset, as ``vllm serve``
applies them to its requests.

vLLM's OpenAI server takes a request's sampling value first, then the model's
``generation_config.json`` (its ``--generation-config``: ``auto``, ``vllm`` for none, or a
directory holding that file), then its own default. vLLM's renderer reads them
(``ModelConfig.get_diff_sampling_param``, ``gateway.render.Renderer.default_sampling_params``)
and applies them to OpenAI requests itself; here they fill a gRPC request's unset fields, so
both workers see the values ``vllm serve`` would have used.
"""

from __future__ import annotations

from typing import Any

from protos.v1 import common_pb2

# The generation-config fields vLLM takes as sampling defaults (``max_new_tokens`` becomes
# ``max_tokens``: the default of a request that names none).
FIELDS = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
)


def with_defaults(
    params: common_pb2.SamplingParams, defaults: dict[str, Any]
) -> common_pb2.SamplingParams:
    """``params`` with every field the request left unset taken from ``defaults``."""
    if not defaults:
        return params
    out = common_pb2.SamplingParams()
    out.CopyFrom(params)
    for name in FIELDS:
        if name in defaults and not params.HasField(name):
            setattr(out, name, defaults[name])
    if "max_tokens" in defaults and not params.max_tokens:
        out.max_tokens = defaults["max_tokens"]
    return out
