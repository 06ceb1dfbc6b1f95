"""Extension points of the gateway, as Protocols.

- routing plugins (``Picker``) have theirs in ``gateway.routing.interfaces``.
- ``PromptTokenizer``: turns prompts into token ids (``gateway.tokenizer.HfTokenizer``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class PromptTokenizer(Protocol):
    """Prompt -> token ids, with vLLM's conventions (see ``gateway.tokenizer``).

    Raises ``gateway.errors.InvalidRequest`` for prompts it cannot render (e.g. a chat the
    template rejects).
    """

    vocab_size: int

    def encode_text(self, text: str) -> list[int]:
        """Completions prompt; special tokens (BOS) added as the model's tokenizer does."""
        ...

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Chat messages ({"role", "content", ...}) rendered with the chat template (``tools``
        passed to it), generation prompt appended, encoded without extra special tokens."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Token ids -> text (special tokens kept)."""
        ...

    def token_text(self, token_id: int) -> str:
        """One token's text, as shown in logprobs."""
        ...
