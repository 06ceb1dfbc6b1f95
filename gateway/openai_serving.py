"""Serving one OpenAI completion or chat request over the core: choices (``n``, many prompts),
``echo``, logprobs, whole responses and SSE streams. Translation only; the HTTP app
(``gateway.http``) owns routes, errors and disconnect handling.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gateway import openai_format as fmt
from gateway.chat_parsing import ChoiceParser, ParsedChat
from gateway.errors import GatewayError, WorkerFailed, public_message
from gateway.events import Finish, TokenDelta, Usage
from gateway.fanout import ChoiceSpec, merged, total_usage
from gateway.generation import Generation
from gateway.http_errors import status_and_type
from gateway.openai_logprobs import LogprobFormatter
from gateway.service import GenerationService
from protos.v1 import common_pb2


@dataclass
class ChoiceState:
    """What the shaper needs to know about one choice while it streams."""

    spec: ChoiceSpec
    generation: Generation
    echo: bool
    prompt_only: bool = False  # echo of the prompt alone: generated tokens are not shown
    prompt_ids_sent: bool = False  # return_token_ids: a stream shows the prompt's ids once
    streamed: int = 0  # tokens streamed so far (continuous usage)
    offset: int = 0  # completions logprobs: text offset of the next token
    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob | None] = field(default_factory=list)
    finish: Finish | None = None
    parser: ChoiceParser | None = None  # vLLM's tool-call / reasoning parser of a chat choice


class OpenAIResponder:
    """Shapes the events of a request's choices into OpenAI bodies."""

    def __init__(
        self,
        service: GenerationService,
        shaper: fmt.ChunkShaper,
        specs: Sequence[ChoiceSpec],
        generations: Sequence[Generation],
        *,
        echo: bool,
        logprobs: int | None,
        tokens_as_ids: bool = False,
        prompt_only: bool = False,
        continuous_usage: bool = False,
        parsed: ParsedChat | None = None,
        prompt_logprobs: int | None = None,
    ) -> None:
        """``prompt_logprobs``: a whole chat answer carries the prompt's logprobs at its top,
        with that many alternatives (vLLM's, under a chat's ``echo``);
        ``continuous_usage``: every streamed chunk carries its choice's usage so far;
        ``parsed``: a chat request whose choices vLLM's parsers read (``gateway.chat_parsing``);
        ``tokens_as_ids``: logprobs name tokens by id (``gateway.openai_logprobs``).
        """
        self.continuous_usage = continuous_usage
        self.prompt_logprobs = prompt_logprobs
        self.tokens_as_ids = tokens_as_ids
        self.service = service
        self.shaper = shaper
        self.chat = shaper.chat
        self.states = [
            ChoiceState(s, g, echo, prompt_only) for s, g in zip(specs, generations, strict=True)
        ]
        self.generations = list(generations)
        if parsed is not None:
            for state in self.states:
                state.parser = parsed.choice(state.generation.token_ids)
        self.logprobs = (
            None
            if logprobs is None
            else LogprobFormatter(service.tokenizer, top=logprobs, as_token_ids=tokens_as_ids)
        )

    def routing_headers(self) -> dict[str, str]:
        return self.generations[0].routing_headers()

    def _echo_text(self, state: ChoiceState) -> str:
        prompt = state.spec.request.prompt
        if prompt.text is not None:
            return prompt.text
        return self.service.tokenizer.decode(state.generation.token_ids)

    def _echo_logprobs(self, state: ChoiceState) -> tuple[list[int], list[Any]]:
        ids = state.generation.token_ids
        entries: list[Any] = [None, *state.generation.prompt_logprobs]
        return ids, entries

    def _logprobs_of(
        self, state: ChoiceState, token_ids: Sequence[int], entries: Sequence[Any]
    ) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        if self.chat:
            return self.logprobs.chat(entries)
        body, state.offset = self.logprobs.completion(token_ids, entries, state.offset)
        return body

    def _echo_delta(self, state: ChoiceState) -> tuple[str, dict[str, Any] | None]:
        ids, entries = self._echo_logprobs(state)
        return self._echo_text(state), self._logprobs_of(state, ids, entries)

    def usage(self) -> Usage:
        pairs = [(s.spec.prompt_index, s.finish.usage) for s in self.states if s.finish]
        return total_usage(pairs)

    async def whole(self) -> dict[str, Any]:
        """Run every choice to its end and build the response body."""
        async for position, event in merged(self.generations):
            self._record(self.states[position], event)
        results = [self._result(s) for s in self.states]
        body = self.shaper.full_response(results, self.usage())
        if self.prompt_logprobs is not None and self.states:
            top = LogprobFormatter(
                self.service.tokenizer, top=self.prompt_logprobs, as_token_ids=self.tokens_as_ids
            )
            body["prompt_logprobs"] = top.prompt(*self._echo_logprobs(self.states[0]))
        return body

    def _record(self, state: ChoiceState, event: TokenDelta | Finish) -> None:
        if isinstance(event, TokenDelta) and state.prompt_only:
            return
        if isinstance(event, TokenDelta):
            state.parts.append(event.text)
            state.token_ids.extend(event.token_ids)
            state.logprobs.extend(event.logprobs)
        else:
            state.finish = event

    def _result(self, state: ChoiceState) -> fmt.ChoiceResult:
        if state.finish is None:
            raise WorkerFailed("a generation ended without a finish")
        text = "".join(state.parts)
        logprobs = prompt_logprobs = None
        if state.echo:
            prefix, logprobs = self._echo_delta(state)
            text = prefix + text
            if self.logprobs is not None:
                prompt_logprobs = self.logprobs.prompt(*self._echo_logprobs(state))
        generated = self._logprobs_of(state, state.token_ids, state.logprobs)
        if logprobs is not None and generated is not None:
            for key, values in generated.items():
                logprobs[key].extend(values)
        elif generated is not None:
            logprobs = generated
        finish, message = state.finish, None
        if state.parser is not None:
            message, reason = state.parser.message(text, state.token_ids, finish.finish_reason)
            finish = replace(finish, finish_reason=reason)
        return fmt.ChoiceResult(
            state.spec.index,
            text,
            finish,
            logprobs,
            message=message,
            prompt_logprobs=prompt_logprobs,
            token_ids=state.token_ids,
            prompt_token_ids=state.generation.token_ids,
        )

    async def sse(self) -> AsyncIterator[str]:
        """SSE lines: role first (chat), echo, deltas, finishes, usage (if asked), [DONE]."""
        try:
            opening = self.shaper.opening([s.generation.token_ids for s in self.states])
            for chunk, state in zip(opening, self.states, strict=False):
                yield fmt.sse(self._with_usage(chunk, state))
            for state in self.states:
                if self.shaper.echoed:  # a chat's echo: the message it continues
                    chunk = self.shaper.delta(state.spec.index, self.shaper.echoed, None)
                    yield fmt.sse(self._with_usage(chunk, state))
                if state.echo:
                    text, logprobs = self._echo_delta(state)
                    chunk = self.shaper.delta(state.spec.index, text, logprobs)
                    yield fmt.sse(self._with_usage(chunk, state))
            async for position, event in merged(self.generations):
                state = self.states[position]
                if isinstance(event, Finish) or not state.prompt_only:
                    shaped = self._stream_event(state, event)
                    if shaped is not None:
                        yield fmt.sse(self._with_usage(shaped, state))
            if self.shaper.include_usage:
                yield fmt.sse(self.shaper.usage_chunk(self.usage()))
        except GatewayError as err:
            # The status line is gone already: report in-band, as vLLM does.
            _, kind = status_and_type(err)
            message = public_message(err, self.service.settings.routing_headers)
            yield fmt.sse(fmt.error_body(message, kind, err.param, err.code))
        yield "data: [DONE]\n\n"

    def _with_usage(self, chunk: dict[str, Any], state: ChoiceState) -> dict[str, Any]:
        """``chunk`` with its choice's usage so far, when the client asked for it on every
        chunk (``stream_options.continuous_usage_stats``), as vLLM counts it."""
        if self.continuous_usage:
            prompt = len(state.generation.token_ids)
            chunk["usage"] = {
                "prompt_tokens": prompt,
                "completion_tokens": state.streamed,
                "total_tokens": prompt + state.streamed,
            }
        return chunk

    def _stream_event(
        self, state: ChoiceState, event: TokenDelta | Finish
    ) -> dict[str, Any] | None:
        """The chunk of one event; None: a parser holds the text back for now."""
        parser = state.parser
        if isinstance(event, Finish):
            state.finish = event
            if parser is None:
                return self.shaper.finish(state.spec.index, event)
            delta = parser.delta("", (), finished=True)
            reason = parser.finish_reason(event.finish_reason)
            return self.shaper.finish(
                state.spec.index, replace(event, finish_reason=reason), delta or {}
            )
        state.streamed += len(event.token_ids)
        parsed = (
            None if parser is None else parser.delta(event.text, event.token_ids, finished=False)
        )
        if parser is not None and parsed is None:
            return None
        # A chunk for every delta, as vLLM sends: a token whose text is still incomplete (part
        # of a UTF-8 character) has an empty text, and leaving it out made a client see the
        # next token two steps late. (A delta has tokens or text: Generation._on_tokens.)
        logprobs = self._logprobs_of(state, event.token_ids, event.logprobs)
        prompt = None if state.prompt_ids_sent else state.generation.token_ids
        state.prompt_ids_sent = True
        return self.shaper.delta(
            state.spec.index, event.text, logprobs, event.token_ids, prompt, parsed
        )
