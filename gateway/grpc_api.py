"""The public gRPC API (``pdserve.v1.Generation``): translation only, the work is in the core.

The request id comes from the ``x-request-id`` metadata (or is made here) and is sent back as
initial metadata; an API key, when the gateway has keys, comes as ``authorization: Bearer KEY``
metadata (checked by ``gateway.auth``). The client's deadline bounds the worker calls; a client
that cancels (or whose deadline passes) cancels the generation, which aborts the workers.
``status_code`` is the one mapping of domain errors to gRPC status codes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any, NoReturn

import grpc

from gateway import request_log
from gateway.auth import ApiKeys
from gateway.errors import (
    DeadlineExceeded,
    GatewayError,
    InvalidRequest,
    NotFound,
    NoWorkerAvailable,
    Overloaded,
    Unauthenticated,
    WorkerFailed,
    WorkerTimedOut,
    public_message,
)
from gateway.events import Finish, TokenDelta, outcome_for
from gateway.models import ServedModels
from gateway.service import GenerateRequest, GenerationService, Prompt, edge_request_id
from pdserve.rpc.client import REQUEST_ID_METADATA
from pdserve.telemetry import tracing
from protos.v1 import common_pb2, generate_pb2, generate_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
AUTHORIZATION_METADATA = "authorization"
ENDPOINT = "grpc_generate"  # the endpoint label of metrics and request logs

_CODES: list[tuple[type[GatewayError], grpc.StatusCode]] = [
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (WorkerTimedOut, grpc.StatusCode.DEADLINE_EXCEEDED),
    (NoWorkerAvailable, grpc.StatusCode.UNAVAILABLE),
    (WorkerFailed, grpc.StatusCode.UNAVAILABLE),
]


def status_code(err: GatewayError) -> grpc.StatusCode:
    for kind, code in _CODES:
        if isinstance(err, kind):
            return code
    return grpc.StatusCode.INTERNAL


def _span(method: str, request_id: str, metadata: dict[str, str]) -> Any:
    """The server span of one call: the root of its trace, or a child of the client's
    ``traceparent`` metadata; a no-op while tracing is off."""
    if not tracing.enabled():
        return tracing.NO_SPAN
    full = f"{SERVICE_NAME}/{method}"
    attributes = {"rpc.system": "grpc", "rpc.method": full, "pdserve.request_id": request_id}
    return tracing.span(full, attributes, kind="server", parent=tracing.extract(metadata))


def _json(text: str, param: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as err:
        raise InvalidRequest(f"{param} is not JSON: {err}", param=param) from err


def _message(m: generate_pb2.ChatMessage, index: int) -> dict[str, Any]:
    """One message as OpenAI's JSON has it (what the chat template and vLLM's parsers read)."""
    message: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls_json:
        calls = _json(m.tool_calls_json, f"chat.messages.{index}.tool_calls_json")
        if not isinstance(calls, list):
            raise InvalidRequest(
                "tool_calls_json must be a JSON array", param=f"chat.messages.{index}"
            )
        message["tool_calls"] = calls
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    if m.name:
        message["name"] = m.name
    return message


def _tools(tools_json: str) -> list[dict[str, Any]] | None:
    if not tools_json:
        return None
    tools = _json(tools_json, "tools_json")
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise InvalidRequest("tools_json must be a JSON array of objects", param="tools_json")
    return tools


def chat_body(
    request: generate_pb2.GenerateRequest | generate_pb2.TokenizeRequest,
) -> dict[str, Any]:
    """A call's chat as OpenAI's JSON body, which vLLM's renderer reads as the HTTP API's
    (``gateway.render``): the same messages, tools and chat options give the same ids."""
    body: dict[str, Any] = {
        "messages": [_message(m, i) for i, m in enumerate(request.chat.messages)],
        "max_completion_tokens": 1,  # rendering only: the call's max_tokens rule is the gRPC API's
    }
    if request.model:
        body["model"] = request.model
    tools = _tools(request.tools_json)
    if tools:
        body["tools"] = tools
    if isinstance(request, generate_pb2.GenerateRequest):
        if request.tool_choice_json:
            body["tool_choice"] = _json(request.tool_choice_json, "tool_choice_json")
        for name in ("parallel_tool_calls", "include_reasoning"):
            if request.HasField(name):
                body[name] = getattr(request, name)
        if request.params.HasField("skip_special_tokens"):
            body["skip_special_tokens"] = request.params.skip_special_tokens
    elif tools:
        body["tool_choice"] = "none"  # Tokenize renders the tools; it calls none of them
    options = request.chat_options
    for name in ("add_generation_prompt", "continue_final_message", "chat_template"):
        if options.HasField(name):
            body[name] = getattr(options, name)
    if options.chat_template_kwargs_json:
        kwargs = _json(options.chat_template_kwargs_json, "chat_template_kwargs_json")
        if not isinstance(kwargs, dict):
            raise InvalidRequest(
                "chat_template_kwargs_json must be a JSON object", param="chat_template_kwargs_json"
            )
        body["chat_template_kwargs"] = kwargs
    if options.reasoning_effort:
        body["reasoning_effort"] = options.reasoning_effort
    return body


def _parsed(message: generate_pb2.GenerateResponse, delta: dict[str, Any] | None) -> None:
    """A parsed delta (``ChoiceParser.delta``) into ``message``: content, reasoning, calls."""
    delta = delta or {}
    message.text = delta.get("content") or ""
    message.reasoning = delta.get("reasoning") or ""
    for call in delta.get("tool_calls") or ():
        function = call.get("function") or {}
        message.tool_calls.add(
            index=call.get("index", 0),
            id=call.get("id") or "",
            name=function.get("name") or "",
            arguments=function.get("arguments") or "",
        )


def _final(event: Finish, routing: bool) -> generate_pb2.GenerateResponse:
    """The last message; ``routing``: say which workers served it (the deployment's
    ``routing_headers``, as the HTTP headers and gRPC trailers do)."""
    usage = common_pb2.Usage(
        prompt_tokens=event.usage.prompt_tokens,
        completion_tokens=event.usage.completion_tokens,
        cached_tokens=event.usage.cached_tokens,
    )
    token = event.stop_reason if isinstance(event.stop_reason, int) else None
    return generate_pb2.GenerateResponse(
        finish_reason=event.finish_reason,
        stop_reason=event.stop_reason if isinstance(event.stop_reason, str) else "",
        stop_token_id=token,
        usage=usage,
        prefill_worker=event.prefill_worker if routing else "",
        decode_worker=event.decode_worker if routing else "",
        transfer=event.transfer,
    )


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(
        self, served: ServedModels | GenerationService, api_keys: ApiKeys | None = None
    ) -> None:
        self.served = ServedModels.of(served)
        self.settings = self.served.settings
        self.api_keys = api_keys or ApiKeys(())

    async def _abort(self, context: grpc.aio.ServicerContext, err: GatewayError) -> NoReturn:
        """End the call with ``err``'s status; without routing headers its text names no
        worker address."""
        message = public_message(err, self.settings.routing_headers)
        await context.abort(status_code(err), message)
        raise AssertionError("context.abort returned")  # it always raises

    async def _authorize(self, context: grpc.aio.ServicerContext) -> dict[str, str]:
        metadata = {str(k): str(v) for k, v in context.invocation_metadata() or ()}
        try:
            self.api_keys.check(metadata.get(AUTHORIZATION_METADATA))
        except Unauthenticated as err:
            await self._abort(context, err)
        return metadata

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        metadata = {str(k): str(v) for k, v in context.invocation_metadata() or ()}
        request_id = edge_request_id(metadata.get(REQUEST_ID_METADATA))
        with request_log.serving(request_id):  # every log line of the call names it
            try:
                self.api_keys.check(metadata.get(AUTHORIZATION_METADATA))
            except Unauthenticated as err:
                self._refused(request_id, err, None)
                await self._abort(context, err)
            await context.send_initial_metadata(((REQUEST_ID_METADATA, request_id),))
            with _span("Generate", request_id, metadata):
                try:
                    async for message in self._generate(request, request_id, context, metadata):
                        yield message
                except GatewayError as err:
                    self._refused(request_id, err, request.model)
                    await self._abort(context, err)

    def _refused(self, request_id: str, err: GatewayError, model: str | None) -> None:
        """The line and count of a call refused before the core logged and counted it, under
        the model whose service it went to (``model``: None for one not authenticated)."""
        if request_log.refused_at_edge(request_id, ENDPOINT, err):
            try:
                name = self.served.for_model(model).model_name
            except GatewayError:  # the name itself was refused (an ambiguous adapter)
                name = self.served.default.model_name
            outcome = outcome_for(err)
            self.served.metrics.requests.labels(name, ENDPOINT, "none", outcome).inc()

    async def _generate(
        self,
        request: generate_pb2.GenerateRequest,
        request_id: str,
        context: grpc.aio.ServicerContext,
        metadata: dict[str, str],
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """The call's messages; a chat's parsed by the gateway's parsers when it has them."""
        service = self.served.for_model(request.model)
        params = common_pb2.SamplingParams()
        params.CopyFrom(request.params)
        parsed = None
        kind = request.WhichOneof("input")
        if kind == "text":
            prompt = Prompt(token_ids=tuple(await self._render_text(service, request)))
        elif kind == "token_ids":
            prompt = Prompt(token_ids=tuple(request.token_ids.ids))
        elif kind == "chat":
            chat, ids = await self._render_chat(service, request)
            prompt = Prompt(token_ids=tuple(ids))
            parsed = (await service.renderer.get()).parsed(chat)
            if parsed is not None:
                parsed.adjust(params)
        else:
            raise InvalidRequest(
                "the request has no input (text, token_ids or chat)", param="input"
            )
        core = GenerateRequest(
            request_id, prompt, params, request.model, ENDPOINT,
            deadline_s=context.time_remaining(),
            slo=self.settings.slo.with_headers(metadata),
        )  # fmt: skip
        generation = await service.start(core)
        parser = None if parsed is None else parsed.choice(generation.token_ids)
        async for event in generation.events():
            if isinstance(event, TokenDelta):
                message = generate_pb2.GenerateResponse(
                    token_ids=event.token_ids, text=event.text, logprobs=event.logprobs
                )
                if parser is not None:
                    _parsed(message, parser.delta(event.text, event.token_ids, finished=False))
                yield message
                continue
            context.set_trailing_metadata(tuple(generation.routing_headers().items()))
            final = _final(event, self.settings.routing_headers)
            if parser is not None:
                _parsed(final, parser.delta("", (), finished=True))
                final.finish_reason = parser.finish_reason(event.finish_reason)
            yield final

    @staticmethod
    async def _render_chat(
        service: GenerationService,
        request: generate_pb2.GenerateRequest | generate_pb2.TokenizeRequest,
    ) -> tuple[Any, list[int]]:
        """A call's chat rendered by vLLM's renderer as the HTTP API renders it: vLLM's
        validated request and the prompt's ids. The call's own sampling parameters stay the
        gRPC API's."""
        renderer = await service.renderer.get()
        chat, rendered = await renderer.chat(chat_body(request), service.served())
        return chat, rendered.token_ids

    @staticmethod
    async def _render_text(
        service: GenerationService,
        request: generate_pb2.GenerateRequest | generate_pb2.TokenizeRequest,
    ) -> list[int]:
        """A text prompt's ids, as vLLM renders a completion's."""
        body: dict[str, Any] = {"prompt": request.text, "max_tokens": 1}
        if request.model:
            body["model"] = request.model
        renderer = await service.renderer.get()
        _, rendered = await renderer.completion(body, service.served())
        return rendered[0].token_ids

    async def ListModels(
        self, request: generate_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.ListModelsResponse:
        await self._authorize(context)
        models = [
            generate_pb2.Model(id=m.id, max_model_len=m.max_model_len) for m in self.served.models()
        ]
        return generate_pb2.ListModelsResponse(models=models)

    async def Tokenize(
        self, request: generate_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.TokenizeResponse:
        await self._authorize(context)
        service = self.served.for_model(request.model)
        try:
            service.check_model(request.model)
            if request.WhichOneof("input") == "chat":
                _, ids = await self._render_chat(service, request)
            else:
                ids = await self._render_text(service, request)
        except GatewayError as err:
            await self._abort(context, err)
        return generate_pb2.TokenizeResponse(
            token_ids=ids, count=len(ids), max_model_len=service.pool.max_model_len()
        )
