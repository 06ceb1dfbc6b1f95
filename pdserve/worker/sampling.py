"""Translation of ``pdserve.v1.SamplingParams`` into vLLM's ``SamplingParams``."""

from __future__ import annotations

import json
from typing import Any

from pdserve.sampling_fields import OPTIONAL
from pdserve.worker.errors import InvalidRequest
from protos.v1 import common_pb2


def to_vllm(
    params: common_pb2.SamplingParams, max_model_len: int, prompt_len: int, **extra: Any
) -> Any:
    """vLLM SamplingParams; ``extra`` sets fields such as ``output_kind`` or ``extra_args``."""
    from vllm import SamplingParams

    kwargs: dict[str, Any] = {f: getattr(params, f) for f in OPTIONAL if params.HasField(f)}
    room = max_model_len - prompt_len
    if room <= 0:
        raise InvalidRequest(
            f"prompt has {prompt_len} tokens; the model's context is {max_model_len} tokens"
        )
    kwargs["max_tokens"] = min(params.max_tokens or room, room)
    kwargs["stop"] = list(params.stop) or None
    kwargs["stop_token_ids"] = list(params.stop_token_ids) or None
    kwargs["ignore_eos"] = params.ignore_eos
    kwargs["min_tokens"] = params.min_tokens
    kwargs["allowed_token_ids"] = list(params.allowed_token_ids) or None
    kwargs["bad_words"] = list(params.bad_words) or None
    if params.logit_bias:
        kwargs["logit_bias"] = {int(t): float(b) for t, b in params.logit_bias.items()}
    if params.HasField("structured_output"):
        kwargs["structured_outputs"] = _structured(params.structured_output)
    kwargs.update(extra)
    if params.vllm_xargs_json:
        try:
            xargs = json.loads(params.vllm_xargs_json)
        except ValueError as exc:
            raise InvalidRequest(f"vllm_xargs is not JSON: {exc}") from exc
        if not isinstance(xargs, dict):
            raise InvalidRequest("vllm_xargs must be a JSON object")
        # pdserve's own entries (the KV hand-off) win over a client's of the same name.
        kwargs["extra_args"] = {**xargs, **(kwargs.get("extra_args") or {})}
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(str(exc)) from exc


def _structured(spec: common_pb2.StructuredOutput) -> Any:
    """vLLM ``StructuredOutputsParams`` of one ``StructuredOutput`` (exactly one kind)."""
    from vllm.sampling_params import StructuredOutputsParams

    kind = spec.WhichOneof("kind")
    if kind == "json_schema":
        try:
            schema = json.loads(spec.json_schema)
        except ValueError as exc:
            raise InvalidRequest(f"structured_output.json_schema is not JSON: {exc}") from exc
        return StructuredOutputsParams(json=schema)
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "regex":
        return StructuredOutputsParams(regex=spec.regex)
    if kind == "choice":
        return StructuredOutputsParams(choice=list(spec.choice.choices))
    if kind == "grammar":
        return StructuredOutputsParams(grammar=spec.grammar)
    if kind == "structural_tag":
        return StructuredOutputsParams(structural_tag=spec.structural_tag)
    return None


# LMCache names a chunk by its tokens and the request's ``lmcache.tag.*`` settings: a salted
# request's chunks carry its salt, so the KV tier shares them only within the salt.
TIER_SALT_TAG = "lmcache.tag.cache_salt"
TIER_LORA_TAG = "lmcache.tag.lora"


def cache_salt(params: common_pb2.SamplingParams) -> str | None:
    return params.cache_salt if params.HasField("cache_salt") else None


def engine_prompt(token_ids: list[int], salt: str | None) -> Any:
    """vLLM's prompt of ``token_ids``; with a ``salt``, its blocks hash (and are cached)
    apart from every other salt's."""
    from vllm import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=token_ids)
    if salt:
        prompt["cache_salt"] = salt
    return prompt


def salted_transfer_params(
    params: dict[str, Any] | None, salt: str | None, tier: bool, lora_tag: str | None = None
) -> dict[str, Any] | None:
    """``params`` (a request's kv_transfer_params) with the salt's tag and the LoRA adapter's
    (``pdserve.worker.lora``) for a KV tier."""
    tags = {TIER_SALT_TAG: salt, TIER_LORA_TAG: lora_tag}
    tags = {name: value for name, value in tags.items() if value}
    if not (tags and tier):
        return params
    return {**(params or {}), **tags}
