"""vLLM's run-time LoRA endpoints through the gateway: ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (with ``allow_runtime_lora_updating``, as ``vllm serve`` with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``).

vLLM's request models validate the bodies and vLLM's checks come first (both names given, no
base model's name, no second load of a loaded name without ``load_inplace``, no unload of an
unknown one), with vLLM's messages; then every healthy worker, prefill and decode, is told
(``LoadLoraAdapter``/``UnloadLoraAdapter``), and the gateway reads their capabilities again, so
that the adapter is routed to exactly the workers that loaded it. A worker that refused keeps
serving the rest; the answer then names how many refused and why (503). The success answer is
vLLM's text.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from gateway.errors import InvalidRequest, NotFound, NoWorkerAvailable, WorkerFailed
from gateway.models import ServedModels
from gateway.pool import DecodeWorker, PrefillWorker
from gateway.render import validate_body
from gateway.service import GenerationService
from pdserve.rpc.client import RpcCallError


def _validate(model: Any, body: Any) -> Any:
    if not isinstance(body, Mapping):
        raise InvalidRequest("the request body must be a JSON object")
    return validate_body(model, body)


async def load(served: ServedModels, body: Any) -> str:
    """Load the adapter on every healthy worker of its base model (``base_model_name``, a
    pdserve field named as in vLLM's ``--lora-modules``; absent: the default model); vLLM's
    success text."""
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

    request = _validate(LoadLoRAAdapterRequest, body)
    name, path = request.lora_name, request.lora_path
    if not name or not path:
        raise InvalidRequest("Both 'lora_name' and 'lora_path' must be provided.")
    if any(name == s.model_name for s in served):
        raise InvalidRequest(f"The lora adapter '{name}' conflicts with a served base model.")
    service = _base_model(served, body.get("base_model_name"))
    other = next((s for s in served if s is not service and name in s.pool.adapters()), None)
    if other is not None:  # a request's model must name one base model's adapter
        raise InvalidRequest(
            f"The lora adapter '{name}' is an adapter of the model `{other.model_name}`: "
            "unload it there first, or give this one another name."
        )
    if name in service.pool.adapters() and not request.load_inplace:
        raise InvalidRequest(
            f"The lora adapter '{name}' has already been loaded. If you want to load the "
            "adapter in place, set 'load_inplace' to True."
        )
    await _on_every_worker(
        service,
        f"load the LoRA adapter '{name}'",
        lambda w, timeout: w.client.load_lora_adapter(name, path, request.load_inplace, timeout),
    )
    return f"Success: LoRA adapter '{name}' added successfully."


async def unload(served: ServedModels, body: Any) -> str:
    """Unload the adapter from every worker that serves it; vLLM's success text."""
    from vllm.entrypoints.serve.lora.protocol import UnloadLoRAAdapterRequest

    request = _validate(UnloadLoRAAdapterRequest, body)
    name = request.lora_name
    if not name:
        raise InvalidRequest("'lora_name' needs to be provided to unload a LoRA adapter.")
    service = served.for_model(name)
    workers: list[PrefillWorker | DecodeWorker] = [*service.pool.prefill, *service.pool.decode]
    holders = [w for w in workers if w.adapter_path(name) is not None]
    if not holders:
        raise NotFound(f"The lora adapter '{name}' cannot be found.", param="lora_name")
    await _on_every_worker(
        service,
        f"unload the LoRA adapter '{name}'",
        lambda w, timeout: w.client.unload_lora_adapter(name, timeout),
        holders,
    )
    return f"Success: LoRA adapter '{name}' removed successfully."


def _base_model(served: ServedModels, name: Any) -> GenerationService:
    if name is None:
        return served.default
    found = [s for s in served if s.model_name == name]
    if not found:
        raise NotFound(f"The model `{name}` does not exist.", param="base_model_name")
    return found[0]


async def _on_every_worker(
    service: GenerationService, what: str, call: Any, workers: list[Any] | None = None
) -> None:
    """``call(worker, timeout)`` on ``workers`` (default: every healthy one) at once; then
    every worker's capabilities are read again. Raises when any refused or failed."""
    pool = service.pool
    targets = workers if workers is not None else [*pool.healthy_prefill(), *pool.healthy_decode()]
    if not targets:
        raise NoWorkerAvailable(f"no healthy worker to {what} on")
    # loading reads the adapter's weights: allow it the time of a request
    timeout = service.settings.request_timeout_s
    results = await asyncio.gather(*(call(w, timeout) for w in targets), return_exceptions=True)
    await pool.refresh()
    failed = [(w, r) for w, r in zip(targets, results, strict=True) if isinstance(r, Exception)]
    for _, result in failed:
        if not isinstance(result, RpcCallError):
            raise result
    if not failed:
        return
    reasons = sorted({_reason(r) for _, r in failed})
    if len(failed) == len(targets) and all(_refused(r) for _, r in failed):
        raise InvalidRequest(f"cannot {what}: {'; '.join(reasons)}", param="lora_path")
    raise WorkerFailed(
        f"{len(failed)} of {len(targets)} workers could not {what}: {'; '.join(reasons)} "
        "(the others serve it)"
    )


def _refused(err: BaseException) -> bool:
    """A worker's own refusal (its engine runs without LoRA, no such adapter, ...)."""
    return isinstance(err, RpcCallError) and err.caller_error


def _reason(err: BaseException) -> str:
    return getattr(err, "details", None) or str(err)
