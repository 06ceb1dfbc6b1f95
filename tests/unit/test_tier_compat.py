"""The KV tier's compatibility digest and its refusal to run without LMCache.

On the CPU the tier stores raw packed blocks, so workers whose blocks differ (model, weights,
dtype, block size, layout, attention ISA, ...) must never read each other's chunks: the CPU
copier (``kv_transfer.lmcache_tier.install_cpu_copier``) names the tier's keys with a digest of
the engine's KV compatibility description (``kv_transfer.compat.describe``). Here each worker
is LMCache's own factory call (``CreateGPUConnector``, as LMCache's vLLM adapter makes it) and
its own token database (``ChunkedTokenDatabase``), the code that turns a prompt into the keys
a shared tier is asked for; the engine configuration is a stand-in with the fields
``describe`` reads.

And an LMCache that fails to start (here: LMCache's own manager catching the copier's refusal
of a mode it cannot serve) makes the tier connector raise, instead of letting the engine run in
LMCache's "degraded mode (recompute)".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lmcache.v1.gpu_connector as copier_factory
import pytest
import torch
from lmcache.utils import EngineType
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.token_database import ChunkedTokenDatabase

from kv_transfer import lmcache_tier

CHUNK = 32  # tokens per tier chunk: two 16-token blocks
PROMPT = list(range(1000, 1000 + 4 * CHUNK))


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))  # weights digests


@pytest.fixture(autouse=True)
def stock_factory(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """LMCache's own copier factory back after each test: ours is installed once per process
    (one engine per worker), and each "worker" here installs it again for its own engine."""
    monkeypatch.setattr(copier_factory, "CreateGPUConnector", copier_factory.CreateGPUConnector)
    yield


@dataclasses.dataclass(frozen=True)
class Engine:
    """What decides the bytes of a stored block, as an engine configuration says it."""

    model_dir: str
    dtype: torch.dtype = torch.float32
    block_size: int = 16
    layers: int = 30
    kv_heads: int = 3
    head_size: int = 64
    layout: str | None = None
    num_blocks: int = 1000

    def vllm_config(self) -> Any:
        model = SimpleNamespace(
            hf_config=SimpleNamespace(model_type="llama", num_hidden_layers=self.layers),
            model=self.model_dir, revision=None, quantization=None, dtype=self.dtype,
            get_num_layers=lambda parallel: self.layers,
            get_num_kv_heads=lambda parallel: self.kv_heads,
            get_head_size=lambda: self.head_size,
        )  # fmt: skip
        cache = SimpleNamespace(block_size=self.block_size, cache_dtype="auto",
                                kv_cache_layout=self.layout,
                                num_gpu_blocks=self.num_blocks)  # fmt: skip
        return SimpleNamespace(model_config=model, cache_config=cache, kv_transfer_config=None,
                               parallel_config=SimpleNamespace(tensor_parallel_size=1))  # fmt: skip


def weights(root: Path, data: bytes) -> str:
    root.mkdir(exist_ok=True)
    (root / "config.json").write_text('{"hidden_size": 8}')
    (root / "model.safetensors").write_bytes(data)
    return str(root)


def tier_keys(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, model_name: str = "SmolLM2-135M-Instruct"
) -> list[Any]:
    """The keys under which a worker with this engine stores (and looks up) PROMPT's chunks:
    the copier installed for its engine, LMCache's factory call, then its token database."""
    monkeypatch.setattr(copier_factory, "CreateGPUConnector", STOCK)
    vllm_config = engine.vllm_config()
    lmcache_tier.install_cpu_copier(vllm_config)
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK)
    metadata = LMCacheMetadata(
        model_name=model_name, world_size=1, local_world_size=1, worker_id=0,
        local_worker_id=0, kv_dtype=engine.dtype, chunk_size=CHUNK, role="worker",
        kv_shape=(engine.layers, 2, CHUNK, engine.kv_heads, engine.head_size),
    )  # fmt: skip
    copier_factory.CreateGPUConnector(config, metadata, EngineType.VLLM)
    copier_factory.CreateGPUConnector(config, metadata, EngineType.VLLM)  # named once only
    database = ChunkedTokenDatabase(config, metadata)
    return [key for _, _, key in database.process_tokens(tokens=PROMPT)]


STOCK = copier_factory.CreateGPUConnector

DIFFERENT: dict[str, Callable[[Engine, Path], Engine]] = {
    "dtype": lambda e, _: dataclasses.replace(e, dtype=torch.bfloat16),
    "block_size": lambda e, _: dataclasses.replace(e, block_size=32),
    "layers": lambda e, _: dataclasses.replace(e, layers=24),
    "kv_heads": lambda e, _: dataclasses.replace(e, kv_heads=5),
    "head_size": lambda e, _: dataclasses.replace(e, head_size=128),
    "layout": lambda e, _: dataclasses.replace(e, layout="HND"),
    "weights": lambda e, tmp: dataclasses.replace(e, model_dir=weights(tmp / "w", b"\2" * 64)),
}  # fmt: skip


@pytest.fixture
def base(tmp_path: Path) -> Engine:
    return Engine(model_dir=weights(tmp_path / "base", b"\1" * 4096))


@pytest.mark.parametrize("change", sorted(DIFFERENT))
def test_workers_whose_blocks_differ_never_share_a_tier_chunk(
    base: Engine, change: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk one worker stored is a miss for a worker whose blocks are laid out otherwise
    (the keys differ in their model name's digest), never KV of another shape or model."""
    stored = tier_keys(base, monkeypatch)
    assert len(stored) == len(PROMPT) // CHUNK
    tier = {key: f"chunk {n}" for n, key in enumerate(stored)}  # a shared tier's index
    other = tier_keys(DIFFERENT[change](base, tmp_path), monkeypatch)
    assert [tier.get(key) for key in other] == [None] * len(other)
    assert {k.model_name for k in other}.isdisjoint({k.model_name for k in stored})
    # The same chunk hashes: only the digest keeps the workers apart.
    assert [k.chunk_hash for k in other] == [k.chunk_hash for k in stored]


def test_workers_with_the_same_blocks_share_every_chunk(
    base: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The digest leaves out what is local to a worker (its number of KV blocks)."""
    stored = tier_keys(base, monkeypatch)
    tier = {key: f"chunk {n}" for n, key in enumerate(stored)}
    again = tier_keys(dataclasses.replace(base, num_blocks=77), monkeypatch)
    assert [tier.get(key) for key in again] == [f"chunk {n}" for n in range(len(stored))]
    assert stored[0].model_name.startswith("SmolLM2-135M-Instruct#")
    assert stored[0].model_name.endswith("#" + lmcache_tier.namespace(base.vllm_config()))


class FailingServices:
    """LMCache's service factory for a worker whose tier cannot start: the engine's copier is
    made as LMCache's vLLM adapter makes it, with LMCache's blending mode (GPU only) on."""

    def __init__(self, engine: Engine) -> None:
        self.config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, enable_blending=True)
        self.metadata = LMCacheMetadata(
            model_name="m", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
            kv_dtype=engine.dtype, chunk_size=CHUNK, role="worker",
            kv_shape=(engine.layers, 2, CHUNK, engine.kv_heads, engine.head_size),
        )  # fmt: skip

    def get_or_create_metadata(self) -> LMCacheMetadata:
        return self.metadata

    def get_or_create_lmcache_engine(self) -> Any:
        copier_factory.CreateGPUConnector(self.config, self.metadata, EngineType.VLLM)
        raise AssertionError("the copier accepted a mode it cannot serve")


def test_an_lmcache_that_failed_to_start_stops_the_engine_with_the_reason(
    base: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LMCache's manager catches the failure and would go on in "degraded mode (recompute)";
    the tier connector raises instead, naming LMCache's reason and what to check."""
    from lmcache.v1.manager import LMCacheManager
    from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import (
        LMCacheConnectorV1,
    )

    managers: list[Any] = []

    def lmcache_start(self: Any, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        """vLLM's LMCache connector, down to LMCache's manager (its other parts need a
        running engine): the manager over the failing factory, as LMCache's adapter holds it."""
        manager = LMCacheManager(services.config, services)
        managers.append(manager)
        self._lmcache_engine = SimpleNamespace(_manager=manager)

    services = FailingServices(base)
    monkeypatch.setattr(LMCacheConnectorV1, "__init__", lmcache_start)
    with pytest.raises(lmcache_tier.TierUnavailable) as refused:
        lmcache_tier.PdserveTierConnector(base.vllm_config(), "worker")
    (manager,) = managers
    assert manager._init_failed, "LMCache itself went on, degraded"
    message = str(refused.value)
    assert message.startswith("the KV tier (LMCache) failed to start: ")
    assert "LMCache layerwise and blending modes need a GPU" in message
    assert "--kv-tier off" in message


def test_a_model_whose_name_holds_a_hash_sign_still_gets_the_digest(
    base: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    named = tier_keys(base, monkeypatch, model_name="team#model")
    other = tier_keys(DIFFERENT["dtype"](base, tmp_path), monkeypatch, model_name="team#model")
    digest = lmcache_tier.namespace(base.vllm_config())
    assert {k.model_name for k in named} == {f"team#model#{digest}"}
    assert {k.model_name for k in other}.isdisjoint({k.model_name for k in named})
