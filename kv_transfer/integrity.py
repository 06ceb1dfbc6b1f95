"""Integrity of the KV bytes of a pull, after the handshake.

Two MACs cover a pull's answer:

- **Block tags.** Each block of a job has a tag: a MAC over the block's bytes in every layer,
  in wire order, under the job's key, with the block's position in the job as its nonce
  (``BlockTags``). The job's key is derived from the deployment secret and a name the producer
  gives the job, unique for all time (a random name for the transfer process's life and a
  count of its jobs: ``job_key``), so only a holder of the secret can make or check a tag.
  The producer tags a job's blocks when the job registers, in a thread of its own, while
  nothing waits for them (``Producer``): the pull sends the blocks at once and the tags after
  them, so the sender's pass over the bytes is off the pull's path. The consumer computes the
  tags of what it received as it arrives (``Tracker``) and compares.
- **The pull's MAC.** The answer's header and its tags are covered by a MAC under the
  connection's own key (``session_key``: from the deployment secret and both handshake
  nonces) and a count of the pulls served on the connection before it (``PullMac``): no answer
  can be replayed in place of another, on this connection or another.

A flipped bit anywhere in the blocks, blocks of another job or another position, or bytes a
third party put on the connection, are then a failed pull (the decode engine recomputes the
prompt; it caches nothing of a failed load).

The MAC is GMAC: AES-256-GCM (``cryptography``) with the MAC's input as additional data only,
nothing encrypted, the tag as the MAC (NIST SP 800-38D); about 20 GB/s per core with VAES and
VPCLMULQDQ, where Poly1305 made about 12. GCM fails only if one key and nonce authenticate two
different messages (the two tags then give away the hash key, and with it forgeries); none
does here: a block tag's key is its job's (no two jobs share a name) and its nonce the block's
position, whose bytes stay pinned while the job lives (two pulls of it tag the same bytes);
a pull's MAC has a one-time key, derived from the connection's key with keyed BLAKE3 (vLLM
depends on ``blake3``) over the pull's counter, so its nonce can be fixed (zero). Without
``cryptography``, keyed BLAKE3 itself is the MAC (~4 GB/s per core). Which one is in the KV
compatibility description (``ALGORITHM``), so two workers that would disagree never pair.
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

    def _gcm(key: bytes, nonce: bytes) -> Any:
        return Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()

except ImportError:  # pragma: no cover - installed with LMCache's dependencies
    _gcm = None

ALGORITHM = (
    "aes256-gmac-blocks" if _gcm is not None else "blake3" if _blake3 is not None else "blake2b"
)
MAC_BYTES = 16 if _gcm is not None else 32
_LABEL = b"pdserve-kv-pull\0"
# The pull MAC's GCM nonce: fixed, as each key is used for one pull only (module docstring).
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


class _Mac:
    """GMAC under ``key`` and ``nonce`` (keyed BLAKE3 over the nonce first, without
    ``cryptography``); ``update`` takes the bytes, in order."""

    update: Callable[[bytes | memoryview], None]

    def __init__(self, key: bytes, nonce: bytes) -> None:
        if _gcm is not None:
            self.h = _gcm(key, nonce)
            self.update = self.h.authenticate_additional_data
        else:
            self.h = _keyed(key)
            self.update = self.h.update
            self.update(nonce)

    def digest(self) -> bytes:
        if _gcm is not None:
            self.h.finalize()
            return bytes(self.h.tag)
        return bytes(self.h.digest())


class PullMac(_Mac):
    """The MAC of one pull's answer, under a one-time key: pull counter, header, then the
    pull's block tags (``update``)."""

    def __init__(self, key: bytes, counter: int, header: bytes) -> None:
        prefix = _LABEL + counter.to_bytes(8, "big") + len(header).to_bytes(8, "big")
        one_time = _keyed(key)
        one_time.update(prefix)
        super().__init__(one_time.digest(), _NONCE)
        self.update(prefix)
        self.update(header)


def job_key(secret: bytes | None, name: str) -> bytes:
    """The key of the job the producer named ``name``: from the deployment secret (without
    one, tags still catch corruption, not forgery)."""
    return hmac.digest(secret or b"pdserve-kv-open", b"pdserve-kv-job\0" + name.encode(), "sha256")


class BlockTags:
    """The tags of ``count`` consecutive blocks of a job, from its block ``first`` on; the
    bytes come in wire order: layer by layer, each layer's part of every block in turn
    (``kv_transfer.layout``), ``layer_bytes`` being a block's bytes in each layer."""

    def __init__(self, key: bytes, first: int, count: int, layer_bytes: Sequence[int]) -> None:
        self.macs = [_Mac(key, (first + j).to_bytes(12, "big")) for j in range(count)]
        self.segments = [(mac.update, size) for size in layer_bytes if size for mac in self.macs]

    def tracker(self, views: Sequence[memoryview]) -> Tracker:
        return Tracker(views, self.segments)

    def tags(self) -> bytes:
        """The tags, in block order (call once all bytes are in)."""
        return b"".join(mac.digest() for mac in self.macs)


def tag_blocks(
    key: bytes, views: Sequence[memoryview], count: int, layer_bytes: Sequence[int]
) -> bytes:
    """All tags of a job of ``count`` blocks whose bytes are ``views`` (wire order)."""
    tags = BlockTags(key, 0, count, layer_bytes)
    tags.tracker(views).advance(sum(len(v) for v in views))
    return tags.tags()


class Tracker:
    """Feeds the bytes of the views, in order and as far as the socket has sent or filled
    them, to the MAC of each segment in turn (``segments``: its update and its length):
    hashing runs between socket calls, while the kernel moves the next bytes (the peer keeps
    sending into the socket buffers meanwhile); no thread, no extra copy.

    The views are cut at segment and view boundaries once, up front, into pieces (a MAC's
    update and its slice of one view); ``advance`` then hashes every piece the bytes so far
    cover whole, in one short loop: a piece not yet whole waits for the next call (at most
    one segment behind), so no piece is cut at a socket call's end and the loop does no
    arithmetic per piece. Its per-piece work was a third of the pass over a 64 MB pull.
    """

    def __init__(
        self,
        views: Sequence[memoryview],
        segments: Sequence[tuple[Callable[[bytes | memoryview], None], int]],
    ) -> None:
        self.updates: list[Callable[[bytes | memoryview], None]] = []
        self.pieces: list[memoryview] = []
        self.ends: list[int] = []  # the piece's end in the views' concatenation
        done = 0
        pending = iter([segment for segment in segments if segment[1]])
        update, left = next(pending, (None, 0))
        for view in views:
            offset = 0
            while offset < len(view) and update is not None:
                n = min(len(view) - offset, left)
                self.updates.append(update)
                self.pieces.append(view[offset : offset + n])
                done += n
                self.ends.append(done)
                offset += n
                left -= n
                if not left:
                    update, left = next(pending, (None, 0))
        self.next = 0  # the first piece not hashed yet

    def advance(self, total: int) -> None:
        """Hash every piece that the first ``total`` bytes of the views cover whole."""
        i, ends, updates, pieces = self.next, self.ends, self.updates, self.pieces
        last = len(ends)
        while i < last and ends[i] <= total:
            updates[i](pieces[i])
            i += 1
        self.next = i


def check(expected: bytes, received: bytes) -> None:
    if not hmac.compare_digest(expected, received):
        raise IntegrityError(
            "the KV blocks received do not match the MAC the prefill worker sent (corrupted or "
            "altered on the way); the pull fails and nothing of it is used"
        )
