"""The LoRA adapters a worker's engine serves (its ``lora_modules``, vLLM's ``--lora-modules``).

Each adapter is a PEFT directory (``adapter_config.json`` and its weights) under a name
clients give as the request's ``model``. The worker turns on vLLM's LoRA for them
(``--enable-lora``, ``--max-loras``, ``--max-lora-rank`` unless its engine arguments set
them), reports them in its capabilities (the gateway routes an adapter's requests only to
workers that serve it), and runs a request whose parameters name one (``lora_name``) with
vLLM's ``LoRARequest`` for it, on the prefill and on the decode worker alike: the KV moved
between them was computed with the adapter, and vLLM's block hashes of it name the adapter
(its name and path), so it never meets the base model's or another adapter's KV. In a shared
KV tier (LMCache, which names chunks by their tokens and tags) an adapter's chunks carry its
tag (``pdserve.worker.sampling.TIER_LORA_TAG``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.settings import named_paths
from pdserve.worker.errors import InvalidRequest

# vLLM's accepted --max-lora-rank values (vllm/config/lora.py).
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str
    rank: int
    int_id: int  # vLLM's lora_int_id: 1, 2, ... in the order given

    @property
    def tier_tag(self) -> str:
        """The adapter's LMCache tag value (a digest of its name and path: tags are part of a
        chunk's key, whose characters LMCache restricts)."""
        return hashlib.sha256(f"{self.name}\0{self.path}".encode()).hexdigest()[:32]


def adapter_rank(path: str) -> int:
    """The rank of the PEFT LoRA adapter in ``path``; ValueError if it is none."""
    config = Path(path) / "adapter_config.json"
    try:
        return int(json.loads(config.read_text())["r"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is no PEFT LoRA adapter ({err})") from err


def parse_modules(text: str) -> list[Adapter]:
    """``name=path[,name=path...]`` as adapters; each path must be a PEFT adapter directory."""
    adapters: list[Adapter] = []
    for name, path in named_paths(text, "lora_modules"):
        if any(a.name == name for a in adapters):
            raise ValueError(f"lora_modules: the name {name!r} is given twice")
        try:
            rank = adapter_rank(path)
        except ValueError as err:
            raise ValueError(f"lora_modules: {err}") from err
        # the path as given, as vLLM keeps it: it is part of the adapter's block hashes
        adapters.append(Adapter(name, path, rank, len(adapters) + 1))
    return adapters


# With adapters loaded at run time (runtime_lora): room for this many, of this rank at most.
RUNTIME_LORAS = 4
RUNTIME_RANK = 16


def engine_flags(
    adapters: Sequence[Adapter], user: Sequence[str], runtime: bool = False
) -> list[str]:
    """vLLM's LoRA flags for ``adapters`` (and, ``runtime``, for adapters loaded later) that
    the user's engine arguments do not set."""
    if not adapters and not runtime:
        return []
    given = {a.split("=", 1)[0] for a in user if a.startswith("--")}
    flags = [] if "--enable-lora" in given else ["--enable-lora"]
    if "--max-loras" not in given:
        flags += ["--max-loras", str(max(len(adapters), RUNTIME_LORAS if runtime else 1))]
    if "--max-lora-rank" not in given:
        top = max([a.rank for a in adapters] + [RUNTIME_RANK if runtime else 1])
        flags += ["--max-lora-rank", str(next((r for r in VLLM_RANKS if r >= top), top))]
    return flags


class Adapters:
    """The adapters of one worker, by name: those it started with, and those loaded and
    unloaded since (``load``, ``unload``: vLLM's engine is told)."""

    def __init__(self, adapters: Sequence[Adapter]) -> None:
        self.by_name = {a.name: a for a in adapters}
        self._next_id = len(adapters) + 1
        # Those resident in the engine's LoRA cache when last asked (``refresh``).
        self.resident: frozenset[str] = frozenset()

    async def refresh(self, engine: Any) -> frozenset[str]:
        """The adapters resident in ``engine``'s LoRA cache now (vLLM's ``list_loras``: its
        cache holds ``--max-cpu-loras`` of them and evicts the least recently used one to
        load another), kept in ``resident``."""
        if getattr(engine.vllm_config, "lora_config", None) is None:
            return self.resident
        ids = await engine.list_loras()
        self.resident = frozenset(a.name for a in self.by_name.values() if a.int_id in ids)
        return self.resident

    async def load(self, engine: Any, name: str, path: str, inplace: bool = False) -> None:
        """Load ``path`` as ``name`` into ``engine`` (vLLM's ``add_lora``, as vllm serve's
        ``/v1/load_lora_adapter``); ``inplace``: replace an adapter of that name."""
        lora_config = getattr(engine.vllm_config, "lora_config", None)
        if lora_config is None:
            raise InvalidRequest("this worker's engine runs without LoRA (give it lora_modules "
                                 "or --enable-lora in its engine arguments)")  # fmt: skip
        if name in self.by_name and not inplace:
            raise InvalidRequest(f"the LoRA adapter {name!r} is loaded already")
        try:
            rank = adapter_rank(path)
        except ValueError as err:
            raise InvalidRequest(str(err)) from err
        if rank > lora_config.max_lora_rank:
            raise InvalidRequest(
                f"the adapter's rank {rank} exceeds this engine's --max-lora-rank "
                f"{lora_config.max_lora_rank}"
            )
        old = self.by_name.get(name)
        adapter = Adapter(name, path, rank, old.int_id if old else self._next_id)
        from vllm.lora.request import LoRARequest

        request = LoRARequest(name, adapter.int_id, path, load_inplace=inplace)
        try:
            await engine.add_lora(request)
        except Exception as err:  # vLLM's loader: a bad directory, a mismatched model, ...
            raise InvalidRequest(f"vLLM cannot load the LoRA adapter {name!r}: {err}") from err
        if old is None:
            self._next_id += 1
        self.by_name[name] = adapter

    async def unload(self, engine: Any, name: str) -> None:
        adapter = self.by_name.pop(name, None)
        if adapter is None:
            raise InvalidRequest(f"this worker serves no LoRA adapter {name!r}")
        await engine.remove_lora(adapter.int_id)

    def get(self, name: str) -> Adapter | None:
        """The adapter a request's ``lora_name`` names; None: the base model. One this worker
        does not serve is the request's error (the gateway routes only to workers that do)."""
        if not name:
            return None
        adapter = self.by_name.get(name)
        if adapter is None:
            raise InvalidRequest(f"this worker serves no LoRA adapter {name!r}")
        return adapter

    def request(self, name: str) -> Any:
        """vLLM's ``LoRARequest`` for ``name``; None: the base model."""
        adapter = self.get(name)
        if adapter is None:
            return None
        from vllm.lora.request import LoRARequest

        return LoRARequest(adapter.name, adapter.int_id, adapter.path)
