"""A transfer process that skips the block tags' passes over the bytes (``integrity``): the
baseline ``pdserve bench kv`` measures the tags' cost against, in the same run. For the
benchmark only: the benchmark starts it (``python -m kv_transfer.bench_unchecked``), the
connector never does. The pull's MAC over header and tags stays (tags of zeros), as do the
wire and the handshake."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kv_transfer import agent, consumer, producer
from kv_transfer.integrity import MAC_BYTES


class _Untracked:
    def advance(self, total: int) -> None:
        pass


class _UncheckedTags:
    """Stands in for ``integrity.BlockTags``: no pass over the bytes, tags of zeros."""

    def __init__(self, key: bytes, first: int, count: int, layer_bytes: Sequence[int]) -> None:
        self.count = count

    def tracker(self, views: Sequence[memoryview]) -> _Untracked:
        return _Untracked()

    def tags(self) -> bytes:
        return bytes(MAC_BYTES * self.count)


def _zero_tags(
    key: bytes, views: Sequence[memoryview], count: int, layer_bytes: Sequence[int]
) -> bytes:
    return bytes(MAC_BYTES * count)


if __name__ == "__main__":
    consumer.BlockTags = _UncheckedTags  # type: ignore[misc,assignment]
    producer.tag_blocks = _zero_tags
    sys.exit(agent.main())
