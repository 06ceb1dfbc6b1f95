"""Extension points of the gateway, as Protocols.

- routing plugins (``Picker``) have theirs in ``gateway.routing.interfaces``.
- ``PromptTokenizer``: turns prompts into token ids (``gateway.tokenizer.HfTokenizer``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, get_args


@dataclass(frozen=True)
class ChatOptions:
    """How a chat is rendered: vLLM's chat request fields of the same names (its defaults).

    ``template_kwargs``: extra variables for the chat template (``chat_template_kwargs``);
    ``documents``: given to the template as vLLM and transformers do; ``template``: the
    request's ``chat_template``, in place of the model's."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: tuple[Mapping[str, Any], ...] | None = None
    template_kwargs: Mapping[str, Any] | None = None
    template: str | None = None  # the request's own chat template (trusted gateways only)


DEFAULT_CHAT = ChatOptions()  # vLLM's defaults

ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
REASONING_EFFORTS: tuple[str, ...] = get_args(ReasoningEffort)


def template_kwargs(
    kwargs: Mapping[str, Any] | None, reasoning_effort: str | None
) -> Mapping[str, Any] | None:
    """``chat_template_kwargs`` with ``reasoning_effort`` as vLLM passes it to the template:
    as a variable of its own, plus ``enable_thinking`` (false for "none") unless the kwargs
    set it (vLLM's ``build_chat_params``)."""
    if reasoning_effort is None:
        return kwargs
    merged = dict(kwargs or {})
    merged.setdefault("enable_thinking", reasoning_effort != "none")
    merged["reasoning_effort"] = reasoning_effort
    return merged


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
