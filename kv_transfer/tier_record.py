"""An authenticated KV tier chunk: the bytes pdserve stores in a shared tier for one chunk.

A shared tier (Redis, a shared directory, an LMCache server) is storage that other processes
can write. Every chunk a worker stores there is wrapped in a record that carries an HMAC-SHA256
over the chunk's key and everything that follows, made with a key derived from the deployment
secret (``tier_key``)::

    magic (8) | header length (4, big-endian) | header (JSON) | payload | tag (32)
    tag = HMAC(tier key, len(key) || key || magic .. payload)

The header says what the payload is (memory format, shapes, dtypes, payload size); the
payload is the chunk's bytes as LMCache holds them. ``open_record`` checks the tag before it
reads anything else: a record made without the secret, made for another key (a chunk copied
to another prompt's key), or with one byte changed anywhere is refused (``Rejected``), as is
anything that is not a record at all (a chunk stored by LMCache without pdserve). Nothing here
knows LMCache's connectors: ``kv_transfer.tier_integrity`` puts this format under them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.protocol import DTYPE_TO_INT, INT_TO_DTYPE

from kv_transfer.auth import mac

MAGIC = b"PDKVT\x00\x01\x00"  # "pdserve KV tier record", format 1
TAG_BYTES = 32
_LENGTH_BYTES = 4
MAX_HEADER_BYTES = 4096
# Bytes a record adds to its payload, at most.
OVERHEAD = len(MAGIC) + _LENGTH_BYTES + MAX_HEADER_BYTES + TAG_BYTES
# Formats of KV chunks a worker may load from a record (what LMCache's allocator gives KV in).
KV_FORMATS = frozenset(
    {MemoryFormat.KV_2LTD, MemoryFormat.KV_T2D, MemoryFormat.KV_2TD, MemoryFormat.KV_MLA_FMT}
)


class Rejected(ValueError):
    """A stored chunk that this worker must not load; the message says why (no secrets)."""


@dataclass(frozen=True)
class Opened:
    """An authenticated record: what its payload is, and the payload itself."""

    fmt: MemoryFormat
    shapes: list[torch.Size]
    dtypes: list[torch.dtype]
    payload: memoryview


def tier_key(secret: bytes) -> bytes:
    """The MAC key of tier records, derived from the deployment secret (its own purpose
    label, so that it equals no other MAC made with the secret)."""
    return bytes.fromhex(mac(secret, "kv-tier-chunk"))


def _tag(key: bytes, name: str, body: memoryview) -> bytes:
    label = name.encode()
    h = hmac.new(key, digestmod=hashlib.sha256)
    h.update(len(label).to_bytes(8, "big"))
    h.update(label)
    h.update(body)
    return h.digest()


def payload_bytes(shapes: Sequence[torch.Size], dtypes: Sequence[torch.dtype]) -> int:
    return sum(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes, strict=True))


def seal(
    key: bytes,
    name: str,
    payload: memoryview,
    fmt: MemoryFormat,
    shapes: Sequence[torch.Size],
    dtypes: Sequence[torch.dtype],
) -> bytearray:
    """The record of chunk ``name`` (its key as LMCache spells it) holding ``payload``."""
    if fmt not in KV_FORMATS or payload_bytes(shapes, dtypes) != payload.nbytes:
        raise ValueError(f"not a KV chunk: {fmt}, {list(shapes)}, {list(dtypes)}")
    header = json.dumps(
        {
            "fmt": fmt.value,
            "shapes": [list(s) for s in shapes],
            "dtypes": [DTYPE_TO_INT[d] for d in dtypes],
            "n": payload.nbytes,
        },
        separators=(",", ":"),
    ).encode()
    start = len(MAGIC) + _LENGTH_BYTES + len(header)
    record = bytearray(start + payload.nbytes + TAG_BYTES)
    record[: len(MAGIC)] = MAGIC
    record[len(MAGIC) : len(MAGIC) + _LENGTH_BYTES] = len(header).to_bytes(_LENGTH_BYTES, "big")
    record[len(MAGIC) + _LENGTH_BYTES : start] = header
    view = memoryview(record)
    view[start : start + payload.nbytes] = payload
    view[-TAG_BYTES:] = _tag(key, name, view[:-TAG_BYTES])
    return record


def open_record(key: bytes, name: str, data: memoryview) -> Opened:
    """The authenticated contents of the record stored under ``name``; ``Rejected`` if it is
    not a record of this deployment for exactly this key (checked before anything is read)."""
    if data.nbytes < len(MAGIC) + _LENGTH_BYTES + TAG_BYTES or data[: len(MAGIC)] != MAGIC:
        raise Rejected("not an authenticated pdserve tier record")
    if not hmac.compare_digest(_tag(key, name, data[:-TAG_BYTES]), data[-TAG_BYTES:]):
        raise Rejected("authentication failed (written without this deployment's secret, "
                       "for another key, or changed since)")  # fmt: skip
    # Authenticated: a worker of this deployment wrote it. The checks below catch a bug or a
    # version mismatch, never an attacker.
    length = int.from_bytes(data[len(MAGIC) : len(MAGIC) + _LENGTH_BYTES], "big")
    start = len(MAGIC) + _LENGTH_BYTES + length
    try:
        header = json.loads(bytes(data[len(MAGIC) + _LENGTH_BYTES : start]))
        fmt = MemoryFormat(header["fmt"])
        shapes = [torch.Size(s) for s in header["shapes"]]
        dtypes = [INT_TO_DTYPE[d] for d in header["dtypes"]]
        size = int(header["n"])
    except (ValueError, KeyError, TypeError) as exc:
        raise Rejected(f"unreadable record header: {exc}") from exc
    payload = data[start:-TAG_BYTES]
    if (
        length > MAX_HEADER_BYTES
        or fmt not in KV_FORMATS
        or None in dtypes
        or payload.nbytes != size
        or payload_bytes(shapes, dtypes) != size
    ):
        raise Rejected("the record's header does not describe its payload")
    return Opened(fmt, shapes, dtypes, payload)
