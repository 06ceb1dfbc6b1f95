"""The one place prompts become token ids (DESIGN.md: the gateway tokenizes ONCE).

Token parity with vLLM's OpenAI server:
- chat: the chat template is rendered to text (``add_generation_prompt=True``) and that text is
  encoded with ``add_special_tokens=False`` (the template already has BOS etc.), as vLLM's chat
  path does (its ``add_special_tokens`` defaults to False for chat); a request's
  ``ChatOptions`` change these as vLLM's fields of the same names do;
- completions: the prompt text is encoded with ``add_special_tokens=True`` (vLLM's default).

The tokenizer is loaded from the directory's ``tokenizer.json`` with transformers' fast backend
class, not ``AutoTokenizer``: importing ``AutoTokenizer`` pulls in torch, which the gateway must
never import. ``tokenizer.json`` fully defines normalisation, pre-tokenisation and special
tokens, so the ids are those of the model's own tokenizer (checked against vLLM's request path
for the default model).

Threads: the gateway calls one ``HfTokenizer`` from several threads (``gateway.offload``).
The Rust tokenizer encodes concurrently under shared borrows; what breaks it ("RuntimeError:
Already borrowed") is a concurrent *change* of its truncation/padding, which transformers
makes only when a call asks for different settings than the last. Every call here asks for
the same (none), and ``__init__`` makes the first call, so no call from a thread mutates.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from gateway.errors import InvalidRequest
from gateway.interfaces import DEFAULT_CHAT, ChatOptions

log = logging.getLogger(__name__)

# chat_template_kwargs vLLM refuses (the template is the server's; ids come from the gateway).
REFUSED_TEMPLATE_KWARGS = frozenset({"chat_template", "tokenize"})
# ``apply_chat_template``'s own arguments: set from the request's fields, not from its kwargs.
_OWN_ARGUMENTS = frozenset({"conversation", "tools", "documents", "add_generation_prompt",
                            "continue_final_message", "return_dict", "return_tensors",
                            "padding", "truncation", "max_length", "tokenizer_kwargs",
                            "return_assistant_tokens_mask"})  # fmt: skip


class HfTokenizer:
    """A Hugging Face tokenizer loaded once from a local model directory."""

    def __init__(self, model_dir: str) -> None:
        # Heavy import, only when a gateway starts; this module path does not import torch.
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        if not (Path(model_dir) / "tokenizer.json").is_file():
            raise OSError(f"{model_dir} has no tokenizer.json: the gateway needs a fast tokenizer")
        self.model_dir = model_dir
        self._tok: Any = TokenizersBackend.from_pretrained(model_dir)
        self.vocab_size = len(self._tok)
        self.eos_token_id: int | None = self._tok.eos_token_id
        # Where vLLM truncates a prompt for truncate_prompt_tokens unless the request says:
        # vLLM loads a generative model's tokenizer with truncation_side="left" (whatever its
        # tokenizer_config says), so the last tokens are kept.
        self.truncation_side: str = "left"
        self.chat_template: str | None = getattr(self._tok, "chat_template", None) or None
        if not self.chat_template:
            log.warning("tokenizer in %s has no chat template: chat requests will fail", model_dir)
        self.encode_text("")  # settles truncation/padding before any thread encodes (above)

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        options: ChatOptions = DEFAULT_CHAT,
    ) -> str:
        """The chat template applied to ``messages``, ready for the assistant's turn (or
        continuing the last message: ``options``).

        ``tools`` go to the template as vLLM passes them; a template that ignores them renders
        the same text as without."""
        if not (options.template or getattr(self._tok, "chat_template", None)):
            raise InvalidRequest("this model has no chat template; use /v1/completions")
        if options.continue_final_message and options.add_generation_prompt:
            raise InvalidRequest(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                param="continue_final_message",
            )
        extra = dict(options.template_kwargs or {})
        refused = sorted(REFUSED_TEMPLATE_KWARGS & extra.keys())
        if refused:
            raise InvalidRequest(
                f"Found unexpected chat template kwargs from request: {refused}",
                param="chat_template_kwargs",
            )
        extra = {k: v for k, v in extra.items() if k not in _OWN_ARGUMENTS}
        documents = [dict(d) for d in options.documents] if options.documents else None
        try:
            text = self._tok.apply_chat_template(
                list(messages),
                tools=tools,
                documents=documents,
                add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message,
                tokenize=False,
                **({"chat_template": options.template} if options.template else {}),
                **extra,
            )
        except (TemplateError, ValueError, TypeError, KeyError) as err:  # e.g. bad roles
            message = f"cannot apply the chat template: {err}"
            raise InvalidRequest(message, param="messages") from err
        return str(text)

    def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        options: ChatOptions = DEFAULT_CHAT,
    ) -> list[int]:
        text = self.render_chat(messages, tools, options)
        return list(self._tok.encode(text, add_special_tokens=options.add_special_tokens))

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=False))

    def token_text(self, token_id: int) -> str:
        """One token as text (as vLLM shows it in logprobs)."""
        return str(self._tok.decode([token_id], skip_special_tokens=False))
