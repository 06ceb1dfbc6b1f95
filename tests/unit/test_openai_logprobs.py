"""Logprobs as vLLM's OpenAI server writes them, tokens as text or as ids
(``return_tokens_as_token_ids``)."""

from __future__ import annotations

from typing import Any, cast

from gateway.interfaces import PromptTokenizer
from gateway.openai_logprobs import LogprobFormatter
from protos.v1 import common_pb2

TEXTS = {5: "He", 6: "llo", 7: "!"}


class _Tokenizer:
    def token_text(self, token_id: int) -> str:
        return TEXTS[token_id]


def _formatter(as_token_ids: bool) -> LogprobFormatter:
    tokenizer = cast(PromptTokenizer, _Tokenizer())
    return LogprobFormatter(tokenizer, top=1, as_token_ids=as_token_ids)


def _entry(token_id: int, logprob: float, alt: int) -> common_pb2.TokenLogprob:
    top = [common_pb2.TopLogprob(token_id=alt, logprob=logprob - 1)]
    return common_pb2.TokenLogprob(token_id=token_id, logprob=logprob, top=top)


ENTRIES = [_entry(5, -0.5, 7), _entry(6, -0.25, 7)]


def test_completion_tokens_as_ids_and_their_offsets() -> None:
    texts, end = _formatter(False).completion([5, 6], ENTRIES, offset=3)
    assert texts["tokens"] == ["He", "llo"] and texts["text_offset"] == [3, 5] and end == 8
    ids, end = _formatter(True).completion([5, 6], ENTRIES, offset=3)
    assert ids["tokens"] == ["token_id:5", "token_id:6"]
    assert ids["text_offset"] == [3, 13] and end == 23  # as vLLM: the placeholders' lengths
    assert ids["top_logprobs"][0] == {"token_id:7": -1.5, "token_id:5": -0.5}


def test_chat_tokens_as_ids_with_vllms_bytes() -> None:
    body: dict[str, Any] = _formatter(True).chat(ENTRIES)
    first = body["content"][0]
    # as vLLM: the sampled token's bytes are its text's, an alternative's its placeholder's
    assert first["token"] == "token_id:5" and first["bytes"] == list(b"He")
    assert first["top_logprobs"][0]["token"] == "token_id:7"
    assert first["top_logprobs"][0]["bytes"] == list(b"token_id:7")
    assert _formatter(False).chat(ENTRIES)["content"][1]["token"] == "llo"
