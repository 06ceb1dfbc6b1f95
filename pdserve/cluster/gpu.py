"""``pdserve up`` on GPUs: the workers' KV connector, NIXL's side-channel port of each worker,
and how engines that share one GPU split its memory and start.

- Connector: ``auto`` picks vLLM's NixlConnector when GPUs are found (our own connector moves
  CPU KV caches only) and ours otherwise; the choice is printed at start-up.
- Side channel: vLLM's NIXL scheduler binds ``VLLM_NIXL_SIDE_CHANNEL_PORT`` (default 5600,
  vllm/envs.py:1738-1741) on every engine (nixl/base_scheduler.py:76-80, 318-333), so workers
  on one host need a port each: worker ``i`` (prefill workers first, then decode workers) gets
  ``--nixl-port`` base + ``i``.
- Memory: vLLM sizes an engine's KV cache from ``--gpu-memory-utilization``, the fraction of
  the whole GPU it may use (vllm/v1/worker/utils.py:724-775, default 0.9); ``k`` engines on
  one GPU get ``0.9 / k`` each unless the role's engine arguments set it.
- Start order: an engine measures its memory use by how the GPU's free memory changes while it
  profiles, and fails if another process frees memory meanwhile (vllm/v1/worker/
  gpu_worker.py:713-726); engines sharing a GPU therefore start one after another.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Sequence
from typing import Literal

from pdserve.settings import sets_flag

ConnectorChoice = Literal["auto", "pdserve", "nixl"]
DEFAULT_NIXL_PORT = 5600  # vLLM's own default (vllm/envs.py:1738-1741)
# vLLM's default --gpu-memory-utilization for an engine that has the GPU to itself.
GPU_MEMORY_BUDGET = 0.9
MEMORY_FLAG = "--gpu-memory-utilization"


class ConnectorError(ValueError):
    """The requested KV connector cannot run on this machine (shown to the user as is)."""


def connector_for(choice: str, gpus: Sequence[str]) -> str:
    """The workers' ``--kv-connector`` ("pdserve" or "nixl") for ``choice`` on this machine."""
    if choice == "auto":
        return "nixl" if gpus else "pdserve"
    if choice == "pdserve" and gpus:
        raise ConnectorError(
            "--kv-connector pdserve moves CPU KV caches only, and the engines run on "
            f"GPU(s) {', '.join(gpus)}: use --kv-connector nixl (the default on GPUs)"
        )
    return choice


def nixl_ports(base: int, prefill: int, decode: int) -> tuple[list[int], list[int]]:
    """Side-channel ports of the prefill and of the decode workers: one each, consecutive."""
    return [base + i for i in range(prefill)], [base + prefill + i for i in range(decode)]


def choice_line(connector: str, gpus: Sequence[str], base: int, workers: int) -> str:
    """What ``pdserve up`` prints about the connector at start-up."""
    if connector == "nixl":
        where = f"{len(gpus)} GPU(s) found ({', '.join(gpus)})" if gpus else "no GPU found"
        last = base + workers - 1
        ports = f"port {base}" if workers == 1 else f"ports {base}-{last}"
        return (
            f"pdserve up: {where}: KV connector nixl (vLLM's NixlConnector, UCX), "
            f"NIXL side channel on 127.0.0.1 {ports}"
        )
    where = f"{len(gpus)} GPU(s) found" if gpus else "no GPU found"
    return f"pdserve up: {where}: KV connector pdserve (TCP between CPU KV caches)"


def memory_shares(gpu_of_engine: Sequence[str | None]) -> list[float | None]:
    """``--gpu-memory-utilization`` of each engine: ``GPU_MEMORY_BUDGET / k`` (rounded down to
    hundredths) for the ``k`` > 1 engines on one GPU; None for an engine alone on its GPU or
    on none (vLLM's default applies)."""
    counts: dict[str, int] = {}
    for gpu in gpu_of_engine:
        if gpu is not None:
            counts[gpu] = counts.get(gpu, 0) + 1
    shares: list[float | None] = []
    for gpu in gpu_of_engine:
        k = counts.get(gpu, 0) if gpu is not None else 0
        shares.append(math.floor(GPU_MEMORY_BUDGET / k * 100) / 100 if k > 1 else None)
    return shares


def starts_after(gpu_of_engine: Sequence[str | None]) -> list[int | None]:
    """For each engine, the index of the engine before it on the same GPU (it starts once that
    one is ready), or None."""
    last: dict[str, int] = {}
    after: list[int | None] = []
    for i, gpu in enumerate(gpu_of_engine):
        after.append(last.get(gpu) if gpu is not None else None)
        if gpu is not None:
            last[gpu] = i
    return after


def sets_memory(engine_args: str) -> bool:
    """Whether the user's engine arguments choose ``--gpu-memory-utilization`` themselves."""
    return sets_flag(shlex.split(engine_args), MEMORY_FLAG)


def with_memory_share(engine_args: str, share: float | None) -> str:
    """``engine_args`` with the engine's memory share first (the user's own choice wins)."""
    if share is None or sets_memory(engine_args):
        return engine_args
    return f"{MEMORY_FLAG} {share:g} {engine_args}".rstrip()
