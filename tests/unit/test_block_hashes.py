"""The gateway's block hashes equal vLLM's own (sha256_cbor, seeded, 64-bit event ids)."""

from __future__ import annotations

from pdserve.kvindex.hashing import MASK_64, block_hashes


def vllm_hashes(ids: list[int], block_size: int, seed: str) -> list[int]:
    import os

    os.environ["PYTHONHASHSEED"] = seed
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    fn = get_hash_fn_by_name("sha256_cbor")
    kv_cache_utils.init_none_hash(fn)
    parent, out = None, []
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = kv_cache_utils.hash_block_tokens(fn, parent, ids[start : start + block_size])
        out.append(int.from_bytes(parent, "big") & MASK_64)
    return out


def test_hashes_match_vllm() -> None:
    ids = [(i * 7919) % 49152 for i in range(1000)]
    ours = block_hashes(ids, 128, seed=42)
    assert len(ours) == 7  # only full blocks
    assert ours == vllm_hashes(ids, 128, "42")
    assert block_hashes(ids, 128, seed=43) != ours  # the seed matters
    assert block_hashes([*ids[:256], 1], 128, seed=42) == ours[:2]  # prefixes share hashes


def test_a_cache_salt_hashes_as_vllm_salts_a_request() -> None:
    import os
    from types import SimpleNamespace

    os.environ["PYTHONHASHSEED"] = "42"
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    fn = get_hash_fn_by_name("sha256_cbor")
    kv_cache_utils.init_none_hash(fn)
    ids = [(i * 7919) % 49152 for i in range(300)]
    request = SimpleNamespace(
        cache_salt="tenant-a", lora_request=None, mm_features=[], prompt_embeds=None
    )
    parent, theirs = None, []
    for start in range(0, 256, 128):
        extra, _ = kv_cache_utils.generate_block_hash_extra_keys(request, start, start + 128, 0)
        parent = kv_cache_utils.hash_block_tokens(fn, parent, ids[start : start + 128], extra)
        theirs.append(int.from_bytes(parent, "big") & MASK_64)
    salted = block_hashes(ids, 128, seed=42, cache_salt="tenant-a")
    assert salted == theirs
    plain = block_hashes(ids, 128, seed=42)
    assert all(s != p for s, p in zip(salted, plain, strict=True))  # every block, not the first
    assert block_hashes(ids, 128, seed=42, cache_salt="tenant-b") != salted


def test_remembered_blocks_hash_as_computed_ones() -> None:
    """A later turn's blocks come from the memo of the earlier turn's, with the same hashes
    as computed afresh; a salt or another seed is never served another's."""
    from pdserve.kvindex import hashing

    ids = [(i * 7919) % 49152 for i in range(1000)]
    hashing._block_digest.cache_clear()
    first = block_hashes(ids[:600], 16, seed=42)
    hits = hashing._block_digest.cache_info().hits
    later = block_hashes(ids, 16, seed=42)  # the first 37 blocks again, then new ones
    assert hashing._block_digest.cache_info().hits - hits == len(first)
    hashing._block_digest.cache_clear()
    assert later == block_hashes(ids, 16, seed=42) and later[: len(first)] == first
    assert later == vllm_hashes(ids, 16, "42")
    salted = block_hashes(ids, 16, seed=42, cache_salt="tenant-a")
    assert all(s != p for s, p in zip(salted, later, strict=True))
    assert block_hashes(ids, 16, seed=43)[0] != later[0]


def test_a_lora_adapters_prompt_hashes_as_vllm_hashes_it() -> None:
    """vLLM's extra keys of an adapter's blocks (its name and path in every block, then a
    salt in the first) are the gateway's: the index finds an adapter's KV, and only its."""
    import os
    from types import SimpleNamespace

    from vllm.lora.request import LoRARequest

    os.environ["PYTHONHASHSEED"] = "42"
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    fn = get_hash_fn_by_name("sha256_cbor")
    kv_cache_utils.init_none_hash(fn)
    ids = [(i * 7919) % 49152 for i in range(300)]
    lora = LoRARequest("colors", 1, "/adapters/colors")
    for salt in (None, "tenant-a"):
        request = SimpleNamespace(
            cache_salt=salt, lora_request=lora, mm_features=[], prompt_embeds=None
        )
        parent, theirs = None, []
        for start in range(0, 256, 128):
            extra, _ = kv_cache_utils.generate_block_hash_extra_keys(request, start, start + 128, 0)
            parent = kv_cache_utils.hash_block_tokens(fn, parent, ids[start : start + 128], extra)
            theirs.append(int.from_bytes(parent, "big") & MASK_64)
        ours = block_hashes(ids, 128, seed=42, cache_salt=salt, lora=("colors", "/adapters/colors"))
        assert ours == theirs, salt
        base = block_hashes(ids, 128, seed=42, cache_salt=salt)
        assert all(a != b for a, b in zip(ours, base, strict=True))
    moved = block_hashes(ids, 128, seed=42, lora=("colors", "/elsewhere/colors"))
    assert moved != block_hashes(ids, 128, seed=42, lora=("colors", "/adapters/colors"))
