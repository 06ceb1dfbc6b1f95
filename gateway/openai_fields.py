"""vLLM's request fields that the gateway does not honour yet: refused, never dropped.

``vllm serve`` 0.32 accepts these fields on ``/v1/chat/completions`` and ``/v1/completions``.
A request that sets one to anything but vLLM's default gets a 400 naming the field, so a
client never silently gets something else than it asked for. Fields outside vLLM's request
models are ignored, as vLLM ignores them. Every field of vLLM's models is either a field of
``gateway.openai_models`` (honoured) or listed here;
``tests/unit/test_openai_fields.py`` fails when vLLM gains one that is neither.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.errors import InvalidRequest

_LATER = "not supported by pdserve yet"
_PD = "not available under disaggregated serving: pdserve moves the KV itself"

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

# vLLM's StructuredOutputsParams fields beyond the one kind the gateway passes on.
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
