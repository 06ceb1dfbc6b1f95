"""OpenAI's Responses API (``POST /v1/responses``, stateless) answered by vLLM's own serving.

vLLM's renderer renders the request (``Renderer.responses``: vLLM's ``ResponsesRequest``,
``render_responses_request``); pdserve generates it as any other request (one prefill, the KV
moved, one decode); vLLM's ``OpenAIServingResponses`` builds the answer from the generation:
the output items (text, reasoning, function calls by vLLM's parsers, logprobs), the usage, the
status and, streamed, every one of its events in order. vLLM's serving reads a generation as a
sequence of its engine's ``RequestOutput`` deltas fed to its ``SimpleContext``; ``outputs``
turns the gateway's events into exactly those. vLLM's serving is built once, over the
renderer's model configuration and parsers, with an engine stand-in that only names them
(``_FrontEndOnly``): it is never asked to generate.

pdserve stores no responses: ``previous_response_id`` and ``background`` are refused by name
(``gateway.openai_fields``), and ``GET /v1/responses/{id}`` answers vLLM's 404, as
``vllm serve`` does without its store.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from gateway.errors import GatewayError, NotFound, public_message
from gateway.events import Event, Finish, TokenDelta
from gateway.generation import Generation
from gateway.http_errors import status_and_type
from gateway.interfaces import PromptTokenizer
from gateway.render import Renderer, vllm_error
from protos.v1 import common_pb2


class _FrontEndOnly:
    """What vLLM's serving classes read from their engine client at construction; no engine
    behind it (the gateway generates)."""

    errored = False
    dead_error = None

    def __init__(self, state: Any) -> None:
        self.vllm_config = state.vllm_config
        self.model_config = state.vllm_config.model_config
        self.renderer = state.online_renderer.renderer
        self.input_processor = None


class ResponsesApi:
    """vLLM's ``OpenAIServingResponses`` over the gateway's generations."""

    def __init__(self, renderer: Renderer, tokenizer: PromptTokenizer) -> None:
        from vllm.entrypoints.launchers.cli_args import resolve_default_chat_template_kwargs
        from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses
        from vllm.renderers.chat_utils import load_chat_template

        state, args = renderer.state, renderer.state.args
        structured = state.vllm_config.structured_outputs_config
        self._serving = OpenAIServingResponses(
            _FrontEndOnly(state),  # type: ignore[arg-type]
            state.openai_serving_models,
            state.online_renderer,
            request_logger=None,
            chat_template=load_chat_template(args.chat_template),
            chat_template_content_format=args.chat_template_content_format,
            return_tokens_as_token_ids=args.return_tokens_as_token_ids,
            enable_auto_tools=args.enable_auto_tool_choice,
            tool_parser=args.tool_call_parser,
            tool_strict_level=args.tool_strict_level,
            reasoning_parser=args.reasoning_parser or structured.reasoning_parser,
            default_chat_template_kwargs=resolve_default_chat_template_kwargs(args),
        )
        self._tokenizer = state.online_renderer.renderer.get_tokenizer()
        self._token_text = tokenizer.token_text

    def check(self, request: Any) -> None:
        """vLLM's own checks of a Responses request beyond its model (400s)."""
        error = self._serving._validate_create_responses_input(request)
        if error is not None:
            raise vllm_error(error.error)

    def not_found(self, response_id: str) -> NotFound:
        """vLLM's answer to a stored response asked for: pdserve stores none (a 404)."""
        info = self._serving._make_not_found_error(response_id).error
        return NotFound(info.message, param=info.param)

    def _arguments(self, request: Any, params: Any, generation: Generation) -> tuple[Any, ...]:
        """What vLLM's full and stream generators take: the request, its sampling parameters,
        vLLM's context fed by the generation (and the context), the model's name, the
        tokenizer and the request's metadata."""
        context = self._context(request, generation.token_ids)
        outputs = _contexts(context, self.outputs(request, generation))
        name = self._model_name(request)
        return request, params, outputs, context, name, self._tokenizer, _metadata(request)

    def _context(self, request: Any, prompt: Sequence[int]) -> Any:
        """vLLM's ``SimpleContext`` with the parser vLLM's serving makes for ``request``."""
        from vllm.entrypoints.openai.responses.context import SimpleContext

        serving = self._serving
        kwargs = serving._effective_chat_template_kwargs(request)
        parser = serving._make_response_parser(request, self._tokenizer, kwargs)
        if parser is not None:
            parser.set_prompt_token_ids(list(prompt))
        return SimpleContext(response_parser=parser)

    async def whole(self, request: Any, params: Any, generation: Generation) -> dict[str, Any]:
        """The response body of a generation run to its end."""
        response = await self._serving.responses_full_generator(
            *self._arguments(request, params, generation)
        )
        if hasattr(response, "error"):  # vLLM's ErrorResponse (a generation error)
            raise vllm_error(response.error)
        body: dict[str, Any] = response.model_dump(mode="json", by_alias=True)
        return body

    async def events(
        self, request: Any, params: Any, generation: Generation, routing: bool
    ) -> AsyncIterator[str]:
        """vLLM's stream events of a generation as SSE; a failure after the stream began ends
        it with vLLM's ``error`` event."""
        stream = self._serving.responses_stream_generator(
            *self._arguments(request, params, generation)
        )
        sequence = 0
        try:
            async for event in stream:
                sequence = getattr(event, "sequence_number", sequence) + 1
                data = event.model_dump_json(indent=None, by_alias=True)
                yield f"event: {event.type}\ndata: {data}\n\n"
        except GatewayError as err:
            _, kind = status_and_type(err)
            error = {
                "type": "error",
                "code": kind,
                "message": public_message(err, routing),
                "param": err.param,
                "sequence_number": sequence,
            }
            yield f"event: error\ndata: {json.dumps(error)}\n\n"

    async def outputs(self, request: Any, generation: Generation) -> AsyncIterator[Any]:
        """The generation's events as vLLM's engine delivers them: one ``RequestOutput`` per
        delta (the tokens, their text, their logprobs when asked for), the last with the
        finish reason and the cached prompt tokens."""
        from vllm.outputs import CompletionOutput, RequestOutput

        logprobs = request.is_include_output_logprobs()
        prompt = list(generation.token_ids)
        event: Event
        async for event in generation.events():
            finish = event if isinstance(event, Finish) else None
            delta = event if isinstance(event, TokenDelta) else TokenDelta((), "")
            output = CompletionOutput(
                index=0,
                text=delta.text,
                token_ids=list(delta.token_ids),
                cumulative_logprob=None,
                logprobs=[self._logprob(e) for e in delta.logprobs] if logprobs else None,
                finish_reason=None if finish is None else finish.finish_reason,
                stop_reason=None if finish is None else finish.stop_reason,
            )
            yield RequestOutput(
                request_id=request.request_id,
                prompt=None,
                prompt_token_ids=prompt,
                prompt_logprobs=None,
                outputs=[output],
                finished=finish is not None,
                num_cached_tokens=0 if finish is None else finish.usage.cached_tokens,
            )

    def _logprob(self, entry: common_pb2.TokenLogprob) -> dict[int, Any]:
        """One token's logprobs as vLLM's engine gives them: the sampled token first, then
        the likeliest alternatives in rank order, each with its text."""
        from vllm.logprobs import Logprob

        ranks = {t.token_id: i + 1 for i, t in enumerate(entry.top)}
        text = self._token_text
        rank = ranks.get(entry.token_id) or entry.rank or None
        out = {entry.token_id: Logprob(entry.logprob, rank, text(entry.token_id))}
        for top in entry.top:
            alternative = Logprob(top.logprob, ranks[top.token_id], text(top.token_id))
            out.setdefault(top.token_id, alternative)
        return out

    def _model_name(self, request: Any) -> str:
        name: str = self._serving.models.model_name(None)
        return request.model or name


async def _contexts(context: Any, outputs: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """vLLM's context after each output, as vLLM's serving feeds it from its engine."""
    async for output in outputs:
        context.append_output(output)
        yield context


def _metadata(request: Any) -> Any:
    from vllm.entrypoints.generate.base.protocol import RequestResponseMetadata

    return RequestResponseMetadata(request_id=request.request_id)
