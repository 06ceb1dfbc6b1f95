"""The model's tokenizer as the gateway's answers use it: token ids back to text (echo,
logprobs), the vocabulary's size (checking a client's token ids), the chat template (Anthropic's
conversion reads it). Prompts become token ids in vLLM's renderer (``gateway.render``), never
here.

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

log = logging.getLogger(__name__)


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
        self.chat_template: str | None = getattr(self._tok, "chat_template", None) or None
        if not self.chat_template:
            log.warning("tokenizer in %s has no chat template: chat requests will fail", model_dir)
        self.encode_text("")  # settles truncation/padding before any thread encodes (above)

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=False))

    def token_text(self, token_id: int) -> str:
        """One token as text (as vLLM shows it in logprobs)."""
        return str(self._tok.decode([token_id], skip_special_tokens=False))
