"""Integrity of the KV bytes of a pull, after the handshake.

The handshake (``kv_transfer.auth``) leaves both ends of a connection with a key of their own
(``session_key``: from the deployment secret and both nonces). For every pull served on the
connection the producer sends, after the blocks, a MAC made with that key over a
count of the pulls served on this connection before it (no answer can be replayed in place
of another), the answer's header and every block byte in wire order (``PullMac``); the
consumer computes the same over what it received and fails the pull unless they are equal.
A flipped bit anywhere in the blocks, or bytes a third party put on the connection, is then a
failed pull (the decode engine recomputes the prompt; it caches nothing of a failed load).

The MAC is GMAC: AES-256-GCM (``cryptography``) with the MAC's input as additional data only,
nothing encrypted, the tag as the MAC (NIST SP 800-38D); about 20 GB/s per core with VAES and
VPCLMULQDQ, where Poly1305 made about 12. Its key is a one-time key per pull, derived from the
connection's key with keyed BLAKE3 (vLLM depends on ``blake3``) over the pull's counter. GCM
fails only if one key and nonce authenticate two different messages (the two tags then give away
the hash key, and with it forgeries); no key here authenticates more than one: the connection's
key is its own (both ends' fresh nonces), the counter never repeats on a connection, and both
ends compute the one MAC of the one pull. The nonce can therefore be fixed (zero). Without
``cryptography``, keyed BLAKE3 itself is the MAC (~4 GB/s per core). Which one is in the KV
compatibility description (``ALGORITHM``), so two workers that would disagree never pair.
Both ends hash while the transfer runs, not after it (``Tracker``): each hashes what the
socket has just sent or received, while the kernel and the peer move the next bytes.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

_blake3: Any
try:
    import blake3 as _blake3
except ImportError:  # pragma: no cover - vLLM installs it
    _blake3 = None

_gcm: Any
try:
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    def _gcm(key: bytes) -> Any:
        return Cipher(algorithms.AES(key), modes.GCM(_NONCE)).encryptor()

except ImportError:  # pragma: no cover - installed with LMCache's dependencies
    _gcm = None

ALGORITHM = "aes256-gmac" if _gcm is not None else "blake3" if _blake3 is not None else "blake2b"
MAC_BYTES = 16 if _gcm is not None else 32
_LABEL = b"pdserve-kv-pull\0"
# GCM's nonce: fixed, as each key is used for one pull only (see the module's docstring).
_NONCE = bytes(12)


class IntegrityError(ConnectionError):
    """The blocks received are not the blocks the producer sent (or the producer is not the
    one the connection was authenticated with)."""


@dataclass
class Session:
    """One connection's key and the pulls answered on it so far (both ends count alike)."""

    key: bytes
    pulls: int = 0


def _keyed(key: bytes) -> Any:
    if _blake3 is not None:
        return _blake3.blake3(key=key)
    return hashlib.blake2b(key=key, digest_size=32)


class PullMac:
    """The MAC of one pull's answer: pull counter, header, then block bytes in wire order."""

    update: Callable[[bytes | memoryview], None]  # the block bytes, in order

    def __init__(self, key: bytes, counter: int, header: bytes) -> None:
        prefix = _LABEL + counter.to_bytes(8, "big") + len(header).to_bytes(8, "big")
        self.h = _keyed(key)
        if _gcm is not None:
            # A one-time key for this pull: its GCM nonce can then be fixed.
            self.h.update(prefix)
            self.h = _gcm(self.h.digest())
            self.update = self.h.authenticate_additional_data
        else:
            self.update = self.h.update
        self.update(prefix)
        self.update(header)

    def digest(self) -> bytes:
        if _gcm is not None:
            self.h.finalize()
            return bytes(self.h.tag)
        return bytes(self.h.digest())


class Tracker:
    """Feeds a MAC the views' bytes, in order, as far as the socket has sent or filled them:
    hashing runs between socket calls, while the kernel moves the next bytes (the peer keeps
    sending into, or draining, the socket buffers meanwhile); no thread, no extra copy."""

    def __init__(self, mac: PullMac, views: Sequence[memoryview]) -> None:
        self.mac = mac
        self.views = views
        self.index = 0  # the view being hashed
        self.offset = 0  # bytes of it hashed
        self.done = 0  # bytes hashed in all

    def advance(self, total: int) -> None:
        """Hash up to byte ``total`` of the views' concatenation."""
        while self.done < total and self.index < len(self.views):
            view = self.views[self.index]
            end = min(len(view), self.offset + total - self.done)
            self.mac.update(view[self.offset : end])
            self.done += end - self.offset
            if end == len(view):
                self.index, self.offset = self.index + 1, 0
            else:
                self.offset = end


def check(expected: bytes, received: bytes) -> None:
    if not hmac.compare_digest(expected, received):
        raise IntegrityError(
            "the KV blocks received do not match the MAC the prefill worker sent (corrupted or "
            "altered on the way); the pull fails and nothing of it is used"
        )
