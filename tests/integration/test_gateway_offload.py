"""Tokenization off the event loop with the real tokenizer: the loop keeps running while a
long prompt encodes, and threads sharing one tokenizer get exactly the inline ids."""

from __future__ import annotations

import asyncio

from gateway.offload import Offload
from tests.helpers import tokenizer

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


async def test_the_loop_runs_while_a_long_prompt_encodes() -> None:
    offload = Offload(1)
    text = "The quick brown fox jumps over the lazy dog. " * 20_000
    ticks, done = 0, False

    async def ticker() -> None:
        nonlocal ticks
        while not done:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    try:
        ids = await offload.run(tokenizer().encode_text, text)
    finally:
        done = True
        await task
        offload.close()
    assert len(ids) > 100_000
    assert ticks > 1  # other coroutines ran before the encoding finished


async def test_threads_share_one_tokenizer_without_errors() -> None:
    tok = tokenizer()
    texts = [f"Entry {k}: item {k * 7} costs {k % 97} coins. " * 50 for k in range(64)]
    ids = [tok.encode_text(t) for t in texts]
    offload = Offload(8)
    try:
        got = await asyncio.gather(
            *(offload.run(tok.encode_text, t) for t in texts),
            *(offload.run(tok.decode, i) for i in ids),
        )
    finally:
        offload.close()
    assert got == ids + [tok.decode(i) for i in ids]
