"""A small bounded thread pool for the gateway's per-request CPU work: chat templates,
tokenization, block hashing. It keeps that work off the event loop, so one long prompt does
not stall every other stream's tokens.

What a thread buys (measured, see docs/benchmarks-history.md "Gateway overhead"): the HF fast
tokenizer releases the GIL while it encodes (two threads encode ~1.9x as fast as one, and the
event loop keeps running meanwhile), so encoding in a thread is real parallelism, and encoding
is most of a prompt's cost. Jinja templates and the sha256/CBOR block hashes are Python and
hold the GIL; in a thread they only stop being one uninterrupted stall (the interpreter hands
the GIL back every ``sys.getswitchinterval()``, 5 ms). ``threads=0`` runs everything inline.

Exceptions raised by the work (e.g. ``InvalidRequest`` for a bad chat) reach the awaiting
caller unchanged. A caller cancelled while its work runs stops waiting; the work itself
finishes in its thread (it cannot be interrupted) and its result is dropped.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class Offload:
    """``await offload.run(fn, *args)``: ``fn(*args)`` on one of ``threads`` worker threads.

    Made once per gateway; ``close()`` on shutdown (pending work is dropped, running work
    finishes in the background)."""

    def __init__(self, threads: int, name: str = "gateway-cpu") -> None:
        self.threads = threads
        self._pool = (
            ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name) if threads else None
        )

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        if self._pool is None:
            return fn(*args, **kwargs)
        # The context goes along, as asyncio.to_thread does (log fields, request ids).
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


class BuiltOnce(Generic[T]):
    """``await once.get()``: ``build()``'s result, built on first use in a thread (vLLM's
    front-end modules import torch: seconds that must not stall the event loop), then kept."""

    def __init__(self, build: Callable[[], T]) -> None:
        self._build_fn = build
        self._value: T | None = None
        self._lock = threading.Lock()

    def _build(self) -> T:
        with self._lock:
            if self._value is None:
                self._value = self._build_fn()
            return self._value

    def blocking_get(self) -> T:
        """``build()``'s result, built in the calling thread if it is not yet."""
        return self._build()

    @property
    def built(self) -> bool:
        return self._value is not None

    async def get(self) -> T:
        if self._value is not None:
            return self._value
        return await asyncio.to_thread(self._build)
