"""Prefill core: compute a prompt, keep its KV blocks pinned, return where to pull them.

The engine runs the prompt shaped for the hand-off (``handoff_request_params``: one token,
``ignore_eos``, ``do_remote_decode``); the connector pins the blocks under a lease and returns
the hand-off, which this service ties to the prompt (its digest, sealed with the deployment
secret) for vLLM's NixlConnector as our own connector does itself.

``abort`` stops the prompt if it is still running: vLLM's connectors then free its blocks at
once (an aborted request is never handed off: nixl/pull_scheduler.py:235-244). With our
connector it also unpins the blocks of a finished prompt, whether this service saw the hand-off
or not (the RPC may have been cancelled meanwhile): the transfer process knows each job by this
service's request id too (``RELEASE_KEY``), and applies a release that overtakes the job when
the job arrives. A finished prompt's blocks under NIXL are freed only by a decode engine's
notification or at the end of the lease (vLLM has no producer-side release: a finished request
is no longer abortable, vllm/v1/core/sched/scheduler.py:2677-2681); the gateway asks a decode
worker to release them (``decode_service``).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kv_transfer import seal
from kv_transfer.client import RELEASE_KEY, release_by_key
from kv_transfer.errors import KVTransferError
from pdserve.worker.engine_times import EnginePhases
from pdserve.worker.errors import InvalidRequest, WorkerError
from pdserve.worker.sampling import engine_prompt, salted_transfer_params
from pdserve.worker.service import WorkerService

log = logging.getLogger(__name__)


@dataclass
class PrefillResult:
    kv_transfer_params: dict[str, Any]
    first_token_id: int
    prompt_tokens: int
    cached_tokens: int
    phases: EnginePhases = field(default_factory=EnginePhases)


def handoff_request_params(
    request_id: str,
    connector: str,
    salt: str | None = None,
    tier: bool = False,
    lora_tag: str | None = None,
) -> dict[str, Any]:
    """vLLM ``SamplingParams`` fields of a prefill request, shaped for the hand-off.

    - ``max_tokens=1`` and ``ignore_eos``: the request ends after its first token with
      FINISHED_LENGTH_CAPPED, whatever that token is. vLLM checks EOS and stop tokens before the
      length (vllm/v1/core/sched/utils.py:104-119), and ``ignore_eos`` keeps the EOS id and the
      generation config's EOS ids out of the stop set (vllm/sampling_params.py:778-800), so a
      first token that is EOS does not end it as FINISHED_STOPPED. vLLM 0.32's NixlConnector
      hands off LENGTH_CAPPED and STOPPED requests (nixl/pull_scheduler.py:235-244), earlier
      releases LENGTH_CAPPED only; our connector both (kv_transfer.scheduler). The token
      sampled here is discarded: the decode engine samples its own first token.
    - ``do_remote_decode``: the request is a producer's (nixl/pull_scheduler.py:212: is_p_node;
      nixl/base_scheduler.py:199-203).
    - no stop strings, logprobs or detokenization: nothing else can end or slow it.
    - with our connector, this service's request id as the release key (see the module doc).
    - with a KV ``tier``, the request's cache ``salt`` and LoRA adapter as LMCache chunk tags.
    """
    handoff: dict[str, Any] = {"do_remote_decode": True}
    if connector == "pdserve":
        handoff[RELEASE_KEY] = request_id
    transfer = salted_transfer_params(handoff, salt, tier, lora_tag)
    return {
        "max_tokens": 1,
        "ignore_eos": True,
        "detokenize": False,
        "extra_args": {"kv_transfer_params": transfer},
    }


def tie_to_prompt(
    handoff: dict[str, Any], token_ids: Sequence[int], epoch: str, secret: bytes | None
) -> dict[str, Any]:
    """A hand-off of vLLM's NixlConnector tied to its prompt as our connector ties its own
    (``kv_transfer.seal``): the prompt's digest and this worker's epoch, sealed with the
    deployment secret, so that a decode worker refuses it for any other prompt and nobody
    without the secret can point a decode engine at a made-up producer."""
    tied = {**handoff, seal.DIGEST: seal.prompt_digest(token_ids), seal.EPOCH: epoch}
    return seal.seal(tied, secret)


class PrefillService(WorkerService):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        config = getattr(self.engine, "vllm_config", None)
        self.tp_size = int(config.parallel_config.tensor_parallel_size) if config else 1
        # The hand-off connector (also under a MultiConnector with a KV tier): only ours has
        # transfer processes to release jobs on, and seals its hand-offs itself.
        self.connector = self.settings.kv_connector
        self.own_connector = self.connector == "pdserve"
        self.epoch = secrets.token_hex(8)  # new on every start: a restart is another producer

    async def prefill(
        self, request_id: str, token_ids: list[int], salt: str | None = None, lora_name: str = ""
    ) -> PrefillResult:
        """``salt``: the request's cache salt (its KV is shared only within the salt);
        ``lora_name``: the LoRA adapter to compute it with (empty: the base model)."""
        from vllm import SamplingParams

        self.check_alive()
        adapter = self.adapters.get(lora_name)
        if not token_ids:
            raise InvalidRequest("prompt_token_ids is empty")
        if len(token_ids) >= self.info.max_model_len:
            raise InvalidRequest(
                f"prompt has {len(token_ids)} tokens; the model's context is "
                f"{self.info.max_model_len} tokens"
            )
        tier = self.settings.kv_tier != "off"
        tag = adapter.tier_tag if adapter else None
        params = SamplingParams(
            **handoff_request_params(request_id, self.connector, salt, tier, tag)
        )
        final = None
        prompt = engine_prompt(list(token_ids), salt)
        lora = await self.lora_request(lora_name)
        with self.counted():
            # vLLM's own request spans (when its tracing is on) join the caller's trace.
            trace = self.trace_headers()
            async for output in self.engine.generate(
                prompt,
                params,
                request_id,
                trace_headers=trace,
                lora_request=lora,
            ):
                final = output
        if final is None or not final.kv_transfer_params:
            raise WorkerError("the prefill engine returned no KV hand-off")
        handoff = dict(final.kv_transfer_params)
        if not self.own_connector:
            handoff = tie_to_prompt(handoff, token_ids, self.epoch, self.secret)
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

    async def abort(self, request_id: str, handoff: dict[str, Any] | None = None) -> bool:
        """Stop the prompt and unpin its blocks; True if blocks were pinned for it (our
        connector). Under NIXL, aborting frees the blocks of a prompt still running only."""
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
