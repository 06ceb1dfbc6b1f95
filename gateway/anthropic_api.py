"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) by vLLM's
own conversion.

vLLM's ``AnthropicServingMessages`` turns a Messages request into a chat completion request
(``to_chat_completion_request``) and the chat completion, whole or streamed, back into a
message or Anthropic's stream events (``messages_full_converter``, ``message_stream_converter``).
pdserve serves the chat completion in between as any other (tools and reasoning included, with
the gateway's parsers). Only the error bodies are pdserve's: Anthropic's shape
``{"type": "error", "error": {"type", "message"}}`` with the gateway's error types.

vLLM's modules import torch (seconds, hundreds of MiB), so they are imported on the first
Messages request, off the event loop, unless the gateway has already imported vLLM for its
parsers. vLLM's converters are methods of its serving class that use no state of an instance:
they are called on one built without an engine (``object.__new__``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any

from pydantic import ValidationError

from gateway.errors import InvalidRequest, validation_message


class AnthropicApi:
    """vLLM's conversion between Anthropic messages and chat completions."""

    def __init__(self, chat_template: str | None) -> None:
        from vllm.entrypoints.anthropic import protocol
        from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

        self._protocol = protocol
        self._converter = object.__new__(AnthropicServingMessages)
        # vLLM merges inline system messages when the template insists on a leading one.
        self._merge_system = AnthropicServingMessages._detect_merge_inline_system(chat_template)

    def chat_body(self, raw: Any, count: bool = False) -> dict[str, Any]:
        """The chat completion request body of a Messages request body (``count``: of a
        count_tokens request body); 400 when invalid."""
        if not isinstance(raw, Mapping):
            raise InvalidRequest("the request body must be a JSON object")
        model: Any = self._protocol.AnthropicMessagesRequest
        if count:
            model = self._protocol.AnthropicCountTokensRequest
        try:
            request = model.model_validate(raw)
        except ValidationError as err:
            message, param = validation_message(err.errors())
            raise InvalidRequest(message, param=param) from err
        chat = self._converter.to_chat_completion_request(
            request, merge_inline_system=self._merge_system
        )
        body: dict[str, Any] = chat.model_dump(exclude_unset=True, exclude_none=True)
        return body

    def token_count(self, input_tokens: int) -> dict[str, Any]:
        """vLLM's count_tokens response."""
        response = self._protocol.AnthropicCountTokensResponse(
            input_tokens=input_tokens,
            context_management=self._protocol.AnthropicContextManagement(
                original_input_tokens=input_tokens
            ),
        )
        body: dict[str, Any] = response.model_dump(exclude_none=True)
        return body

    def message(self, completion: Mapping[str, Any]) -> dict[str, Any]:
        """A whole chat completion as vLLM's Messages response."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse

        response = ChatCompletionResponse.model_validate(completion)
        try:
            message = self._converter.messages_full_converter(response)
        except ValueError as err:
            # e.g. a tool call whose arguments are not a JSON object (a tool without "strict"
            # leaves them free): vllm serve answers 400 with the converter's message, so do we
            raise InvalidRequest(f"the answer cannot be given as a message: {err}") from err
        body: dict[str, Any] = message.model_dump(exclude_none=True)
        return body

    async def events(self, chat_sse: AsyncIterator[str]) -> AsyncIterator[str]:
        """A chat completion's SSE as Anthropic's stream events; an error chunk of the
        gateway ends the stream with Anthropic's ``error`` event."""
        failed: list[dict[str, Any]] = []

        async def until_error() -> AsyncGenerator[str, None]:
            async for item in chat_sse:
                if item.startswith('data: {"error"'):
                    failed.append(json.loads(item[len("data: ") :])["error"])
                    return
                yield item

        async for event in self._converter.message_stream_converter(until_error()):
            yield event
        if failed:
            error = self._protocol.AnthropicStreamEvent(
                type="error",
                error=self._protocol.AnthropicError(type="api_error", message=failed[0]["message"]),
            )
            yield f"event: error\ndata: {error.model_dump_json(exclude_unset=True)}\n\n"
