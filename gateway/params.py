"""Sampling-parameter checks and the max_tokens rule, shared by every endpoint.

Ranges follow vLLM's ``SamplingParams`` checks so that a request the gateway accepts is one the
workers accept too. The request's ``common_pb2.SamplingParams`` is checked and a copy with
``max_tokens`` resolved is returned; the original is never mutated.
"""

from __future__ import annotations

from gateway.errors import InvalidRequest, PromptTooLong
from protos.v1 import common_pb2

MAX_LOGPROBS = 20  # vLLM's default max_logprobs


def check_sampling(params: common_pb2.SamplingParams) -> None:
    """Raise ``InvalidRequest`` (naming the field) for values vLLM would refuse."""
    if params.HasField("temperature") and params.temperature < 0:
        raise InvalidRequest("temperature must be non-negative", param="temperature")
    if params.HasField("top_p") and not 0 < params.top_p <= 1:
        raise InvalidRequest("top_p must be in (0, 1]", param="top_p")
    if params.HasField("top_k") and params.top_k < -1:
        raise InvalidRequest("top_k must be -1 (disable), 0 (disable) or at least 1", param="top_k")
    if params.HasField("min_p") and not 0 <= params.min_p <= 1:
        raise InvalidRequest("min_p must be in [0, 1]", param="min_p")
    for name in ("presence_penalty", "frequency_penalty"):
        if params.HasField(name) and not -2 <= getattr(params, name) <= 2:
            raise InvalidRequest(f"{name} must be in [-2, 2]", param=name)
    if params.HasField("repetition_penalty") and params.repetition_penalty <= 0:
        raise InvalidRequest("repetition_penalty must be positive", param="repetition_penalty")
    for name in ("logprobs", "prompt_logprobs"):
        if params.HasField(name) and getattr(params, name) > MAX_LOGPROBS:
            raise InvalidRequest(f"{name} must be at most {MAX_LOGPROBS}", param=name)
    if params.max_tokens and params.min_tokens > params.max_tokens:
        raise InvalidRequest("min_tokens must not exceed max_tokens", param="min_tokens")
    if params.HasField("cache_salt"):
        check_cache_salt(params.cache_salt)


# vLLM's limits on a cache salt (it becomes part of LMCache's chunk keys, which '@' and '/'
# delimit).
MAX_CACHE_SALT = 128
CACHE_SALT_FORBIDDEN = frozenset("@/\\\0")


def check_cache_salt(salt: str) -> None:
    if not salt:
        raise InvalidRequest(
            "Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt"
        )
    if len(salt) > MAX_CACHE_SALT or CACHE_SALT_FORBIDDEN & set(salt):
        raise InvalidRequest(
            "Parameter 'cache_salt' must be at most 128 characters and must not contain "
            "'@', '/', '\\', or NUL.",
            param="cache_salt",
        )


def resolve_max_tokens(
    params: common_pb2.SamplingParams,
    prompt_len: int,
    max_model_len: int,
    default_max_tokens: int,
    prompt_param: str = "prompt",
) -> common_pb2.SamplingParams:
    """A copy of ``params`` whose ``max_tokens`` is set; checks the context length as vLLM
    does: a prompt that leaves no room and a ``max_tokens`` beyond the whole context are a
    400, a ``max_tokens`` beyond the room the prompt leaves is clamped to it.

    ``max_model_len`` 0 means unknown (no worker reported it yet): no check, and an absent
    max_tokens stays 0 ("up to the context length" for the worker).
    """
    if max_model_len and prompt_len >= max_model_len:
        raise PromptTooLong(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {prompt_len} tokens, which leaves no room for generated tokens.",
            param=prompt_param,
        )
    if max_model_len and params.max_tokens > max_model_len:
        raise PromptTooLong(
            f"max_tokens={params.max_tokens} cannot be greater than "
            f"max_model_len={max_model_len}. Please request fewer output tokens.",
            param="max_tokens",
        )
    room = max_model_len - prompt_len if max_model_len else 0
    resolved = common_pb2.SamplingParams()
    resolved.CopyFrom(params)
    wanted = params.max_tokens or default_max_tokens or room
    resolved.max_tokens = min(wanted, room) if room else wanted
    return resolved
