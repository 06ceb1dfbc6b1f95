"""Prefill core: compute a prompt, keep its KV blocks pinned, return where to pull them.

The engine runs the prompt with ``max_tokens=1`` and ``do_remote_decode``; the connector pins
the blocks under a lease and returns the hand-off. ``abort`` stops the prompt if it is still
running and unpins its blocks at once if the engine finished it, whether this service saw the
hand-off or not (the RPC may have been cancelled meanwhile): the transfer process knows each
job by this service's request id too (``RELEASE_KEY``), and applies a release that overtakes
the job when the job arrives.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from kv_transfer import CONNECTOR_NAME
from kv_transfer.client import RELEASE_KEY, release_by_key
from kv_transfer.errors import KVTransferError
from pdserve.worker.engine_times import EnginePhases
from pdserve.worker.errors import InvalidRequest, WorkerError
from pdserve.worker.service import WorkerService

log = logging.getLogger(__name__)


@dataclass
class PrefillResult:
    kv_transfer_params: dict[str, Any]
    first_token_id: int
    prompt_tokens: int
    cached_tokens: int
    phases: EnginePhases = field(default_factory=EnginePhases)


class PrefillService(WorkerService):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        config = getattr(self.engine, "vllm_config", None)
        self.tp_size = int(config.parallel_config.tensor_parallel_size) if config else 1
        # Only pdserve's connector has transfer processes to release jobs on.
        self.own_connector = self.info.kv_connector == CONNECTOR_NAME

    async def prefill(self, request_id: str, token_ids: list[int]) -> PrefillResult:
        from vllm import SamplingParams, TokensPrompt

        self.check_alive()
        if not token_ids:
            raise InvalidRequest("prompt_token_ids is empty")
        if len(token_ids) >= self.info.max_model_len:
            raise InvalidRequest(
                f"prompt has {len(token_ids)} tokens; the model's context is "
                f"{self.info.max_model_len} tokens"
            )
        handoff_request: dict[str, Any] = {"do_remote_decode": True}
        if self.own_connector:
            handoff_request[RELEASE_KEY] = request_id
        params = SamplingParams(
            max_tokens=1, detokenize=False, extra_args={"kv_transfer_params": handoff_request}
        )
        final = None
        prompt = TokensPrompt(prompt_token_ids=list(token_ids))
        with self.counted():
            # vLLM's own request spans (when its tracing is on) join the caller's trace.
            trace = self.trace_headers()
            async for output in self.engine.generate(
                prompt, params, request_id, trace_headers=trace
            ):
                final = output
        if final is None or not final.kv_transfer_params:
            raise WorkerError("the prefill engine returned no KV hand-off")
        handoff = dict(final.kv_transfer_params)
        tokens = final.outputs[0].token_ids if final.outputs else []
        phases = EnginePhases.of(final)
        phases.trace()
        return PrefillResult(
            kv_transfer_params=handoff,
            first_token_id=int(tokens[0]) if tokens else 0,
            prompt_tokens=len(token_ids),
            cached_tokens=int(final.num_cached_tokens or 0),
            phases=phases,
        )

    async def abort(self, request_id: str) -> bool:
        """Stop the prompt and unpin its blocks; True if blocks were pinned for it."""
        await self.engine.abort(request_id)
        if not self.own_connector:
            return False
        host = self.settings.kv_bind_host or self.settings.host
        host = "127.0.0.1" if host in ("", "0.0.0.0") else host
        found = False
        for rank in range(self.tp_size):  # every TP rank's agent pins its share of the blocks
            port = self.settings.kv_port + rank
            try:
                found |= await asyncio.to_thread(
                    release_by_key, host, port, request_id, secret=self.secret
                )
            except (OSError, KVTransferError) as exc:
                log.warning("could not unpin %s: %s (its lease will)", request_id, exc)
        return found
