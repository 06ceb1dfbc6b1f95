"""The OpenAI-compatible HTTP API (FastAPI): translation only, the work is in the core.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON or ``stream: true`` SSE),
``GET /v1/models``, ``GET /health``, ``GET /metrics``. Every response carries ``x-request-id``
(the client's, when sane, else a new one). Errors are OpenAI-shaped JSON
``{"error": {"message", "type", "param", "code"}}``; ``error_response`` is the one mapping from
domain errors to HTTP status.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import openai_format as fmt
from gateway.errors import (
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    NoWorkerAvailable,
    WorkerFailed,
)
from gateway.generation import Finish, Generation, TokenDelta
from gateway.openai_models import ChatCompletionRequest, CompletionRequest
from gateway.service import GenerateRequest, GenerationService, edge_request_id

log = logging.getLogger(__name__)

T = TypeVar("T")
REQUEST_ID_HEADER = "x-request-id"


def _status_and_type(err: GatewayError) -> tuple[int, str]:
    if isinstance(err, ModelNotFound):
        return 404, "invalid_request_error"
    if isinstance(err, InvalidRequest):
        return 400, "invalid_request_error"
    if isinstance(err, NoWorkerAvailable | WorkerFailed):
        return 503, "service_unavailable_error"
    return 500, "server_error"


def error_response(err: GatewayError) -> JSONResponse:
    """The one mapping of domain errors to HTTP status and OpenAI error type."""
    status, kind = _status_and_type(err)
    return JSONResponse(fmt.error_body(err.message, kind, err.param, err.code), status)


class RequestIdMiddleware:
    """Pure ASGI (no buffering, streaming and cancellation untouched): picks the request id
    and adds it to every response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = edge_request_id(Headers(scope=scope).get(REQUEST_ID_HEADER))
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)


def create_app(service: GenerationService) -> FastAPI:
    app = FastAPI(title="pdserve gateway", docs_url=None, redoc_url=None)
    app.add_middleware(RequestIdMiddleware)
    _add_error_handlers(app)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        core = GenerateRequest(
            _request_id(request),
            body.to_prompt(),
            body.sampling_params(),
            body.model or "",
            "completions",
        )
        return await _serve(service, request, core, body.stream, body.include_usage, chat=False)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        core = GenerateRequest(
            _request_id(request),
            body.to_prompt(),
            body.sampling_params(),
            body.model or "",
            "chat_completions",
        )
        return await _serve(service, request, core, body.stream, body.include_usage, chat=True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return fmt.models_body(service.models())

    @app.get("/health")
    async def health() -> JSONResponse:
        healthy = len(service.pool.healthy_decode())
        body = {
            "status": "ok" if healthy else "unavailable",
            "healthy_decode_workers": healthy,
            "healthy_prefill_workers": len(service.pool.healthy_prefill()),
        }
        return JSONResponse(body, 200 if healthy else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=service.metrics.content_type)

    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(GatewayError)
    async def domain_error(request: Request, err: GatewayError) -> JSONResponse:
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, err: RequestValidationError) -> JSONResponse:
        message, param = fmt.validation_message(err.errors())
        return error_response(InvalidRequest(message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if err.status_code < 500 else "server_error"
        body = fmt.error_body(str(err.detail), kind, None, str(err.status_code))
        return JSONResponse(body, err.status_code, headers=err.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, err: Exception) -> JSONResponse:
        # Starlette re-raises after this response, so the server logs the traceback once.
        log.error("unexpected error serving %s: %r", request.url.path, err)
        return JSONResponse(fmt.error_body("internal server error", "server_error"), 500)


def _request_id(request: Request) -> str:
    request_id: str = request.state.request_id
    return request_id


async def _serve(
    service: GenerationService,
    request: Request,
    core: GenerateRequest,
    stream: bool,
    include_usage: bool,
    *,
    chat: bool,
) -> Response:
    shaper = fmt.ChunkShaper(
        core.request_id, service.model_name, chat=chat, include_usage=include_usage
    )
    generation = await _unless_disconnected(request, service.start(core))
    if generation is None:
        return Response(status_code=499)
    if stream:
        return _GenerationStream(generation, shaper)
    result = await _unless_disconnected(request, _collect(generation))
    if result is None:
        return Response(status_code=499)
    text, finish = result
    return JSONResponse(shaper.full_response(text, finish), headers=generation.routing_headers())


class _GenerationStream(StreamingResponse):
    """SSE of one generation; releases it even if streaming never started (client gone)."""

    def __init__(self, generation: Generation, shaper: fmt.ChunkShaper) -> None:
        super().__init__(
            _sse(generation, shaper),
            media_type="text/event-stream",
            headers=generation.routing_headers(),
        )
        self.generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.generation.aclose()  # no-op after a complete stream


async def _collect(generation: Generation) -> tuple[str, Finish]:
    parts: list[str] = []
    finish: Finish | None = None
    async for event in generation.events():  # to the end, so that the generator closes
        if isinstance(event, TokenDelta):
            parts.append(event.text)
        else:
            finish = event
    if finish is None:
        raise WorkerFailed("the generation ended without a finish")
    return "".join(parts), finish


async def _sse(generation: Generation, shaper: fmt.ChunkShaper) -> AsyncIterator[str]:
    """SSE lines: role first (chat), deltas, finish, usage (if asked), ``[DONE]``."""
    try:
        for chunk in shaper.opening():
            yield fmt.sse(chunk)
        async for event in generation.events():
            if isinstance(event, TokenDelta):
                if event.text:
                    yield fmt.sse(shaper.delta(event.text))
            else:
                for chunk in shaper.closing(event):
                    yield fmt.sse(chunk)
    except GatewayError as err:
        # The status line is gone already: report in-band, as vLLM does.
        _, kind = _status_and_type(err)
        yield fmt.sse(fmt.error_body(err.message, kind, err.param, err.code))
    yield "data: [DONE]\n\n"


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Run ``work``; cancel it (the core then aborts the workers) if the client goes away.

    Starlette notices a disconnect by itself only while streaming a response."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or not task.done():
        await asyncio.gather(task, return_exceptions=True)
        log.info("request %s: client disconnected", _request_id(request))
        if not task.cancelled() and task.exception() is None:
            result = task.result()  # finished in the same instant: release it
            if isinstance(result, Generation):
                await result.aclose()
        return None
    return task.result()
