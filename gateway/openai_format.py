"""OpenAI response shapes (as vLLM's OpenAI server writes them): bodies, SSE chunks, errors."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gateway.events import Finish, Usage
from gateway.service import ModelInfo


def error_body(
    message: str, kind: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def _permission(created: int) -> dict[str, Any]:
    """vLLM's ``ModelPermission`` with its defaults: what a served model allows."""
    return {
        "id": f"modelperm-{uuid.uuid4().hex}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


def models_body(models: Sequence[ModelInfo]) -> dict[str, Any]:
    created = int(time.time())
    data = [
        {
            "id": m.id,
            "object": "model",
            "created": created,
            "owned_by": "pdserve",
            "root": m.root,
            "parent": m.parent,
            "max_model_len": m.max_model_len or None,
            "permission": [_permission(created)],
        }
        for m in models
    ]
    return {"object": "list", "data": data}


@dataclass
class ChoiceResult:
    """One finished choice of a non-streamed response."""

    index: int
    text: str
    finish: Finish
    logprobs: dict[str, Any] | None = None
    token_ids: Sequence[int] = ()  # generated
    prompt_token_ids: Sequence[int] = ()
    message: dict[str, Any] | None = None  # a chat message built by vLLM's parsers
    prompt_logprobs: list[Any] | None = None  # vLLM's, of a completion under echo


class ChunkShaper:
    """Builds the JSON bodies of one completion (``chat`` or text), streamed or whole."""

    def __init__(
        self,
        request_id: str,
        model: str,
        *,
        chat: bool,
        include_usage: bool,
        return_token_ids: bool = False,
        echoed: str = "",
        role: str = "assistant",
    ) -> None:
        """``return_token_ids``: vLLM's field: each choice carries its token ids (the deltas'
        when streamed) and the prompt's (a chat's at the top, once). ``echoed``: a chat's
        ``echo``: the text every choice's message starts with (a stream sends it in a chunk
        of its own per choice, after the role). ``role``: a chat answer's role."""
        self.echoed = echoed
        self.role = role
        self.chat = chat
        self.include_usage = include_usage
        self.return_token_ids = return_token_ids
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.created = int(time.time())

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            body["usage"] = None
        return body

    def _choice(
        self,
        index: int,
        text: str | None,
        logprobs: dict[str, Any] | None = None,
        finish: Finish | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            choice["delta"] = {} if text is None else {"content": text}
        else:
            choice["text"] = text or ""
        choice.update(
            logprobs=logprobs,
            finish_reason=finish.finish_reason if finish else None,
            stop_reason=finish.stop_reason if finish else None,
        )
        return choice

    def opening(self, prompts: Sequence[Sequence[int]]) -> list[dict[str, Any]]:
        """Chat streams start with the assistant role (empty content) for every choice
        (``prompts``: each choice's prompt ids)."""
        if not self.chat:
            return []
        chunks = []
        for index, prompt in enumerate(prompts):
            choice = self._choice(index, "")
            choice["delta"] = {"role": self.role, "content": ""}
            chunk = self._chunk([choice])
            if self.return_token_ids:
                chunk["prompt_token_ids"] = list(prompt)
            chunks.append(chunk)
        return chunks

    def delta(
        self,
        index: int,
        text: str,
        logprobs: dict[str, Any] | None,
        token_ids: Sequence[int] = (),
        prompt_token_ids: Sequence[int] | None = None,
        parsed: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """``prompt_token_ids``: with ``return_token_ids``, on a completion choice's first
        chunk; ``parsed``: a chat delta built by vLLM's parsers, in place of ``text``."""
        choice = self._choice(index, text, logprobs)
        if parsed is not None:
            choice["delta"] = parsed
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
            if prompt_token_ids is not None and not self.chat:
                choice["prompt_token_ids"] = list(prompt_token_ids)
        return self._chunk([choice])

    def finish(
        self, index: int, finish: Finish, parsed: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """``parsed``: what a chat's parsers flush at the end (e.g. a call's last arguments)."""
        choice = self._choice(index, None if self.chat else "", None, finish)
        if parsed is not None:
            choice["delta"] = parsed
        if self.return_token_ids:
            choice["token_ids"] = []
        return self._chunk([choice])

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        body = self._chunk([])
        body["usage"] = usage_body(usage)
        return body

    def full_response(self, results: Sequence[ChoiceResult], usage: Usage) -> dict[str, Any]:
        choices = []
        for result in sorted(results, key=lambda r: r.index):
            choice: dict[str, Any] = {"index": result.index}
            if self.chat:
                message = {"role": self.role, "content": result.text}
                if result.message is not None:  # built by vLLM's parsers
                    message = {**result.message, "role": self.role}
                if self.echoed:
                    message["content"] = self.echoed + (message.get("content") or "")
                choice["message"] = message
            else:
                choice["text"] = result.text
            choice.update(
                logprobs=result.logprobs,
                finish_reason=result.finish.finish_reason,
                stop_reason=result.finish.stop_reason,
            )
            if self.return_token_ids:
                choice["token_ids"] = list(result.token_ids)
                if not self.chat:
                    choice["prompt_token_ids"] = list(result.prompt_token_ids)
            if result.prompt_logprobs is not None:
                choice["prompt_logprobs"] = result.prompt_logprobs
            choices.append(choice)
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage_body(usage),
        }
        if self.return_token_ids and self.chat and results:
            body["prompt_token_ids"] = list(results[0].prompt_token_ids)
        return body
