"""OpenAI request bodies (the subset the gateway serves) and their translation to the core.

Unknown fields are ignored, as vLLM does; known but unsupported features (n > 1, logprobs,
tools, logit_bias, echo, ...) are refused with a 400 naming the field rather than silently
dropped.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gateway.errors import InvalidRequest
from gateway.service import Prompt
from protos.v1 import common_pb2


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def check_supported(self) -> None:
        if self.n != 1:
            raise InvalidRequest("only n=1 is supported", param="n")
        if self.logit_bias:
            raise InvalidRequest("logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest(
                "stream_options is only allowed with stream=true", param="stream_options"
            )

    def sampling_params(self) -> common_pb2.SamplingParams:
        """The request's sampling fields as the worker contract's message."""
        self.check_supported()
        params = common_pb2.SamplingParams(
            max_tokens=self._max_tokens() or 0,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
        )
        optional = (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "seed",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "skip_special_tokens",
            "include_stop_str_in_output",
        )
        for name in optional:
            value = getattr(self, name)
            if value is not None:
                setattr(params, name, value)
        return params


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs is not None:
            raise InvalidRequest("logprobs are not supported by this gateway yet", param="logprobs")
        if self.echo:
            raise InvalidRequest("echo is not supported", param="echo")
        if self.suffix:
            raise InvalidRequest("suffix is not supported", param="suffix")
        if self.best_of not in (None, 1):
            raise InvalidRequest("only best_of=1 is supported", param="best_of")

    def to_prompt(self) -> Prompt:
        prompt: Any = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise InvalidRequest("only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return Prompt(text=prompt)
        return Prompt(token_ids=tuple(prompt))


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None

    def text(self, index: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise InvalidRequest(
                    f"content part type {part.type!r} is not supported (text only)",
                    param=f"messages.{index}.content",
                )
        # vLLM joins text parts with newlines for string-content chat templates.
        return "\n".join(part.text or "" for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs or self.top_logprobs:
            raise InvalidRequest("logprobs are not supported by this gateway yet", param="logprobs")
        if self.tools:
            raise InvalidRequest("tools are not supported", param="tools")
        if self.tool_choice not in (None, "none"):
            raise InvalidRequest("tool_choice is not supported", param="tool_choice")
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise InvalidRequest(
                "only response_format type 'text' is supported", param="response_format"
            )

    def to_prompt(self) -> Prompt:
        messages = tuple(
            {"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)
        )
        return Prompt(messages=messages)
