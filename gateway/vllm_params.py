"""vLLM's ``SamplingParams`` (what vLLM's renderer made of a request) as the worker contract's
``pdserve.v1.SamplingParams``; the workers turn it back (``pdserve.worker.sampling.to_vllm``).

Every value vLLM resolved (the request's, else the model's ``generation_config``, else vLLM's
default) is written out, so both workers sample exactly as ``vllm serve``'s engine would. ``n``
is not: the gateway starts one generation per choice (``gateway.fanout``).
"""

from __future__ import annotations

import json
from typing import Any

from gateway.errors import InvalidRequest
from pdserve.sampling_fields import OPTIONAL
from protos.v1 import common_pb2

# vLLM's SamplingParams fields that are not a request's to choose: the gateway's (one
# generation per choice), the workers' (how their engines stream, clone and detokenize) or
# derived by vLLM from the others (the private ones, the prefix-cache read of prompt logprobs).
NOT_CARRIED = frozenset(
    {
        "n",
        "output_kind",
        "detokenize",
        "skip_clone",
        "output_text_buffer_length",
        "skip_reading_prefix_cache",
    }
)
CARRIED = frozenset(
    {
        *OPTIONAL,
        "max_tokens",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "min_tokens",
        "allowed_token_ids",
        "bad_words",
        "logit_bias",
        "extra_args",
        "structured_outputs",
    }
)

# The widths of the protobuf fields (larger values are a 400 naming the field).
_UINT32 = 2**32


def to_wire(params: Any, cache_salt: str | None = None) -> common_pb2.SamplingParams:
    """The wire message of vLLM ``SamplingParams`` (one choice), with the request's salt; a
    field the wire does not carry and the request set is a 400 naming it, never dropped."""
    refuse_uncarried(params)
    stop = params.stop
    wire = common_pb2.SamplingParams(
        max_tokens=_uint32(params.max_tokens or 0, "max_tokens"),
        stop=[stop] if isinstance(stop, str) else list(stop or []),
        stop_token_ids=_ids(params.stop_token_ids, "stop_token_ids"),
        ignore_eos=params.ignore_eos,
        min_tokens=_uint32(params.min_tokens, "min_tokens"),
        allowed_token_ids=_ids(params.allowed_token_ids, "allowed_token_ids"),
        bad_words=list(params.bad_words or []),
        cache_salt=cache_salt,
    )
    for name in OPTIONAL:
        value = getattr(params, name)
        if value is None:
            continue
        try:
            setattr(wire, name, value)
        except ValueError as err:  # wider than the wire's field
            raise InvalidRequest(f"{name} is out of range: {value}", param=name) from err
    for token, bias in (params.logit_bias or {}).items():
        wire.logit_bias[_uint32(int(token), "logit_bias")] = float(bias)
    if params.extra_args:
        wire.vllm_xargs_json = json.dumps(params.extra_args)
    structured = _structured(params.structured_outputs)
    if structured is not None:
        wire.structured_output.CopyFrom(structured)
    return wire


def refuse_uncarried(params: Any) -> None:
    """400 for the first field of ``params`` that the wire does not carry and that differs
    from vLLM's default (a request asked for it: e.g. ``thinking_token_budget``)."""
    import msgspec

    for spec in msgspec.structs.fields(type(params)):
        name = spec.name
        if name in CARRIED or name in NOT_CARRIED or name.startswith("_"):
            continue
        default = None if spec.default is msgspec.NODEFAULT else spec.default
        if getattr(params, name) != default:
            raise InvalidRequest(f"`{name}` is not supported by pdserve yet", param=name)


def _uint32(value: int, param: str) -> int:
    if not 0 <= value < _UINT32:
        raise InvalidRequest(f"{param} must be in [0, {_UINT32 - 1}]", param=param)
    return value


def _ids(ids: list[int] | None, param: str) -> list[int]:
    return [_uint32(t, param) for t in ids or []]


def _structured(spec: Any) -> common_pb2.StructuredOutput | None:
    """vLLM ``StructuredOutputsParams`` (exactly one kind) as the wire's ``StructuredOutput``."""
    if spec is None:
        return None
    if spec.json is not None:
        schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
        return common_pb2.StructuredOutput(json_schema=schema)
    if spec.regex is not None:
        return common_pb2.StructuredOutput(regex=spec.regex)
    if spec.choice is not None:
        return common_pb2.StructuredOutput(choice=common_pb2.ChoiceList(choices=spec.choice))
    if spec.grammar is not None:
        return common_pb2.StructuredOutput(grammar=spec.grammar)
    if spec.structural_tag is not None:
        return common_pb2.StructuredOutput(structural_tag=spec.structural_tag)
    if spec.json_object:
        return common_pb2.StructuredOutput(json_object=True)
    return None
