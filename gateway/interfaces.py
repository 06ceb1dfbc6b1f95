"""Extension points of the gateway, as Protocols.

- routing plugins (``Picker``) have theirs in ``gateway.routing.interfaces``.
- ``PromptTokenizer``: the model's tokenizer as the answers use it
  (``gateway.tokenizer.HfTokenizer``); prompts are rendered by vLLM's (``gateway.render``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class PromptTokenizer(Protocol):
    """The model's tokenizer (see ``gateway.tokenizer``)."""

    vocab_size: int
    model_dir: str  # where the model is (vLLM's ``root`` in /v1/models)
    chat_template: str | None  # the model's chat template (None: it has none)

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> ids; special tokens (BOS) added as the model's tokenizer does, unless
        ``add_special_tokens`` is False."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Token ids -> text (special tokens kept)."""
        ...

    def token_text(self, token_id: int) -> str:
        """One token's text, as shown in logprobs."""
        ...
