"""The public gRPC API (``pdserve.v1.Generation``): translation only, the work is in the core.

The request id comes from the ``x-request-id`` metadata (or is made here) and is sent back as
initial metadata. ``_abort`` is the one mapping of domain errors to gRPC status codes.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import NoReturn

import grpc

from gateway.errors import (
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    NoWorkerAvailable,
    WorkerFailed,
)
from gateway.generation import Finish, TokenDelta
from gateway.service import GenerateRequest, GenerationService, Prompt, edge_request_id
from pdserve.grpc_client import REQUEST_ID_METADATA
from protos.v1 import common_pb2, generate_pb2, generate_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


def status_code(err: GatewayError) -> grpc.StatusCode:
    if isinstance(err, ModelNotFound):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(err, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(err, NoWorkerAvailable | WorkerFailed):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


async def _abort(context: grpc.aio.ServicerContext, err: GatewayError) -> NoReturn:
    await context.abort(status_code(err), err.message)
    raise AssertionError("context.abort returned")  # it always raises


def _prompt(request: generate_pb2.GenerateRequest) -> Prompt:
    kind = request.WhichOneof("input")
    if kind == "text":
        return Prompt(text=request.text)
    if kind == "token_ids":
        return Prompt(token_ids=tuple(request.token_ids.ids))
    if kind == "chat":
        messages = tuple({"role": m.role, "content": m.content} for m in request.chat.messages)
        return Prompt(messages=messages)
    raise InvalidRequest("the request has no input (text, token_ids or chat)", param="input")


def _final(event: Finish) -> generate_pb2.GenerateResponse:
    usage = common_pb2.Usage(
        prompt_tokens=event.usage.prompt_tokens,
        completion_tokens=event.usage.completion_tokens,
        cached_tokens=event.usage.cached_tokens,
    )
    return generate_pb2.GenerateResponse(
        finish_reason=event.finish_reason,
        usage=usage,
        prefill_worker=event.prefill_worker,
        decode_worker=event.decode_worker,
        transfer=event.transfer,
    )


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, service: GenerationService) -> None:
        self.service = service

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        metadata = dict(context.invocation_metadata() or ())
        request_id = edge_request_id(metadata.get(REQUEST_ID_METADATA))
        await context.send_initial_metadata(((REQUEST_ID_METADATA, request_id),))
        try:
            core = GenerateRequest(
                request_id, _prompt(request), request.params, request.model, "grpc_generate"
            )
            generation = await self.service.start(core)
            async for event in generation.events():
                if isinstance(event, TokenDelta):
                    yield generate_pb2.GenerateResponse(token_ids=event.token_ids, text=event.text)
                else:
                    context.set_trailing_metadata(tuple(generation.routing_headers().items()))
                    yield _final(event)
        except GatewayError as err:
            await _abort(context, err)

    async def ListModels(
        self, request: generate_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.ListModelsResponse:
        models = [
            generate_pb2.Model(id=m.id, max_model_len=m.max_model_len)
            for m in self.service.models()
        ]
        return generate_pb2.ListModelsResponse(models=models)
