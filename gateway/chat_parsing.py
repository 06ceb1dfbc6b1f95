"""Tool calls and reasoning in chat output, by vLLM's own parsers (``vllm.parser``).

Configured as ``vllm serve`` is configured (``--tool-call-parser``, ``--enable-auto-tool-choice``,
``--reasoning-parser``): vLLM's renderer (``gateway.render``) picks the parser class for those
flags, validates each chat request and lets the parser adjust it (the structured output that
forces the call of a "required" or named ``tool_choice``, special tokens kept for the parser to
see). Here one vLLM ``Parser`` per choice turns what the choice generates into reasoning,
content and tool calls, whole or delta by delta, with the glue vLLM's chat serving has around
its parsers: the message's shape, the ``finish_reason`` of a call, ``parallel_tool_calls:
false``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from protos.v1 import common_pb2


class ChatParsing:
    """vLLM's parser class for the gateway's flags (``parser_cls``: what vLLM's renderer chose
    for them) and the model's tokenizer."""

    def __init__(self, enable_auto_tool_choice: bool, tokenizer: Any, parser_cls: Any) -> None:
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tokenizer = tokenizer
        self.parser_cls = parser_cls

    def parsed(self, request: Any) -> ParsedChat:
        """``request``: vLLM's chat request as vLLM's renderer validated and adjusted it."""
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
            self.chat.parsing.enable_auto_tool_choice and self.parser.tool_parser is not None
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
