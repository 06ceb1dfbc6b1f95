"""How a request's answer is shaped, read from vLLM's own request model (``gateway.render``
validated the body with it): streaming and usage, echo, logprobs, token ids, the answer's role.
Each rule is vLLM's OpenAI serving's (its chat and completion ``serving.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AnswerShape:
    chat: bool
    stream: bool = False
    include_usage: bool = False
    # usage on every streamed chunk (vLLM: only together with include_usage)
    continuous_usage: bool = False
    echo: bool = False  # a completion's: the prompt text precedes the answer
    prompt_only: bool = False  # echo with max_tokens 0: the prompt alone
    logprobs: int | None = None  # alternatives per generated token; None: no logprobs
    return_token_ids: bool = False
    tokens_as_ids: bool = False  # logprobs name tokens "token_id:<id>"
    echoed: str = ""  # a chat's echo: the last message's content that the answer continues
    role: str = "assistant"
    prompt_logprobs: int | None = None  # a whole chat answer's prompt_logprobs alternatives


def _usage(request: Any) -> tuple[bool, bool]:
    options = request.stream_options if request.stream else None
    include = bool(options and options.include_usage)
    return include, include and bool(options and options.continuous_usage_stats)


def completion_shape(request: Any) -> AnswerShape:
    """vLLM ``CompletionRequest``'s answer."""
    include, continuous = _usage(request)
    return AnswerShape(
        chat=False,
        stream=bool(request.stream),
        include_usage=include,
        continuous_usage=continuous,
        echo=bool(request.echo),
        prompt_only=bool(request.echo) and request.max_tokens == 0,
        logprobs=request.logprobs,
        return_token_ids=bool(request.return_token_ids),
        tokens_as_ids=bool(request.return_tokens_as_token_ids),
    )


def chat_shape(request: Any) -> AnswerShape:
    """vLLM ``ChatCompletionRequest``'s answer."""
    include, continuous = _usage(request)
    top = request.top_logprobs or 0
    return AnswerShape(
        chat=True,
        stream=bool(request.stream),
        include_usage=include,
        continuous_usage=continuous,
        logprobs=top if request.logprobs else None,
        return_token_ids=bool(request.return_token_ids),
        tokens_as_ids=bool(request.return_tokens_as_token_ids),
        echoed=echoed(request),
        role=answer_role(request),
        prompt_logprobs=top if request.echo and not request.stream else None,
    )


def answer_role(request: Any) -> str:
    """The assistant's, or without a generation prompt the last message's (the answer
    continues it)."""
    if request.add_generation_prompt or not request.messages:
        return "assistant"
    return str(request.messages[-1]["role"])


def echoed(request: Any) -> str:
    """With ``echo``, the last message's content when that message has the answer's role."""
    if not request.echo or not request.messages:
        return ""
    last = request.messages[-1]
    if last.get("role") != answer_role(request):
        return ""
    content = last.get("content") or ""
    if isinstance(content, str):
        return content
    return "\n".join(str(part.get("text", "")) for part in content)
