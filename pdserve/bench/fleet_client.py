"""The client of ``pdserve bench fleet``: multi-turn chats at a fixed rate through the gateways.

Conversations start at Poisson times (rate ``rate / turns``, so requests arrive at about
``rate`` per second); each runs its turns one after another, an exponential think time apart.
A turn's messages are the previous turn's plus its answer and a new question, so its prompt
extends the previous prompt. Turn ``t`` of conversation ``c`` goes to gateway ``(c + t) % M``:
consecutive turns of a conversation go through different gateway replicas, which must agree
(through the shared index) on where its prefix is.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

PREFILL_HEADER = "x-pdserve-prefill-worker"
DECODE_HEADER = "x-pdserve-decode-worker"


@dataclass
class Turn:
    """One request as the client saw it."""

    conversation: int
    turn: int
    gateway: int
    ok: bool = False
    error: str = ""
    prefill: str = ""  # the worker that computed the prompt (the gateway's routing header)
    decode: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0  # what the computing worker's cache served (its own report)
    latency_s: float = 0.0


def system_prompt(c: int, words: int) -> str:
    """Conversation ``c``'s own instructions: about ``words`` words, distinct from the first."""
    facts: list[str] = []
    k = 0
    while len(facts) * 10 < words:
        facts.append(f"Note {k} of case {c}: clause {k * 7 + c} allows {k * 13 % 97} days.")
        k += 1
    return f"You are the clerk of case {c}. " + " ".join(facts)


async def conversation(
    client: Any, gateways: list[str], model: str, c: int, args: Any, rng: random.Random
) -> list[Turn]:
    messages = [{"role": "system", "content": system_prompt(c, args.prompt_words)}]
    turns = []
    for t in range(args.turns):
        if t:
            await asyncio.sleep(rng.expovariate(1 / args.think_s) if args.think_s else 0)
        messages.append({"role": "user", "content": f"Question {t}: what does clause {t} say?"})
        g = (c + t) % len(gateways)
        turn = Turn(c, t, g)
        started = time.monotonic()
        try:
            response = await client.post(
                f"{gateways[g]}/v1/chat/completions",
                json={"model": model, "messages": messages, "max_tokens": args.tokens},
            )
            turn.latency_s = time.monotonic() - started
            if response.status_code != 200:
                turn.error = f"HTTP {response.status_code}: {response.text[:200]}"
            else:
                body = response.json()
                usage = body["usage"]
                turn.ok = True
                turn.prefill = response.headers.get(PREFILL_HEADER, "")
                turn.decode = response.headers.get(DECODE_HEADER, "")
                turn.prompt_tokens = usage["prompt_tokens"]
                turn.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                    "cached_tokens", 0
                )
                messages.append(
                    {"role": "assistant", "content": body["choices"][0]["message"]["content"]}
                )
        except Exception as exc:
            turn.error = f"{type(exc).__name__}: {exc}"
        turns.append(turn)
        if not turn.ok:
            break  # the conversation cannot go on without its answer
    return turns


async def run_load(gateways: list[str], model: str, args: Any) -> tuple[list[Turn], float]:
    """Every turn of every conversation started within ``args.duration`` s, and the wall time
    from the first start to the last answer."""
    import httpx

    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        tasks = []
        started = time.monotonic()
        c = 0
        next_at = 0.0
        while True:
            next_at += rng.expovariate(args.rate / args.turns)
            if next_at >= args.duration:
                break
            await asyncio.sleep(max(0.0, started + next_at - time.monotonic()))
            task_rng = random.Random(rng.getrandbits(32))
            tasks.append(
                asyncio.create_task(conversation(client, gateways, model, c, args, task_rng))
            )
            c += 1
        results = await asyncio.gather(*tasks)
        wall = time.monotonic() - started
    return [t for turns in results for t in turns], wall
