"""Several base models behind one gateway: one ``GenerationService`` (its own worker pool,
tokenizer, vLLM front end and picker) per served model, and the request's ``model`` naming
which one serves it.

The first model is the default (a request without ``model`` goes to it, as to ``vllm
serve``'s one model); a LoRA adapter's name goes to the base model whose workers serve it; any
other name is vLLM's 404. ``GET /v1/models`` lists every base model, each followed by its
adapters.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from gateway.errors import InvalidRequest
from gateway.pool import WorkerPool
from gateway.service import GenerationService, ModelInfo


class ServedModels:
    def __init__(self, services: Sequence[GenerationService]) -> None:
        if not services:
            raise ValueError("a gateway serves at least one model")
        self.services = list(services)
        self.default = self.services[0]
        self.settings = self.default.settings
        self.metrics = self.default.metrics

    @classmethod
    def of(cls, served: ServedModels | GenerationService) -> ServedModels:
        """``served``, or one model's service as the only one."""
        return served if isinstance(served, ServedModels) else cls([served])

    def __iter__(self) -> Iterator[GenerationService]:
        return iter(self.services)

    @property
    def pools(self) -> list[WorkerPool]:
        return [s.pool for s in self.services]

    def for_model(self, model: Any) -> GenerationService:
        """The service of ``model``: a base model's, or that of the base model whose workers
        serve the adapter ``model`` names. Anything else goes to the default model, whose
        checks answer a name nobody serves with vLLM's 404 (counted as any refusal). An
        adapter name that several base models' workers serve (each worker's own
        ``--lora-modules``) names none of them: a 400 naming them, not the first one's."""
        if not isinstance(model, str) or not model:
            return self.default
        for service in self.services:
            if model == service.model_name:
                return service
        serving = [s for s in self.services if model in s.pool.adapters()]
        if len(serving) > 1:
            bases = ", ".join(f"`{s.model_name}`" for s in serving)
            raise InvalidRequest(
                f"the LoRA adapter `{model}` is served by the workers of several base models "
                f"({bases}), so its name does not say which one to use; serve it under another "
                "name on all but one of them",
                param="model",
            )
        return serving[0] if serving else self.default

    def for_body(self, body: Any) -> GenerationService:
        """The service of a JSON body's ``model`` (not an object: the default's, whose
        renderer answers the 400)."""
        return self.for_model(body.get("model") if isinstance(body, Mapping) else None)

    def models(self) -> list[ModelInfo]:
        return [info for service in self.services for info in service.models()]

    def ready(self) -> bool:
        """Every model's front end can render and at least one model has a decode worker."""
        renderers = all(s.renderer.built for s in self.services)
        return renderers and any(s.pool.healthy_decode() for s in self.services)

    @property
    def active(self) -> int:
        return sum(s.active for s in self.services)

    async def close(self) -> None:
        for service in self.services:
            await service.close()
