"""OpenAI request bodies (what vLLM's OpenAI server accepts for a text model) and their
translation to the core.

Unknown fields are ignored, as vLLM does; vLLM's fields the gateway does not honour
(``gateway.openai_fields``) and unsupported values (``suffix``, ``best_of`` > 1, non-text
content parts) are refused with a 400 naming the field rather than silently dropped. Tool
choices are served as vLLM serves them, by the parsers of ``gateway.chat_parsing``.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.errors import InvalidRequest
from gateway.interfaces import ChatOptions, ReasoningEffort, template_kwargs
from gateway.openai_fields import CHAT, COMPLETION, STRUCTURED, refuse_unsupported
from gateway.service import Prompt
from protos.v1 import common_pb2

MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_CHOICES = 64  # prompts x n in one request


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` extra parameter (exactly one kind)."""

    model_config = ConfigDict(extra="allow")  # vLLM's other fields: refused, not dropped

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None  # xgrammar's structural tag, JSON text


# The widths of the protobuf fields these travel in (SamplingParams): larger values are a 400.
UINT32_MAX = 2**32 - 1
INT32_MAX = 2**31 - 1


class _Sampling(BaseModel):
    # Fields beyond these are kept (``model_extra``) to be refused if vLLM knows them.
    model_config = ConfigDict(extra="allow")
    REFUSED: ClassVar[dict[str, tuple[Any, str]]] = {}

    model: str | None = None
    # Extra arguments for the decode engine's logits processors (SamplingParams.extra_args).
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    # The response's id (cmpl-/chatcmpl- and it) when no x-request-id header names one.
    request_id: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=UINT32_MAX)
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=2**63 - 1)
    truncation_side: Literal["left", "right"] | None = None
    cache_salt: str | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None  # logprobs name tokens "token_id:<id>"
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk (vLLM: only together with ``include_usage``)."""
        return self.include_usage and bool(
            self.stream_options and self.stream_options.continuous_usage_stats
        )

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def logprobs_count(self) -> int | None:
        """Alternatives per generated token, None: no logprobs."""
        return None

    def check_supported(self) -> None:
        refuse_unsupported(self.model_extra, self.REFUSED)
        if self.structured_outputs is not None:
            given = self.structured_outputs.model_extra
            refuse_unsupported(given, STRUCTURED, prefix="structured_outputs.")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest(
                "stream_options is only allowed with stream=true", param="stream_options"
            )
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name)
            if ids and any(t < 0 or t >= 2**32 for t in ids):
                raise InvalidRequest(f"{name} must be token ids", param=name)
        if self.allowed_token_ids == []:
            raise InvalidRequest("allowed_token_ids must not be empty", param="allowed_token_ids")

    def sampling_params(self) -> common_pb2.SamplingParams:
        """The request's sampling fields as the worker contract's message."""
        self.check_supported()
        params = common_pb2.SamplingParams(
            max_tokens=self._max_tokens() or 0,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            allowed_token_ids=self.allowed_token_ids or [],
            bad_words=self.bad_words or [],
            cache_salt=self.cache_salt,
            vllm_xargs_json=json.dumps(self.vllm_xargs) if self.vllm_xargs else "",
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
            "spaces_between_special_tokens",
            "include_stop_str_in_output",
        )
        for name in optional:
            value = getattr(self, name)
            if value is not None:
                setattr(params, name, value)
        count = self.logprobs_count()
        if count is not None:
            params.logprobs = count
        for token, bias in _logit_bias(self.logit_bias).items():
            params.logit_bias[token] = bias
        structured = _structured(self.response_format, self.structured_outputs)
        if structured is not None:
            params.structured_output.CopyFrom(structured)
        return params


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        if not key.isdigit() or int(key) >= 2**32:
            raise InvalidRequest(f"logit_bias key {key!r} is not a token id", param="logit_bias")
        if not -100 <= value <= 100:
            raise InvalidRequest("logit_bias values must be in [-100, 100]", param="logit_bias")
        out[int(key)] = value
    return out


def _structured(
    response_format: dict[str, Any] | None, extra: StructuredOutputs | None
) -> common_pb2.StructuredOutput | None:
    """``response_format`` (OpenAI) or ``structured_outputs`` (vLLM) as the worker message."""
    kind = (response_format or {}).get("type", "text")
    if kind == "json_object":
        return common_pb2.StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = (response_format or {}).get("json_schema")
        schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequest(
                "response_format.json_schema.schema must be a JSON schema object",
                param="response_format",
            )
        return common_pb2.StructuredOutput(json_schema=json.dumps(schema))
    if kind != "text":
        raise InvalidRequest(
            "response_format type must be 'text', 'json_object' or 'json_schema'",
            param="response_format",
        )
    if extra is None:
        return None
    return _structured_extra(extra)


def _structured_extra(extra: StructuredOutputs) -> common_pb2.StructuredOutput | None:
    given = {
        "json": extra.json_,
        "regex": extra.regex,
        "choice": extra.choice,
        "grammar": extra.grammar,
        "json_object": extra.json_object or None,
        "structural_tag": extra.structural_tag,
    }
    chosen = [k for k, v in given.items() if v is not None]
    if len(chosen) > 1:
        raise InvalidRequest(
            "structured_outputs takes exactly one of json, regex, choice, grammar, json_object, "
            "structural_tag",
            param="structured_outputs",
        )
    if not chosen:
        return None
    if extra.json_ is not None:
        schema = extra.json_ if isinstance(extra.json_, str) else json.dumps(extra.json_)
        return common_pb2.StructuredOutput(json_schema=schema)
    if extra.regex is not None:
        return common_pb2.StructuredOutput(regex=extra.regex)
    if extra.choice is not None:
        if not extra.choice:
            raise InvalidRequest("structured_outputs.choice is empty", param="structured_outputs")
        return common_pb2.StructuredOutput(choice=common_pb2.ChoiceList(choices=extra.choice))
    if extra.grammar is not None:
        return common_pb2.StructuredOutput(grammar=extra.grammar)
    if extra.structural_tag is not None:
        return common_pb2.StructuredOutput(structural_tag=extra.structural_tag)
    return common_pb2.StructuredOutput(json_object=True)


# vLLM's (and OpenAI's) max_tokens of a completion that names none, or null.
COMPLETION_MAX_TOKENS = 16


class CompletionRequest(_Sampling):
    REFUSED = COMPLETION

    prompt: str | list[str] | list[int] | list[list[int]]
    # 0 with echo: the prompt only (its logprobs: the scoring call of evaluation harnesses)
    max_tokens: int | None = Field(None, ge=0, le=UINT32_MAX)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True

    def logprobs_count(self) -> int | None:
        return self.logprobs

    @property
    def prompt_only(self) -> bool:
        """``echo`` with ``max_tokens`` 0: vLLM generates one token and returns the prompt."""
        return self.echo and self.max_tokens == 0

    def _max_tokens(self) -> int | None:
        if self.max_tokens is None:
            return COMPLETION_MAX_TOKENS
        return 1 if self.prompt_only else self.max_tokens

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise InvalidRequest("suffix is not supported", param="suffix")
        if self.best_of not in (None, 1):
            raise InvalidRequest("only best_of=1 is supported", param="best_of")
        if self.echo and self.return_token_ids:
            raise InvalidRequest(
                "return_token_ids with echo is not supported by pdserve yet",
                param="return_token_ids",
            )
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequest("max_tokens must be at least 1, got 0.", param="max_tokens")

    def sampling_params(self) -> common_pb2.SamplingParams:
        params = super().sampling_params()
        if self.echo and self.logprobs is not None:
            params.prompt_logprobs = self.logprobs
        return params

    def prompts(self) -> list[Prompt]:
        """One ``Prompt`` per prompt of the request (a list of strings or of id lists: many)."""
        prompt: Any = self.prompt
        if isinstance(prompt, str):
            return [self._prompt(prompt)]
        if not prompt:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if isinstance(prompt[0], int):
            return [self._prompt(prompt)]
        if len(prompt) * self.n > MAX_CHOICES:
            raise InvalidRequest(
                f"at most {MAX_CHOICES} completions (prompts x n) per request", param="prompt"
            )
        return [self._prompt(p) for p in prompt]

    def _prompt(self, prompt: str | list[int]) -> Prompt:
        text, ids = (prompt, None) if isinstance(prompt, str) else (None, tuple(prompt))
        return Prompt(
            text=text,
            token_ids=ids,
            add_special_tokens=self.add_special_tokens,
            truncate=self.truncate_prompt_tokens,
            truncation_side=self.truncation_side,
        )


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

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

    def for_template(self, index: int) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.text(index)}
        for key in ("name", "tool_calls", "tool_call_id"):
            value = getattr(self, key)
            if value is not None:
                message[key] = value
        return message


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: dict[str, Any]


class ChatCompletionRequest(_Sampling):
    REFUSED = CHAT

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[FunctionTool] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = True
    include_reasoning: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: ReasoningEffort | None = None
    echo: bool = False
    chat_template: str | None = None

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def prompt_logprobs_count(self) -> int | None:
        """As vLLM's: a whole answer under ``echo`` carries the prompt's logprobs, with
        ``top_logprobs`` alternatives (a stream has none)."""
        return (self.top_logprobs or 0) if self.echo and not self.stream else None

    def sampling_params(self) -> common_pb2.SamplingParams:
        params = super().sampling_params()
        count = self.prompt_logprobs_count()
        if count is not None:
            params.prompt_logprobs = count
        return params

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs=true", param="top_logprobs")
        self._check_tools()

    def tool_fields(self) -> dict[str, Any]:
        return {"tools": self.tools, "tool_choice": self.tool_choice}

    def _check_tools(self) -> None:
        """vLLM's checks of ``tools`` and ``tool_choice`` (its messages); whether a tool choice
        can be served depends on the gateway's parsers (``gateway.chat_parsing``)."""
        if self.tools == []:
            raise InvalidRequest(
                "`tools` must not be an empty array. Either provide at least one tool or omit "
                "the field entirely.",
                param="tools",
            )
        choice = self.tool_choice
        if choice in (None, "none"):
            return
        if not self.tools:
            raise InvalidRequest(
                "When using `tool_choice`, `tools` must be set.", param="tool_choice"
            )
        if isinstance(choice, dict):
            function = choice.get("function")
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise InvalidRequest(
                    f"Invalid value for `function`: `{function}` in `tool_choice`! Correct "
                    'usage: `{"type": "function", "function": {"name": "my_function"}}`',
                    param="tool_choice.function",
                )
            names = [t.function.get("name") for t in self.tools]
            if function["name"] not in names:
                raise InvalidRequest(
                    "The tool specified in `tool_choice` does not match any of the specified "
                    "`tools`",
                    param="tool_choice",
                )
        elif choice not in ("auto", "required"):
            raise InvalidRequest(
                f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", '
                '"auto" or "required" are supported.',
                param="tool_choice",
            )

    def answer_role(self) -> str:
        """The answer's role, as vLLM's: the assistant's, or with add_generation_prompt off
        the last message's (the answer continues it)."""
        if self.add_generation_prompt or not self.messages:
            return "assistant"
        return self.messages[-1].role

    def echoed(self) -> str:
        """With ``echo``, what vLLM puts before the answer: the last message's content when
        that message has the answer's role; else ""."""
        if not self.echo or not self.messages or self.messages[-1].role != self.answer_role():
            return ""
        return self.messages[-1].text(len(self.messages) - 1)

    def to_prompt(self) -> Prompt:
        messages = tuple(m.for_template(i) for i, m in enumerate(self.messages))
        tools = tuple(t.model_dump(exclude_none=True) for t in self.tools) if self.tools else None
        options = ChatOptions(
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            add_special_tokens=self.add_special_tokens,
            documents=tuple(self.documents) if self.documents else None,
            template_kwargs=template_kwargs(self.chat_template_kwargs, self.reasoning_effort),
            template=self.chat_template,
        )
        return Prompt(
            messages=messages,
            tools=tools,
            chat=options,
            truncate=self.truncate_prompt_tokens,
            truncation_side=self.truncation_side,
        )
