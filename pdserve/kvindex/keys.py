"""The Redis key layout, in one place.

``{p}`` is the deployment prefix (default ``pdserve``), ``{m}`` the served model name, so
several models can share one Redis. Text in braces inside a key name is a Redis Cluster hash
tag: keys with the same tag live in the same slot, so one script may use them all.

Registry (one tag, ``{p}``: the reap script reads a record and its heartbeat together):

- ``{p}:workers``                      HASH worker id -> WorkerRecord JSON
- ``{p}:alive:{worker}``               STRING epoch, with a TTL refreshed by the heartbeat
- ``{p}:registry``                     STRING the registry's epoch (new after Redis lost its data)

Gateways (``gateway.shared_load``):

- ``{p}:inflight``                     HASH gateway id -> JSON of its requests in flight per
                                       worker, rewritten every ``load_share_interval_s``

Prefix index (one tag per group of holders, ``{p:m:gK}``, ``K = crc32(holder) % GROUPS``):

- ``{p:m:gK}:h:{holder}``              SET of the block hashes the holder holds, each the
                                       8-byte big-endian hash (not its decimal text: smaller)
- ``{p:m:gK}:f:{holder}``              STRING the holder's fence: the epoch of the worker life
                                       that owns the set (``pdserve.kvindex.epochs``)
- ``{p:m:gK}:t:{holder}``              SET of the holder's blocks that begin a prompt (vLLM's
                                       ``BlockStored`` without a parent)
- ``{p:m:gK}:r``                       ZSET (scores 0) of the group's prompt starts: members
                                       "8-byte hash .. holder", so one ZRANGEBYLEX names the
                                       holders of a first block

There is no key per block: a lookup reads which candidates hold the prompt's first block from
their groups' starts, then asks only those holders' sets for the prompt's leading hashes (one
script per group on a cluster, the group's keys its KEYS; one for all on a single server), all
in one pipeline. A holder's set and fence share a slot, so a fenced write is one atomic script;
a model's index spreads over up to ``GROUPS`` slots (and so over a cluster's masters).

A shared KV tier (LMCache) is a holder like a worker, with the id ``tier:<identity>`` (e.g.
``tier:redis:10.0.0.5:6379/1``, the identity its workers report). The gateways write its
entries (``gateway.routing.kv_tier``), unfenced, not the workers; it is in no registry, so no
gateway reaps it.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass

# Hash-tag groups per model: a lookup is one script call per group that has candidates, and
# a model's index spreads over this many cluster slots at most.
GROUPS = 16


def group_of(holder: str) -> int:
    """The group of ``holder``: stable across processes and versions (not Python's hash)."""
    return zlib.crc32(holder.encode()) % GROUPS


@dataclass(frozen=True)
class Keys:
    prefix: str = "pdserve"

    @property
    def workers(self) -> str:
        return f"{{{self.prefix}}}:workers"

    @property
    def registry(self) -> str:
        return f"{{{self.prefix}}}:registry"

    @property
    def inflight(self) -> str:
        return f"{{{self.prefix}}}:inflight"

    def alive(self, worker: str) -> str:
        return f"{{{self.prefix}}}:alive:{worker}"

    def group_tag(self, model: str, group: int) -> str:
        return f"{{{self.prefix}:{model}:g{group}}}"

    def holder_blocks(self, model: str, holder: str) -> str:
        """The set of the hashes of the blocks ``holder`` holds."""
        return _holder_blocks(self.prefix, model, holder)

    def group_starts(self, model: str, group: int) -> str:
        """The group's ZSET of its holders' prompt starts, members "hash .. holder"."""
        return f"{self.group_tag(model, group)}:r"

    def holder_starts(self, model: str, holder: str) -> str:
        """The SET of the first blocks of prompts ``holder`` holds (same slot)."""
        return f"{self.group_tag(model, group_of(holder))}:t:{holder}"

    def fence(self, model: str, holder: str) -> str:
        """The epoch of the life that owns ``holder_blocks`` (same slot)."""
        return f"{self.group_tag(model, group_of(holder))}:f:{holder}"


@functools.lru_cache(maxsize=65536)
def _holder_blocks(prefix: str, model: str, holder: str) -> str:
    # Cached: a lookup names every candidate worker's set, for every request.
    return f"{{{prefix}:{model}:g{group_of(holder)}}}:h:{holder}"
