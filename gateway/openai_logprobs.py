"""Logprobs in OpenAI's two shapes, as vLLM's OpenAI server writes them.

Completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` (top: a dict of
token text -> logprob, the sampled token included); chat: ``{"content": [{"token", "logprob",
"bytes", "top_logprobs": [...]}]}`` with ``top_logprobs`` entries. ``None`` stands for a token
without a log probability (the first prompt token under ``echo``). With ``as_token_ids``
(vLLM's ``return_tokens_as_token_ids``) each token of either shape is written
``"token_id:<id>"`` instead of its text, and completions' ``text_offset`` advances by those
strings, as vLLM's do; ``prompt_logprobs`` keep their ``decoded_token``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.interfaces import PromptTokenizer
from protos.v1 import common_pb2

_FLOOR = -9999.0  # vLLM clamps -inf to this so that the JSON stays valid


def _lp(value: float) -> float:
    return max(float(value), _FLOOR)


class LogprobFormatter:
    def __init__(self, tokenizer: PromptTokenizer, *, top: int, as_token_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.top = top
        self.as_token_ids = as_token_ids

    def _text(self, token_id: int) -> str:
        return self.tokenizer.token_text(token_id)

    def _shown(self, token_id: int) -> str:
        """A generated (or echoed) token as the logprobs name it."""
        return f"token_id:{token_id}" if self.as_token_ids else self._text(token_id)

    def prompt(
        self, token_ids: Sequence[int], entries: Sequence[common_pb2.TokenLogprob | None]
    ) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs`` of a completion choice under ``echo`` with ``logprobs``:
        per prompt token None (the first) or ``{token id: {"logprob", "rank",
        "decoded_token"}}``, the token first, then the top alternatives."""
        out: list[dict[str, Any] | None] = []
        for token_id, entry in zip(token_ids, entries, strict=False):
            if entry is None:
                out.append(None)
                continue
            top = list(entry.top[: self.top])  # ranked: the likeliest first
            ranks = {t.token_id: i + 1 for i, t in enumerate(top)}
            ranked = {token_id: (entry.logprob, ranks.get(token_id) or entry.rank or None)}
            ranked |= {t.token_id: (t.logprob, ranks[t.token_id]) for t in top}
            out.append(
                {
                    str(t): {"logprob": _lp(lp), "rank": rank, "decoded_token": self._text(t)}
                    for t, (lp, rank) in ranked.items()
                }
            )
        return out

    def completion(
        self,
        token_ids: Sequence[int],
        entries: Sequence[common_pb2.TokenLogprob | None],
        offset: int,
    ) -> tuple[dict[str, Any], int]:
        """The logprobs object of ``token_ids`` whose text starts at ``offset``; returns it and
        the offset after them."""
        body: dict[str, Any] = {
            "text_offset": [],
            "token_logprobs": [],
            "tokens": [],
            "top_logprobs": [],
        }
        for token_id, entry in zip(token_ids, entries, strict=False):
            text = self._shown(token_id)
            body["tokens"].append(text)
            body["text_offset"].append(offset)
            offset += len(text)
            if entry is None:
                body["token_logprobs"].append(None)
                body["top_logprobs"].append(None)
                continue
            body["token_logprobs"].append(_lp(entry.logprob))
            top = {self._shown(t.token_id): _lp(t.logprob) for t in entry.top[: self.top + 1]}
            top.setdefault(text, _lp(entry.logprob))
            body["top_logprobs"].append(top)
        return body, offset

    def chat(self, entries: Sequence[common_pb2.TokenLogprob]) -> dict[str, Any]:
        return {"content": [self._chat_entry(e) for e in entries]}

    def _chat_entry(self, entry: common_pb2.TokenLogprob) -> dict[str, Any]:
        # A sampled token's bytes are its text's even when it is shown by id; an
        # alternative's are those of what is shown (vLLM's _create_chat_logprobs).
        text = self._text(entry.token_id)
        return {
            "token": self._shown(entry.token_id),
            "logprob": _lp(entry.logprob),
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {
                    "token": (alt := self._shown(t.token_id)),
                    "logprob": _lp(t.logprob),
                    "bytes": list(alt.encode("utf-8")),
                }
                for t in entry.top[: self.top]
            ],
        }
