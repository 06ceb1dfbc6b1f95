"""Every field of vLLM's request models is honoured or refused, never dropped.

vLLM's renderer (``gateway.render``) reads each request with vLLM's own
``ChatCompletionRequest``, ``CompletionRequest`` or ``ResponsesRequest``: what it turns into
the prompt's token ids or into ``SamplingParams`` (carried to the workers field by field,
``gateway.vllm_params``, which refuses any sampling field it cannot carry) is honoured, and so
are the fields that shape the answer, which the gateway reads (``gateway.openai_request``, and
vLLM's own Responses serving: ``gateway.responses_api``). The fields pdserve does not serve
yet, or that cannot work under disaggregation, are refused with a 400 naming them when a
request sets one to anything but vLLM's default. Fields outside vLLM's request models are
ignored, as vLLM ignores them. ``tests/unit/test_openai_fields.py`` fails when vLLM gains a
field that is in neither list.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.errors import InvalidRequest

_LATER = "not supported by pdserve yet"
_PD = "not available under disaggregated serving: pdserve moves the KV itself"

# vLLM's fields that its renderer turns into the prompt or the sampling parameters, or that
# the gateway's answer reads. Both endpoints.
HONOURED_COMMON = frozenset(
    {
        # the prompt
        "add_special_tokens", "truncate_prompt_tokens", "truncation_side", "cache_salt",
        # sampling (gateway.vllm_params)
        "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
        "stop_token_ids", "n", "presence_penalty", "frequency_penalty", "repetition_penalty",
        "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
        "include_stop_str_in_output", "allowed_token_ids", "bad_words", "logit_bias",
        "response_format", "structured_outputs", "vllm_xargs", "logprobs",
        # the answer (gateway.openai_request)
        "model", "request_id", "stream", "stream_options", "echo", "return_token_ids",
        "return_tokens_as_token_ids", "user",
    }
)  # fmt: skip
HONOURED_CHAT = HONOURED_COMMON | {
    "messages", "tools", "tool_choice", "parallel_tool_calls", "include_reasoning",
    "add_generation_prompt", "continue_final_message", "documents", "chat_template",
    "chat_template_kwargs", "reasoning_effort", "max_completion_tokens", "top_logprobs",
}  # fmt: skip
HONOURED_COMPLETION = HONOURED_COMMON | {"prompt", "suffix"}
# vLLM's ResponsesRequest (``/v1/responses``, stateless): what its renderer and
# ``to_sampling_params`` read, what vLLM's answer echoes (metadata, service_tier, prompt,
# max_tool_calls) and what vllm serve itself only accepts (store without its store,
# prompt_cache_key).
HONOURED_RESPONSES = frozenset(
    {
        "input", "instructions", "previous_input_messages", "tools", "tool_choice",
        "parallel_tool_calls", "reasoning", "include_reasoning", "chat_template_kwargs",
        "truncation", "cache_salt", "max_output_tokens", "temperature", "top_p", "top_k",
        "min_p", "seed", "stop", "stop_token_ids", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
        "logit_bias", "text", "structured_outputs", "vllm_xargs", "include", "top_logprobs",
        "model", "request_id", "stream", "enable_response_messages", "user", "metadata",
        "service_tier", "prompt", "max_tool_calls", "store", "prompt_cache_key",
    }
)  # fmt: skip

# field -> (vLLM's default, why it is refused). Both endpoints.
COMMON: dict[str, tuple[Any, str]] = {
    "use_beam_search": (False, "beam search is " + _LATER),
    "length_penalty": (1.0, "beam search is " + _LATER),
    "watermarking": (None, _LATER),
    "prompt_logprobs": (None, _LATER + " on this endpoint"),
    "logprob_token_ids": (None, _LATER),
    "priority": (0, "priority scheduling is " + _LATER),
    "session_id": (None, _LATER),
    "routed_experts_prompt_start": (0, _LATER),
    "return_token_offsets": (False, _LATER),
    "mm_payload": ("tensors", "multimodal input is " + _LATER),
    "return_mm_kwargs": (None, "multimodal input is " + _LATER),
    "kv_transfer_params": (None, _PD),
    "ec_transfer_params": (None, _PD),
    "repetition_detection": (None, _LATER),
    "thinking_token_budget": (None, "reasoning is " + _LATER),
    "stream_interval": (None, _LATER),
}

CHAT: dict[str, tuple[Any, str]] = {
    **COMMON,
    "media_io_kwargs": (None, "multimodal input is " + _LATER),
    "mm_processor_kwargs": (None, "multimodal input is " + _LATER),
    "return_prompt_text": (None, _LATER),
}

COMPLETION: dict[str, tuple[Any, str]] = {
    **COMMON,
    "prompt_embeds": (None, "prompt embeddings are " + _LATER),
}

RESPONSES: dict[str, tuple[Any, str]] = {
    name: COMMON[name]
    for name in ("watermarking", "priority", "session_id", "mm_payload", "return_mm_kwargs",
                 "kv_transfer_params", "ec_transfer_params")
}  # fmt: skip
RESPONSES |= {
    "media_io_kwargs": CHAT["media_io_kwargs"],
    "mm_processor_kwargs": CHAT["mm_processor_kwargs"],
    "background": (False, "not served: pdserve stores no responses"),
    "previous_response_id": (
        None,
        "not served: pdserve stores no responses (send the conversation in "
        "`previous_input_messages` or `input`)",
    ),
}

# vLLM's StructuredOutputsParams fields beyond the one kind the workers are given.
STRUCTURED: dict[str, tuple[Any, str]] = {
    "disable_any_whitespace": (False, _LATER),
    "disable_additional_properties": (False, _LATER),
    "whitespace_pattern": (None, _LATER),
}


def _is_default(value: Any, default: Any) -> bool:
    # An explicit null, or an empty list or object, asks for nothing either.
    return value is None or value == default or (value in ([], {}) and not default)


def refuse_unsupported(
    given: Mapping[str, Any] | None, refused: Mapping[str, tuple[Any, str]], prefix: str = ""
) -> None:
    """400 for the first field of ``given`` (a request's fields beyond the gateway's model)
    that ``refused`` lists and that differs from vLLM's default."""
    for name, value in (given or {}).items():
        entry = refused.get(name)
        if entry is not None and not _is_default(value, entry[0]):
            raise InvalidRequest(f"`{prefix}{name}` is {entry[1]}", param=prefix + name)
