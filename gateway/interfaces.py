"""Extension points of the gateway, as Protocols.

- routing plugins (``Picker``) have theirs in ``gateway.routing.interfaces``.
- ``PromptTokenizer``: turns prompts into token ids (``gateway.tokenizer.HfTokenizer``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class ChatOptions:
    """How a chat is rendered: vLLM's chat request fields of the same names (its defaults).

    ``template_kwargs``: extra variables for the chat template (``chat_template_kwargs``);
    ``documents``: given to the template as vLLM and transformers do."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: tuple[Mapping[str, Any], ...] | None = None
    template_kwargs: Mapping[str, Any] | None = None


DEFAULT_CHAT = ChatOptions()  # vLLM's defaults


class PromptTokenizer(Protocol):
    """Prompt -> token ids, with vLLM's conventions (see ``gateway.tokenizer``).

    Raises ``gateway.errors.InvalidRequest`` for prompts it cannot render (e.g. a chat the
    template rejects).
    """

    vocab_size: int
    model_dir: str  # where the model is (vLLM's ``root`` in /v1/models)
    truncation_side: str  # "left" or "right": the tokenizer's default
    chat_template: str | None  # the model's chat template (None: it has none)

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Completions prompt; special tokens (BOS) added as the model's tokenizer does,
        unless ``add_special_tokens`` is False."""
        ...

    def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        options: ChatOptions = DEFAULT_CHAT,
    ) -> list[int]:
        """Chat messages ({"role", "content", ...}) rendered with the chat template (``tools``
        passed to it) as ``options`` ask (by default: generation prompt appended, encoded
        without extra special tokens)."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Token ids -> text (special tokens kept)."""
        ...

    def token_text(self, token_id: int) -> str:
        """One token's text, as shown in logprobs."""
        ...
