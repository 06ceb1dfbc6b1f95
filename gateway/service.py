"""The gateway's transport-agnostic core.

Adapters (``gateway.http``, ``gateway.grpc_api``) build a ``GenerateRequest`` (the request id
is made at the edge) and call ``GenerationService.start``: validate -> tokenize -> context
length -> pick P and D -> prefill -> decode stream. ``start`` raises ``GatewayError``s for
everything that goes wrong before the first token; the returned ``Generation`` yields
``TokenDelta``s and a final ``Finish`` (see ``gateway.generation``).

Extending: new routing goes in a ``Picker`` (``gateway.routing.interfaces``, registry
``gateway.routing.registry``); new endpoints are adapters over ``start``/``generate``; new
per-request steps (e.g. recording prefix hits) belong in ``Generation``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from decode_service.client import DecodeClient
from gateway import request_log
from gateway.config import GatewaySettings
from gateway.errors import (
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    NoWorkerAvailable,
    Overloaded,
)
from gateway.events import Event, outcome_for
from gateway.generation import AnyWorker, Generation
from gateway.interfaces import PromptTokenizer
from gateway.metrics import GatewayMetrics
from gateway.offload import BuiltOnce, Offload
from gateway.params import check_sampling, resolve_max_tokens
from gateway.pool import WorkerPool
from gateway.render import Renderer, Served, shared_renderer
from gateway.routing.interfaces import Picker, Route, RouteRequest
from gateway.routing.split import SplitPolicy
from gateway.sampling_defaults import with_defaults
from gateway.slo import Slo
from pdserve.rpc.client import RpcCallError
from pdserve.telemetry import tracing
from protos.v1 import common_pb2, worker_pb2

log = logging.getLogger(__name__)

T = TypeVar("T")
_REQUEST_ID_OK = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def edge_request_id(candidate: str | None) -> str:
    """The id the client sees and the logs name: the client's ``x-request-id`` when it is a
    sane token (letters, digits, ``._:-``, at most 128), else a fresh random one.

    It is never sent to a worker: two clients may pick the same id (by accident or on
    purpose), so the workers and engines get ``internal_request_id()`` instead."""
    if candidate and _REQUEST_ID_OK.fullmatch(candidate):
        return candidate
    return uuid.uuid4().hex


def chosen_request_id(candidate: str) -> str:
    """A request id the client chose in the body (vLLM's ``request_id`` field): kept when it
    is a sane token, as ``x-request-id`` is; else a 400 naming the field."""
    if not _REQUEST_ID_OK.fullmatch(candidate):
        raise InvalidRequest(
            "request_id must be 1 to 128 letters, digits or ._:- characters", param="request_id"
        )
    return candidate


def internal_request_id() -> str:
    """The gateway's own id for one attempt at one choice: what the workers, their engines
    and ``Abort`` see. Random, so no client can name (abort, unpin) another's request."""
    return uuid.uuid4().hex


@dataclass(frozen=True)
class Prompt:
    """A prompt as the workers get it: token ids, rendered by vLLM's renderer
    (``gateway.render``) or given by a gRPC client. ``text``: a completion prompt's text as
    the client sent it (``echo`` answers with it)."""

    token_ids: tuple[int, ...]
    text: str | None = None


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str  # the edge id (echoed to the client, logged); never sent to workers
    prompt: Prompt
    params: common_pb2.SamplingParams
    model: str = ""  # empty: the served model
    endpoint: str = "grpc_generate"  # metrics label
    received_at: float = field(default_factory=time.monotonic)
    # Seconds the client still waits (gRPC deadline); None: only the gateway's own timeouts.
    deadline_s: float | None = None
    slo: Slo = field(default_factory=Slo)  # counted met or missed when it finishes


async def all_or_none(
    awaitables: Sequence[Awaitable[T]], release: Callable[[T], Awaitable[None]] | None = None
) -> list[T]:
    """Run ``awaitables`` together and return their results; when one fails, the others are
    cancelled, those already done are given to ``release``, and the error is raised."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if release is not None:
            for task in tasks:
                if not task.cancelled() and task.exception() is None:
                    await release(task.result())
        raise


@dataclass(frozen=True)
class ModelInfo:
    id: str
    max_model_len: int
    root: str  # the model's path, as vLLM reports it (an adapter's: its directory)
    parent: str | None = None  # a LoRA adapter's base model


def route_attributes(picker: str, route: Route) -> dict[str, Any]:
    """The routing decision as span attributes."""
    attributes: dict[str, Any] = {
        "pdserve.route.picker": picker,
        "pdserve.route.path": "disaggregated" if route.prefill is not None else "local",
        "pdserve.route.decode_worker": route.decode.worker_id,
        "pdserve.route.prefill_worker": route.prefill.worker_id if route.prefill else "local",
    }
    if route.predicted_cached_tokens is not None:
        attributes["pdserve.route.predicted_cached_tokens"] = route.predicted_cached_tokens
    if route.split is not None:
        attributes["pdserve.route.split"] = str(route.split)
    return attributes


class GenerationService:
    def __init__(
        self,
        settings: GatewaySettings,
        *,
        model_name: str,
        tokenizer: PromptTokenizer,
        pool: WorkerPool,
        picker: Picker,
        metrics: GatewayMetrics,
        offload: Offload | None = None,
    ) -> None:
        self.settings = settings
        # Chat templates and tokenization run here, off the event loop (None: inline).
        self.offload = offload or Offload(0)
        self.model_name = model_name
        self.tokenizer = tokenizer
        # vLLM's own front end renders the OpenAI requests (gateway.render): built once, in a
        # thread, on first use (``start`` asks for it at once: vLLM's import takes seconds).
        args = settings.vllm_args(model_name)
        self.renderer: BuiltOnce[Renderer] = BuiltOnce(
            lambda: shared_renderer(tokenizer.model_dir, args)
        )
        self.pool = pool
        self.picker = picker
        self.split = SplitPolicy(settings.disagg_policy, metrics)
        self.metrics = metrics
        self._background: set[asyncio.Task[None]] = set()
        self.active = 0  # generations admitted and not yet ended
        metrics.in_flight.set_function(lambda: self.active)

    def models(self) -> list[ModelInfo]:
        """The base model, then the LoRA adapters its workers serve (``parent``: the base)."""
        length = self.pool.max_model_len()
        base = ModelInfo(self.model_name, length, self.tokenizer.model_dir)
        adapters = [  # as vLLM lists an adapter: no context length of its own
            ModelInfo(name, 0, path, parent=self.model_name)
            for name, path in sorted(self.pool.adapters().items())
        ]
        return [base, *adapters]

    def shown_model(self, model: str) -> str:
        """The model an answer names: the request's adapter, else the served model."""
        return model if model and model in self.pool.adapters() else self.model_name

    def served(self) -> Served:
        """What vLLM's renderer must know of the workers: context length, LoRA adapters."""
        return Served(self.pool.max_model_len(), self.pool.adapters())

    def ready(self) -> bool:
        """vLLM's front end can render and at least one decode worker is healthy."""
        return self.renderer.built and bool(self.pool.healthy_decode())

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """``start`` and iterate: the simple form for callers that need no status up front."""
        generation = await self.start(request)
        async for event in generation.events():
            yield event

    async def start(self, request: GenerateRequest) -> Generation:
        return (await self.start_choices([request]))[0]

    async def start_choices(self, requests: Sequence[GenerateRequest]) -> list[Generation]:
        """The choices of one prompt (OpenAI's ``n``; ``requests`` differ only in their ids
        and seeds): one admission of all of them, one tokenization, one route.

        The first choice is prefilled and its KV moved as any request's; the others start on
        its decode worker once its first token shows the prompt's KV is in that engine, which
        serves them from its prefix cache (path "sibling"): ``n`` choices cost one prefill
        and one KV transfer. If any choice fails to start, the others are released."""
        lead = requests[0]
        slots = 0  # reserved in admission and not yet handed to a generation
        token_ids: list[int] | None = None
        try:
            with tracing.step("admission"):
                adapter = self._check_model(lead.model)
                # the request's values, else the model's generation config as vLLM reads it
                # (what vLLM's renderer made of an OpenAI request has them already)
                defaults = (await self.renderer.get()).default_sampling_params
                sampling = [with_defaults(r.params, defaults) for r in requests]
                for s in sampling:
                    check_sampling(s)
                    s.lora_name = adapter  # the model names it, nothing else
                self._admit(len(requests))
                # The slots are taken at admission, not after the awaits below: a burst cannot
                # pass max_concurrent_requests (each generation gives its slot back at its end).
                self.active += len(requests)
                slots = len(requests)
            with tracing.step("tokenize") as span:
                token_ids = self.check_prompt(lead.prompt)
                span.set_attribute("pdserve.prompt_tokens", len(token_ids))
            params = [
                resolve_max_tokens(
                    s, len(token_ids), self.pool.max_model_len(), self.settings.default_max_tokens
                )
                for s in sampling
            ]
            with tracing.step("route") as span:
                route = await self._route(lead, token_ids, params[0])
                if span.is_recording():
                    span.set_attributes(route_attributes(self.picker.name, route))
        except BaseException as err:
            self.active -= slots
            if not isinstance(err, GatewayError | asyncio.CancelledError):
                raise
            outcome = outcome_for(err) if isinstance(err, GatewayError) else "cancelled"
            self.metrics.requests.labels(self.model_name, lead.endpoint, "none", outcome).inc(
                len(requests)
            )
            prompt_tokens = None if token_ids is None else len(token_ids)
            request_log.refused(
                lead.request_id, lead.endpoint, outcome,
                received_at=lead.received_at, prompt_tokens=prompt_tokens,
            )  # fmt: skip
            raise
        generations: list[Generation] = []
        try:
            slots -= 1
            generations.append(self._generation(lead, token_ids, params[0], route))
            await self._open(generations[0])
            sibling = Route(prefill=None, decode=generations[0].decode)
            for request, p in zip(requests[1:], params[1:], strict=True):
                slots -= 1
                generations.append(self._generation(request, token_ids, p, sibling, True))
            await all_or_none([self._open(g) for g in generations[1:]])
        except BaseException:
            self.active -= slots
            for generation in generations:
                await generation.aclose()
            raise
        return generations

    def _generation(
        self,
        request: GenerateRequest,
        token_ids: list[int],
        params: common_pb2.SamplingParams,
        route: Route,
        sibling: bool = False,
    ) -> Generation:
        internal_id = internal_request_id()
        log.debug("request %s: internal id %s", request.request_id, internal_id)
        return Generation(
            request_id=internal_id,
            model=self.model_name,
            endpoint=request.endpoint,
            token_ids=token_ids,
            params=params,
            route=route,
            received_at=request.received_at,
            settings=self.settings,
            pool=self.pool,
            metrics=self.metrics,
            abort=self.abort_later,
            on_end=self._ended,
            deadline_s=request.deadline_s,
            edge_id=request.request_id,
            sibling=sibling,
            slo=request.slo,
        )

    @staticmethod
    async def _open(generation: Generation) -> None:
        try:
            await generation.open()
        except asyncio.CancelledError:
            generation.abandon("cancelled")
            raise
        except GatewayError as err:
            generation.abandon(outcome_for(err))
            raise

    def _admit(self, choices: int = 1) -> None:
        """Admission control: 429 instead of piling work on a gateway or workers at their
        limit (every rejection is counted by reason); ``choices`` slots are asked for."""
        limit = self.settings.max_concurrent_requests
        if limit and self.active + choices > limit:
            self._reject(
                "gateway_limit",
                f"the gateway is at its limit of {limit} concurrent generations; retry later",
            )
        queue = self.settings.max_queue_per_worker
        if not queue:
            return
        for role, workers in (
            ("decode", self.pool.healthy_decode()),
            ("prefill", self.pool.healthy_prefill()),
        ):
            # all(), not min(): it stops at the first worker below the limit (usually the
            # first), where min() read the load of every worker (256) for every request
            if workers and all(w.load() >= queue for w in workers):
                self._reject(
                    f"{role}_queue",
                    f"every {role} worker has {queue} or more requests in flight or queued; "
                    "retry later",
                )

    def _reject(self, reason: str, message: str) -> None:
        self.metrics.rejected.labels(reason).inc()
        raise Overloaded(message, retry_after_s=self.settings.retry_after_s)

    def _ended(self) -> None:
        self.active -= 1

    def check_model(self, model: str) -> None:
        self._check_model(model)

    def _check_model(self, model: str) -> str:
        """The LoRA adapter ``model`` names ("": the base model); 404 for any other name."""
        if not model or model == self.model_name:
            return ""
        if model in self.pool.adapters():
            return model
        raise ModelNotFound(f"The model `{model}` does not exist.", param="model")

    def check_prompt(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids, checked: never empty, every id in the vocabulary."""
        ids = list(prompt.token_ids)
        if not ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        vocab = self.tokenizer.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(
                f"token id {bad[0]} is out of vocabulary (size {vocab})", param="prompt"
            )
        return ids

    async def _route(
        self,
        request: GenerateRequest,
        token_ids: Sequence[int],
        params: common_pb2.SamplingParams,
    ) -> Route:
        adapter = None
        if params.lora_name:  # only workers serving the adapter, at the same path
            adapter = (params.lora_name, self.pool.adapters().get(params.lora_name, ""))
        prefill = self.pool.serving(self.pool.healthy_prefill(), adapter)
        if params.HasField("prompt_logprobs"):
            # vLLM computes prompt logprobs only for prompt tokens it runs itself, never for
            # transferred KV: such requests take the local path on the decode worker.
            prefill = []
        if self.pool.prefill and not prefill and self.settings.prefill_failure_policy == "fail":
            raise NoWorkerAvailable("no healthy prefill worker (prefill_failure_policy 'fail')")
        decode = self.pool.serving(self.pool.healthy_decode(), adapter)
        if not decode:
            serving = f" serves the LoRA adapter `{adapter[0]}`" if adapter else ""
            raise NoWorkerAvailable(f"no healthy decode worker{serving}")
        salt = params.cache_salt if params.HasField("cache_salt") else None
        route_request = RouteRequest(
            request.request_id, self.model_name, token_ids, salt, lora=adapter
        )
        started = time.perf_counter()
        route = await self.picker.pick(route_request, prefill, decode, self.pool.compatible)
        route = self.split.decide(route, len(token_ids), request.slo)
        self.metrics.route_seconds.observe(time.perf_counter() - started)
        path = "disaggregated" if route.prefill is not None else "local"
        self.metrics.decisions.labels(self.picker.name, path).inc()
        return route

    def abort_later(
        self,
        workers: Sequence[AnyWorker],
        request_id: str,
        handoff: worker_pb2.KvTransferParams | None = None,
    ) -> None:
        """Send ``Abort`` to ``workers`` from a background task (safe under cancellation);
        ``handoff``: for decode workers, a hand-off to release on its prefill worker."""
        task = asyncio.create_task(self._abort(list(workers), request_id, handoff))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(
        self,
        workers: Sequence[AnyWorker],
        request_id: str,
        handoff: worker_pb2.KvTransferParams | None,
    ) -> None:
        await asyncio.gather(*(self._abort_one(w, request_id, handoff) for w in workers))

    async def _abort_one(
        self, worker: AnyWorker, request_id: str, handoff: worker_pb2.KvTransferParams | None
    ) -> None:
        timeout = self.settings.control_timeout_s
        try:
            if handoff is not None and isinstance(worker.client, DecodeClient):
                found = await worker.client.abort(request_id, timeout, handoff)
            else:
                found = await worker.client.abort(request_id, timeout=timeout)
        except RpcCallError as err:
            log.info("request %s: abort on %s failed: %s", request_id, worker.address, err)
            return
        log.debug("request %s: aborted on %s (found=%s)", request_id, worker.address, found)

    async def close(self) -> None:
        """Let pending aborts (each bounded by ``control_timeout_s``) and the picker's
        background writes finish."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self.picker.close()
