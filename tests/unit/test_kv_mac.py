"""The MACs over a pull (``kv_transfer.integrity``): each block's tag is GMAC under its job's
key with its position as nonce, over its bytes in every layer; the pull's MAC is GMAC under a
one-time key per pull over header and tags. Both are the same however the bytes are cut into
updates, and differ for another pull, job, position or byte."""

from __future__ import annotations

import os

import blake3
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kv_transfer import integrity
from kv_transfer.integrity import BlockTags, IntegrityError, PullMac, check, job_key, tag_blocks

KEY = bytes(range(32))
HEADER = b'{"ok": true, "nbytes": 300000, "req": "r"}'
LAYERS = [1_000, 3_000, 96]  # a block's bytes in each layer
BLOCKS = 5
# Wire order: layer by layer, each layer's part of every block in turn.
DATA = os.urandom(sum(LAYERS) * BLOCKS)


def segment(layer: int, block: int) -> bytes:
    start = sum(LAYERS[:layer]) * BLOCKS + block * LAYERS[layer]
    return DATA[start : start + LAYERS[layer]]


def one_shot_tag(key: bytes, position: int, block: int) -> bytes:
    """A block's tag as one AES-256-GCM call with nothing encrypted: its tag is the GMAC."""
    data = b"".join(segment(layer, block) for layer in range(len(LAYERS)))
    return AESGCM(key).encrypt(position.to_bytes(12, "big"), b"", data)


def one_shot_pull(key: bytes, counter: int, header: bytes, tags: bytes) -> bytes:
    prefix = b"pdserve-kv-pull\0" + counter.to_bytes(8, "big") + len(header).to_bytes(8, "big")
    pull_key = blake3.blake3(prefix, key=key).digest()
    return AESGCM(pull_key).encrypt(bytes(12), b"", prefix + header + tags)


def tracked(key: bytes, first: int, views: list[memoryview], steps: list[int]) -> bytes:
    tags = BlockTags(key, first, BLOCKS, LAYERS)
    tracker = tags.tracker(views)
    for total in steps:
        tracker.advance(total)
    return tags.tags()


def test_block_tags_are_gmac_under_the_jobs_key_with_the_position_as_nonce() -> None:
    assert integrity.ALGORITHM == "aes256-gmac-blocks" and integrity.MAC_BYTES == 16
    key = job_key(b"secret", "a1b2:7")
    expected = b"".join(one_shot_tag(key, 2 + b, b) for b in range(BLOCKS))
    assert tracked(key, 2, [memoryview(DATA)], [len(DATA)]) == expected
    # The producer's tags of a whole job, sliced for a run, are the consumer's of that run.
    assert tag_blocks(key, [memoryview(DATA)], BLOCKS, LAYERS)[:16] == one_shot_tag(key, 0, 0)


@pytest.mark.parametrize("step", [1, 999, 1_000, 4_096, 12_345, len(DATA)])
def test_block_tags_do_not_depend_on_how_the_bytes_arrive(step: int) -> None:
    # Scattered views of unequal sizes, hashed as a socket would have filled them.
    data = memoryview(DATA)
    views = [data[:1_500], data[1_500:1_501], data[1_501:9_000], data[9_000:]]
    steps = [*range(step, len(DATA), step), len(DATA)]
    assert tracked(KEY, 0, views, steps) == tracked(KEY, 0, [data], [len(DATA)])


def test_another_job_position_or_byte_gives_other_tags() -> None:
    reference = tracked(job_key(b"s", "n:1"), 0, [memoryview(DATA)], [len(DATA)])
    flipped = bytearray(DATA)
    flipped[4_321] ^= 1
    assert tracked(job_key(b"s", "n:2"), 0, [memoryview(DATA)], [len(DATA)]) != reference
    assert tracked(job_key(b"t", "n:1"), 0, [memoryview(DATA)], [len(DATA)]) != reference
    assert tracked(job_key(b"s", "n:1"), 1, [memoryview(DATA)], [len(DATA)]) != reference
    other = tracked(job_key(b"s", "n:1"), 0, [memoryview(flipped)], [len(DATA)])
    # Only the flipped block's tag differs (byte 4,321 is in block 4's part of layer 0).
    assert [other[i : i + 16] != reference[i : i + 16] for i in range(0, 80, 16)].count(True) == 1
    check(reference, tracked(job_key(b"s", "n:1"), 0, [memoryview(DATA)], [len(DATA)]))
    with pytest.raises(IntegrityError):
        check(reference, other)


def test_the_pull_mac_is_gmac_under_a_one_time_key_over_header_and_tags() -> None:
    tags = os.urandom(16 * BLOCKS)
    mac = PullMac(KEY, 3, HEADER)
    mac.update(tags)
    assert mac.digest() == one_shot_pull(KEY, 3, HEADER, tags)
    other = PullMac(KEY, 4, HEADER)
    other.update(tags)
    assert other.digest() != one_shot_pull(KEY, 3, HEADER, tags)
