"""Tool calls and reasoning in chat output, by vLLM's own parsers (``vllm.parser``).

Configured as ``vllm serve`` is configured: ``--tool-call-parser``, ``--enable-auto-tool-choice``
and ``--reasoning-parser``. vLLM (and with it torch) is imported only when one of them is set, so
a gateway without parsers starts as light as before; with one, start-up pays vLLM's import.

Per chat request, as vLLM's chat serving does it: vLLM's ``ChatCompletionRequest`` validates the
body (``tools``, ``tool_choice``, ``parallel_tool_calls``, ``include_reasoning``); the parser
adjusts it (structured output that forces the call of a "required" or named ``tool_choice``,
special tokens kept for the parser to see); and one vLLM ``Parser`` per choice turns what the
choice generates into reasoning, content and tool calls, whole or delta by delta. What remains
here is the glue vLLM's serving layer has around its parsers: the message's shape, the
``finish_reason`` of a call, ``parallel_tool_calls: false``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.errors import InvalidRequest
from gateway.offload import Offload
from protos.v1 import common_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParserSettings:
    """vLLM's front-end flags of the same names."""

    tool_call_parser: str = ""
    reasoning_parser: str = ""
    enable_auto_tool_choice: bool = False

    @property
    def any(self) -> bool:
        return bool(self.tool_call_parser or self.reasoning_parser)


def unparsed_tool_choice_error(tools: Any, tool_choice: Any) -> InvalidRequest | None:
    """vLLM's answer to a tool choice sent to a server without a tool-call parser: "auto" (the
    default when ``tools`` are given) needs ``--enable-auto-tool-choice`` and
    ``--tool-call-parser``, "required" or a named function ``--tool-call-parser``; "none" (and
    no tools) is served."""
    choice = "auto" if tool_choice is None and tools else tool_choice
    if choice in (None, "none"):
        return None
    if choice == "auto":
        return InvalidRequest(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
            "to be set",
            param="tool_choice",
        )
    if isinstance(choice, Mapping):
        described = f'function "{(choice.get("function") or {}).get("name")}"'
    else:
        described = f'"{choice}"'
    return InvalidRequest(
        f"tool_choice={described} requires --tool-call-parser to be set", param="tool_choice"
    )


async def parse_chat(
    parsing: ChatParsing | None,
    offload: Offload,
    body: Mapping[str, Any],
    params: common_pb2.SamplingParams,
) -> ParsedChat | None:
    """A chat request (OpenAI's JSON body) as vLLM's parsers see it, their changes put into
    ``params``; None when the gateway has no parser, where a tool choice that needs one is
    vLLM's 400. vLLM's validation runs on ``offload``'s threads."""
    if parsing is None or not parsing.parses_tools:
        problem = unparsed_tool_choice_error(body.get("tools"), body.get("tool_choice"))
        if problem is not None:
            raise problem
    if parsing is None:
        return None
    parsed = await offload.run(parsing.request, body)
    parsed.adjust(params)
    return parsed


def load_parsing(settings: ParserSettings, model_dir: str, model_name: str) -> ChatParsing | None:
    """vLLM's parser for the gateway's flags, chosen as vLLM chooses it; None when there is
    none to use (no flag, or as in vLLM 0.32 a tool-call parser without
    ``--enable-auto-tool-choice``). An unknown name, or one the tokenizer cannot serve, is a
    ``ValueError`` that stops the gateway."""
    if not settings.any:
        return None
    # The heavy imports: only a gateway that was given a parser pays them.
    from vllm.parser import ParserManager
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(model_dir)
    try:
        parser = ParserManager.get_parser(
            tool_parser_name=settings.tool_call_parser or None,
            reasoning_parser_name=settings.reasoning_parser or None,
            enable_auto_tools=settings.enable_auto_tool_choice,
            model_name=model_name,
            tokenizer=tokenizer,
        )
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"cannot use the parser: {err}") from err
    if parser is None:
        log.warning(
            "--tool-call-parser is used only with --enable-auto-tool-choice (as in vLLM): "
            "chat output is not parsed"
        )
        return None
    log.info(
        "chat output parsed by vLLM's parsers: tool calls %s, reasoning %s",
        settings.tool_call_parser if parser.tool_parser_cls is not None else "off",
        settings.reasoning_parser or "off",
    )
    return ChatParsing(settings, tokenizer, parser)


class ChatParsing:
    """vLLM's parser class for this gateway's flags and the model's tokenizer (built once)."""

    def __init__(self, settings: ParserSettings, tokenizer: Any, parser_cls: Any) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        self.settings = settings
        self.tokenizer = tokenizer
        self._request_model = ChatCompletionRequest
        self.parser_cls = parser_cls
        self.parses_tools = parser_cls.tool_parser_cls is not None

    def request(self, body: Mapping[str, Any]) -> ParsedChat:
        """The body as vLLM's request, adjusted by the parser as vLLM adjusts it; a body
        vLLM refuses is an ``InvalidRequest`` with vLLM's message."""
        from pydantic import ValidationError

        try:
            request = self._request_model.model_validate(dict(body))
        except ValidationError as err:
            errors = err.errors()
            if not errors:
                raise InvalidRequest(str(err)) from err
            loc = ".".join(str(p) for p in errors[0]["loc"]) or None
            raise InvalidRequest(str(errors[0]["msg"]), param=loc) from err
        except ValueError as err:
            raise InvalidRequest(str(err), param=getattr(err, "parameter", None)) from err
        if (
            self.parser_cls.always_adjust_request
            or self.parser_cls.reasoning_parser_cls is not None
            or (request.tool_choice or "none") != "none"
        ):
            try:
                request = self.parser(request).adjust_request(request)
            except ValueError as err:
                raise InvalidRequest(str(err), param="tool_choice") from err
        return ParsedChat(self, request)

    def parser(self, request: Any) -> Any:
        """A new vLLM ``Parser`` for ``request`` (vLLM's validated request): its tools, its
        template kwargs."""
        kwargs = request.chat_template_kwargs or {}
        return self.parser_cls(self.tokenizer, request.tools, chat_template_kwargs=kwargs)


class ParsedChat:
    """One chat request as vLLM's parsers see it."""

    def __init__(self, parsing: ChatParsing, request: Any) -> None:
        self.parsing = parsing
        self.request = request

    def adjust(self, params: common_pb2.SamplingParams) -> None:
        """What the parser changed in the request, into the worker's sampling parameters: the
        structured output that forces a tool call (vLLM 0.32: xgrammar's structural tag of the
        parser's own call format, or a JSON schema) and whether special tokens are kept."""
        structured = self.request.structured_outputs
        if structured is not None and structured.structural_tag is not None:
            tag = common_pb2.StructuredOutput(structural_tag=structured.structural_tag)
            params.structured_output.CopyFrom(tag)
        elif structured is not None and structured.json is not None:
            schema = structured.json
            text = schema if isinstance(schema, str) else json.dumps(schema)
            params.structured_output.CopyFrom(common_pb2.StructuredOutput(json_schema=text))
        params.skip_special_tokens = bool(self.request.skip_special_tokens)

    def choice(self, prompt_token_ids: Sequence[int]) -> ChoiceParser:
        return ChoiceParser(self, prompt_token_ids)


class ChoiceParser:
    """One vLLM ``Parser`` for one choice: it keeps the stream's state between deltas."""

    def __init__(self, chat: ParsedChat, prompt_token_ids: Sequence[int]) -> None:
        self.chat = chat
        self.request = chat.request
        self.prompt_token_ids = list(prompt_token_ids)
        self.parser = chat.parsing.parser(self.request)
        self.parser.set_prompt_token_ids(self.prompt_token_ids)
        self.tools_streamed = False

    @property
    def _named(self) -> bool:
        choice = self.request.tool_choice
        return choice is not None and not isinstance(choice, str)

    def _auto(self) -> bool:
        return bool(
            self.chat.parsing.settings.enable_auto_tool_choice
            and self.parser.tool_parser is not None
        )

    def message(
        self, text: str, token_ids: Sequence[int], finish_reason: str
    ) -> tuple[dict[str, Any], str]:
        """The whole assistant message of a finished choice and its finish_reason, in the
        branches of vLLM's chat serving."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatMessage

        request = self.request
        reasoning, content, calls = self.parser.parse(
            text, request, enable_auto_tools=self._auto(), model_output_token_ids=token_ids
        )
        if not request.include_reasoning:
            reasoning = None
        required = request.tool_choice == "required"
        tool_calls: list[Any] = []
        if self._named or required:
            tool_calls, content = self._tool_calls(calls), content or ""
        elif self._auto() and request.tools and request.tool_choice in ("auto", None):
            tool_calls = self._tool_calls(calls)
        message = ChatMessage(
            role="assistant", reasoning=reasoning, content=content, tool_calls=tool_calls
        )
        # OpenAI's finish_reason of a call: "tool_calls" for auto and required, "stop" named.
        if (tool_calls and not self._named and not required) or (
            required and finish_reason == "stop"
        ):
            finish_reason = "tool_calls"
        return message.model_dump(mode="json"), finish_reason

    def _tool_calls(self, calls: Sequence[Any] | None) -> list[Any]:
        from vllm.entrypoints.generate.base.protocol import ToolCall
        from vllm.renderers.chat_utils import make_tool_call_id

        made = [ToolCall(id=c.id or make_tool_call_id(), function=c) for c in calls or []]
        return made[:1] if self.request.parallel_tool_calls is False else made

    def delta(
        self, text: str, token_ids: Sequence[int], *, finished: bool
    ) -> dict[str, Any] | None:
        """The delta of one streamed chunk (None: nothing to show yet)."""
        delta = self.parser.parse_delta(
            text,
            list(token_ids),
            self.request,
            prompt_token_ids=self.prompt_token_ids,
            finished=finished,
        )
        if delta is None:
            return None
        if delta.tool_calls:
            if self.request.parallel_tool_calls is False:
                delta.tool_calls = [c for c in delta.tool_calls if c.index == 0]
            self.tools_streamed = self.tools_streamed or bool(delta.tool_calls)
        body: dict[str, Any] = delta.model_dump(mode="json", exclude_none=True)
        if not body.get("tool_calls"):
            body.pop("tool_calls", None)
        return body or None

    def finish_reason(self, reason: str) -> str:
        """A stream's finish_reason: "tool_calls" once calls were streamed (not named)."""
        if self.tools_streamed and not self._named and reason == "stop":
            return "tool_calls"
        return reason
