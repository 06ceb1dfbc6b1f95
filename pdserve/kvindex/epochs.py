"""Epochs that order a worker's lives, and the fence rule every index write obeys.

A worker makes a new epoch each time it starts (``new_epoch``). Epochs are fixed-width strings
whose byte order is their age: 20 digits of wall-clock nanoseconds, then 8 random hex digits
so that two lives started in the same nanosecond still differ.

Each holder's entries in the index carry a fence: the epoch of the life that owns them (none
for a holder nobody fenced, such as a shared KV tier the gateways write). The rule, the same
in ``redis_store``'s scripts and in ``memory``:

- a rewrite (``replace_worker``) or clear (``clear_worker``) by ``epoch`` goes through when
  ``epoch`` is not older than the fence (``may_claim``), and the rewrite makes ``epoch`` the
  fence: a later life takes the holder over, an earlier one cannot take it back;
- any other write (``apply``) goes through only when ``epoch`` is the fence (``may_write``):
  events of an older life that land late, after the newer life's rewrite, are dropped.

The empty string is "no epoch": unfenced writers (the gateways' KV tier entries) use it and
keep working as long as no life claimed the holder.
"""

from __future__ import annotations

import time
import uuid

_CLOCK_DIGITS = 20


def new_epoch(after: str = "") -> str:
    """A new epoch, later than ``after`` (a previous life's, e.g. from the registry) even if
    this machine's clock is behind the one that made it."""
    now = time.time_ns()
    head = after[:_CLOCK_DIGITS]
    if len(head) == _CLOCK_DIGITS and head.isdigit():
        now = max(now, int(head) + 1)
    return f"{now:0{_CLOCK_DIGITS}d}-{uuid.uuid4().hex[:8]}"


def may_claim(epoch: str, fence: str) -> bool:
    """May a rewrite or clear by ``epoch`` take the holder whose fence is ``fence``?"""
    return epoch >= fence


def may_write(epoch: str, fence: str) -> bool:
    """May an event step of ``epoch`` change the entries fenced by ``fence``?"""
    return epoch == fence
