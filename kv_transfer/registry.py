"""Which jobs a prefill worker's transfer process has seen, and who may announce them.

Every job is announced twice (``kv_transfer.announce``): by the engine's scheduler over the
KV port, at once, and by the worker process over the control channel one engine step later.
Both copies come from one place, ``ProducerScheduler.request_finished``, which numbers the
jobs of one engine start 1, 2, 3, ... (``seq``) and puts the number in both copies and in the
sealed hand-off. ``SeqWindow`` remembers every number it has seen with bounded memory: the
highest number below which all have been seen (``floor``), and the ones seen above it. The
step path delivers every number, in order, so the floor keeps up; only the announcer runs
ahead of it (by the jobs of about one engine step). A copy whose number was seen is a
duplicate, however many jobs ended meanwhile, and a pull naming a seen number whose job is
gone is for a job that has ended.

The announcer's copies arrive over the KV port, which every holder of the deployment secret
can reach. ``Owner`` tells the worker's own engine apart: the scheduler makes a random key
when it starts and hands it to its workers in the step metadata (a channel inside the
engine's processes); each worker gives it to its transfer process, and the scheduler's
announcer signs every copy with it (``serve_mac``). A copy over the KV port that is not
signed with that key (or comes before the key did) is never registered.
"""

from __future__ import annotations

import json

from kv_transfer.auth import mac, same

# Numbers seen above the floor, at most (the announcer's lead over the step path).
MAX_AHEAD = 1 << 16


class SeqWindow:
    """The job numbers seen, in O(numbers seen above the floor) memory."""

    def __init__(self, max_ahead: int = MAX_AHEAD) -> None:
        self.floor = 0  # every number <= floor has been seen
        self.above: set[int] = set()
        self.max_ahead = max_ahead

    def seen(self, seq: int) -> bool:
        return seq <= self.floor or seq in self.above

    def add(self, seq: int, force: bool = False) -> bool:
        """Record ``seq``; True if it is new. A number more than ``max_ahead`` past the floor
        is refused (False) unless ``force`` (the in-order step path), which then moves the
        floor up to make room: numbers it passes count as seen."""
        if self.seen(seq):
            return False
        if seq > self.floor + self.max_ahead:
            if not force:
                return False
            self.floor = seq - self.max_ahead
            self.above = {s for s in self.above if s > self.floor}
        self.above.add(seq)
        while self.floor + 1 in self.above:
            self.floor += 1
            self.above.discard(self.floor)
        return True


def serve_mac(
    owner_key: str, epoch: str, req: str, seq: int, blocks: list[int], digest: str, key: str
) -> str:
    """The engine's signature on one announced job."""
    text = json.dumps([epoch, req, seq, blocks, digest, key], separators=(",", ":"))
    return mac(owner_key.encode(), "kv-serve", text)


class Owner:
    """The engine this transfer process belongs to: its epoch and announcement key, set once
    by the worker over the control channel."""

    def __init__(self) -> None:
        self.epoch = ""
        self.key = ""

    def set(self, epoch: str, key: str) -> bool:
        """Adopt the engine's identity; False (ignored) if another one was adopted before."""
        if self.key and (epoch, key) != (self.epoch, self.key):
            return False
        self.epoch, self.key = epoch, key
        return True

    def signed(self, message: dict[str, object]) -> bool | None:
        """True if an announcement over the KV port is signed by this engine, False if not,
        None if the engine's key has not arrived yet (the step path registers the job)."""
        if not self.key:
            return None
        if message.get("epoch") != self.epoch:
            return False
        blocks = message.get("blocks")
        seq = message.get("seq")
        if not isinstance(blocks, list) or type(seq) is not int:
            return False
        expected = serve_mac(
            self.key,
            self.epoch,
            str(message.get("req")),
            seq,
            blocks,
            str(message.get("digest") or ""),
            str(message.get("key") or ""),
        )
        return same(message.get("mac"), expected)
