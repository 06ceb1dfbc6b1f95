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
    ModelNotFound,
    NoWorkerAvailable,
    Overloaded,
    Unauthenticated,
    WorkerFailed,
    WorkerTimedOut,
    public_message,
)
from gateway.events import Finish, TokenDelta
from gateway.service import GenerateRequest, GenerationService, Prompt, edge_request_id
from pdserve.rpc.client import REQUEST_ID_METADATA
from pdserve.telemetry import tracing
from protos.v1 import common_pb2, generate_pb2, generate_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
AUTHORIZATION_METADATA = "authorization"
ENDPOINT = "grpc_generate"  # the endpoint label of metrics and request logs

_CODES: list[tuple[type[GatewayError], grpc.StatusCode]] = [
    (ModelNotFound, grpc.StatusCode.NOT_FOUND),
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


def _messages(chat: generate_pb2.ChatMessages) -> tuple[dict[str, Any], ...]:
    return tuple({"role": m.role, "content": m.content} for m in chat.messages)


def _tools(tools_json: str) -> tuple[dict[str, Any], ...] | None:
    if not tools_json:
        return None
    try:
        tools = json.loads(tools_json)
    except ValueError as err:
        raise InvalidRequest(f"tools_json is not JSON: {err}", param="tools_json") from err
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise InvalidRequest("tools_json must be a JSON array of objects", param="tools_json")
    return tuple(tools)


def _prompt(request: generate_pb2.GenerateRequest) -> Prompt:
    kind = request.WhichOneof("input")
    if kind == "text":
        return Prompt(text=request.text)
    if kind == "token_ids":
        return Prompt(token_ids=tuple(request.token_ids.ids))
    if kind == "chat":
        return Prompt(messages=_messages(request.chat), tools=_tools(request.tools_json))
    raise InvalidRequest("the request has no input (text, token_ids or chat)", param="input")


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
    def __init__(self, service: GenerationService, api_keys: ApiKeys | None = None) -> None:
        self.service = service
        self.api_keys = api_keys or ApiKeys(())

    async def _abort(self, context: grpc.aio.ServicerContext, err: GatewayError) -> NoReturn:
        """End the call with ``err``'s status; without routing headers its text names no
        worker address."""
        message = public_message(err, self.service.settings.routing_headers)
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
                request_log.refused_at_edge(request_id, ENDPOINT, err)
                await self._abort(context, err)
            await context.send_initial_metadata(((REQUEST_ID_METADATA, request_id),))
            with _span("Generate", request_id, metadata):
                try:
                    core = GenerateRequest(
                        request_id,
                        _prompt(request),
                        request.params,
                        request.model,
                        ENDPOINT,
                        deadline_s=context.time_remaining(),
                    )
                    generation = await self.service.start(core)
                    async for event in generation.events():
                        if isinstance(event, TokenDelta):
                            yield generate_pb2.GenerateResponse(
                                token_ids=event.token_ids, text=event.text, logprobs=event.logprobs
                            )
                        else:
                            routing = tuple(generation.routing_headers().items())
                            context.set_trailing_metadata(routing)
                            yield _final(event, self.service.settings.routing_headers)
                except GatewayError as err:
                    request_log.refused_at_edge(request_id, ENDPOINT, err)
                    await self._abort(context, err)

    async def ListModels(
        self, request: generate_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.ListModelsResponse:
        await self._authorize(context)
        models = [
            generate_pb2.Model(id=m.id, max_model_len=m.max_model_len)
            for m in self.service.models()
        ]
        return generate_pb2.ListModelsResponse(models=models)

    async def Tokenize(
        self, request: generate_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.TokenizeResponse:
        await self._authorize(context)
        try:
            self.service.check_model(request.model)
            run = self.service.offload.run  # off the event loop
            if request.WhichOneof("input") == "chat":
                prompt = Prompt(messages=_messages(request.chat), tools=_tools(request.tools_json))
                ids = await run(self.service.tokenize, prompt)
            else:
                ids = await run(self.service.tokenizer.encode_text, request.text)
        except GatewayError as err:
            await self._abort(context, err)
        return generate_pb2.TokenizeResponse(
            token_ids=ids, count=len(ids), max_model_len=self.service.pool.max_model_len()
        )
