"""Block hashes exactly as vLLM computes them with ``--prefix-caching-hash-algo sha256_cbor``.

Each full block of ``block_size`` token ids is hashed together with its parent's hash, so a
hash names a whole prefix. vLLM seeds the chain with ``sha256_cbor(str(PYTHONHASHSEED))``
and publishes each hash in KV events as the low 64 bits of the digest (big-endian int);
the workers' ``hash_seed`` setting and the gateway's must agree.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

import cbor2

MASK_64 = (1 << 64) - 1


def _sha256_cbor(obj: object) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


# Blocks whose digests are remembered, least recently used out first (about 0.2 kB each): a
# conversation's later turns repeat its earlier prompts' blocks, and a remembered block
# costs a dictionary lookup instead of CBOR and SHA-256 (about 6 us a block here).
MEMO_BLOCKS = 16_384


@functools.lru_cache(maxsize=16)
def _seed_digest(seed: str) -> bytes:
    return _sha256_cbor(seed)


@functools.lru_cache(maxsize=MEMO_BLOCKS)
def _block_digest(
    parent: bytes, tokens: tuple[int, ...], extra: tuple[tuple[str, ...], ...] | None
) -> bytes:
    return _sha256_cbor((parent, tokens, extra))


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    seed: int | str,
    cache_salt: str | None = None,
    lora: tuple[str, str] | None = None,
) -> list[int]:
    """The event-style (64-bit int) hashes of every full block of ``token_ids``, with vLLM's
    extra keys: a LoRA adapter's ``("lora", name, path)`` in every block's, then a
    ``cache_salt`` in the first block's (vLLM's ``generate_block_hash_extra_keys``)."""
    parent = _seed_digest(str(seed))
    out = []
    every: tuple[tuple[str, ...], ...] = (("lora", *lora),) if lora else ()
    first = every + ((("cache_salt", cache_salt),) if cache_salt else ())
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        extra = (first if start == 0 else every) or None
        parent = _block_digest(parent, tuple(token_ids[start : start + block_size]), extra)
        out.append(int.from_bytes(parent, "big") & MASK_64)
    return out
