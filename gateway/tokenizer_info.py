"""``GET /tokenizer_info``: vLLM's, behind vLLM's own flag (``--enable-tokenizer-info-endpoint``;
it may expose the chat template and the tokenizer's configuration).

The answer is vLLM's own: its render server's tokenization service
(``gateway.vllm_front_end``) builds it as ``vllm serve`` does, so every field,
``tokenizer_class`` (the name of vLLM's tokenizer wrapper) included, is vLLM's.
"""

from __future__ import annotations

from typing import Any


async def tokenizer_info(front_end: Any) -> dict[str, Any]:
    """vLLM's ``/tokenizer_info`` body from vLLM's front end (``gateway.vllm_front_end``)."""
    result = await front_end.serving_tokenization.get_tokenizer_info()
    body: dict[str, Any] = result.model_dump()
    return body
