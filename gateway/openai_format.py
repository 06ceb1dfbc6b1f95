"""OpenAI response shapes (as vLLM's OpenAI server writes them): bodies, SSE chunks, errors."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from gateway.generation import Finish, Usage
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


def models_body(models: Sequence[ModelInfo]) -> dict[str, Any]:
    created = int(time.time())
    data = [
        {
            "id": m.id,
            "object": "model",
            "created": created,
            "owned_by": "pdserve",
            "root": m.id,
            "parent": None,
            "max_model_len": m.max_model_len or None,
        }
        for m in models
    ]
    return {"object": "list", "data": data}


def validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """A one-line message and the offending field from pydantic/FastAPI validation errors."""
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ())]
    if loc and loc[0] == "body":
        loc = loc[1:]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if param is None and first.get("type") == "missing":
        return "the request body is missing", None
    if param is None:
        return "the request body must be a JSON object", None
    message = str(first.get("msg", "invalid value"))
    return (f"{param}: {message}" if param else message), param


class ChunkShaper:
    """Builds the JSON bodies of one completion (``chat`` or text), streamed or whole."""

    def __init__(self, request_id: str, model: str, *, chat: bool, include_usage: bool) -> None:
        self.chat = chat
        self.include_usage = include_usage
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
        self, text: str | None, finish_reason: str | None = None, stop_reason: str | None = None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = {} if text is None else {"content": text}
        else:
            choice["text"] = text or ""
        choice.update(logprobs=None, finish_reason=finish_reason, stop_reason=stop_reason)
        return choice

    def opening(self) -> list[dict[str, Any]]:
        """Chat streams start with the assistant role (empty content); text streams do not."""
        if not self.chat:
            return []
        choice = self._choice("")
        choice["delta"] = {"role": "assistant", "content": ""}
        return [self._chunk([choice])]

    def delta(self, text: str) -> dict[str, Any]:
        return self._chunk([self._choice(text)])

    def closing(self, finish: Finish) -> list[dict[str, Any]]:
        """The finish chunk, then (``stream_options.include_usage``) the usage-only chunk."""
        last = self._choice(None, finish.finish_reason, finish.stop_reason or None)
        chunks = [self._chunk([last])]
        if self.include_usage:
            usage = self._chunk([])
            usage["usage"] = usage_body(finish.usage)
            chunks.append(usage)
        return chunks

    def full_response(self, text: str, finish: Finish) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice.update(
            logprobs=None,
            finish_reason=finish.finish_reason,
            stop_reason=finish.stop_reason or None,
        )
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage_body(finish.usage),
        }
