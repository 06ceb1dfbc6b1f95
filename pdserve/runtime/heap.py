"""The garbage collector of a long-running pdserve process.

A gateway or worker builds most of its objects while it starts (modules, the tokenizer, the
model config, pydantic and protobuf classes: some 130k in the gateway; vLLM's engine front end
in a worker, with torch, some 630k) and keeps them for good.
Python's full collections walk every one of them each time, and how often they come depends on
how many objects survive the younger generations; a busy gateway (spans kept until they are
exported, streams, queues) makes them come often. ``freeze_startup_objects`` moves what is alive
once the process has started into the collector's permanent generation, which collections
no longer walk; objects made afterwards are collected as before.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_objects() -> int:
    """Collect the start-up garbage, then exempt every object still alive from later
    collections; the number of objects frozen (all frozen so far)."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("garbage collector: %d start-up objects frozen", frozen)
    return frozen
