"""The MAC over a pull's bytes (``kv_transfer.integrity``): GMAC under a one-time key per pull,
the same however the bytes are cut into updates, and different for another pull or byte."""

from __future__ import annotations

import os

import blake3
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kv_transfer import integrity
from kv_transfer.integrity import IntegrityError, PullMac, Tracker, check

KEY = bytes(range(32))
HEADER = b'{"ok": true, "nbytes": 300000, "req": "r"}'
BLOCKS = os.urandom(300_000)


def one_shot(key: bytes, counter: int, header: bytes, data: bytes) -> bytes:
    """The MAC as one AES-256-GCM call with nothing encrypted: its tag is the GMAC."""
    prefix = b"pdserve-kv-pull\0" + counter.to_bytes(8, "big") + len(header).to_bytes(8, "big")
    pull_key = blake3.blake3(prefix, key=key).digest()
    return AESGCM(pull_key).encrypt(bytes(12), b"", prefix + header + data)


def tracked(counter: int, views: list[memoryview], steps: list[int]) -> bytes:
    mac = PullMac(KEY, counter, HEADER)
    tracker = Tracker(mac, views)
    for total in steps:
        tracker.advance(total)
    return mac.digest()


def test_the_mac_is_gmac_under_a_one_time_key_per_pull() -> None:
    assert integrity.ALGORITHM == "aes256-gmac" and integrity.MAC_BYTES == 16
    mac = PullMac(KEY, 3, HEADER)
    mac.update(memoryview(BLOCKS))
    assert mac.digest() == one_shot(KEY, 3, HEADER, BLOCKS)


@pytest.mark.parametrize("step", [1_000, 65_537, 98_304, 1 << 20])
def test_the_mac_does_not_depend_on_how_the_bytes_arrive(step: int) -> None:
    # Scattered views of unequal sizes, hashed as a socket would have filled them.
    data = memoryview(BLOCKS)
    views = [data[:98_304], data[98_304:100_000], data[100_000:]]
    steps = [*range(step, len(BLOCKS), step), len(BLOCKS)]
    assert tracked(0, views, steps) == one_shot(KEY, 0, HEADER, BLOCKS)


def test_another_pull_or_a_flipped_bit_gives_another_mac() -> None:
    reference = one_shot(KEY, 0, HEADER, BLOCKS)
    flipped = bytearray(BLOCKS)
    flipped[123_456] ^= 1
    assert tracked(1, [memoryview(BLOCKS)], [len(BLOCKS)]) != reference
    assert tracked(0, [memoryview(flipped)], [len(BLOCKS)]) != reference
    check(reference, tracked(0, [memoryview(BLOCKS)], [len(BLOCKS)]))
    with pytest.raises(IntegrityError):
        check(reference, tracked(0, [memoryview(flipped)], [len(BLOCKS)]))
