"""Many generations for one client request: OpenAI's ``n`` and lists of prompts.

Each choice is a generation with a request id derived from the client's (``<id>-<index>``; the
bare id when there is one choice). The choices of one prompt share its tokenization, route,
prefill and KV transfer (``GenerationService.start_choices``).
With a ``seed``, choice ``j`` of a prompt samples with ``seed + j`` (as vLLM's parallel sampling
does), so that ``n`` seeded choices differ. Usage counts each prompt once, however many choices
it has, and sums the completions.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace

from gateway.errors import GatewayError
from gateway.events import Event, Usage
from gateway.generation import Generation
from gateway.service import GenerateRequest, GenerationService, Prompt, all_or_none
from protos.v1 import common_pb2


@dataclass(frozen=True)
class ChoiceSpec:
    index: int
    prompt_index: int
    request: GenerateRequest


def choice_specs(
    parent: GenerateRequest,
    prompts: Sequence[Prompt],
    n: int,
    params: Sequence[common_pb2.SamplingParams] | None = None,
) -> list[ChoiceSpec]:
    """``params``: each prompt's own sampling parameters (else the parent's)."""
    total = len(prompts) * n
    specs = []
    for p, prompt in enumerate(prompts):
        prompt_params = parent.params if params is None else params[p]
        for j in range(n):
            index = p * n + j
            choice = prompt_params
            if j and choice.HasField("seed"):
                choice = type(choice)()
                choice.CopyFrom(prompt_params)
                choice.seed = (prompt_params.seed + j) % 2**63
            request_id = parent.request_id if total == 1 else f"{parent.request_id}-{index}"
            request = replace(parent, request_id=request_id, prompt=prompt, params=choice)
            specs.append(ChoiceSpec(index, p, request))
    return specs


async def start_all(service: GenerationService, specs: Sequence[ChoiceSpec]) -> list[Generation]:
    """Start every choice, the choices of each prompt together (``start_choices``: one
    prefill per prompt); if one fails, the others are released and the error raised."""
    groups: dict[int, list[ChoiceSpec]] = {}
    for spec in specs:
        groups.setdefault(spec.prompt_index, []).append(spec)
    started = await all_or_none(
        [service.start_choices([s.request for s in group]) for group in groups.values()],
        release=close_all,
    )
    by_index = {
        s.index: g for group, gens in zip(groups.values(), started, strict=True)
        for s, g in zip(group, gens, strict=True)
    }  # fmt: skip
    return [by_index[s.index] for s in specs]


async def close_all(generations: Sequence[Generation]) -> None:
    for generation in generations:
        await generation.aclose()


async def merged(generations: Sequence[Generation]) -> AsyncIterator[tuple[int, Event]]:
    """The events of all generations as they come, tagged with the generation's position."""
    if len(generations) == 1:
        async for event in generations[0].events():
            yield 0, event
        return
    queue: asyncio.Queue[tuple[int, Event | GatewayError | None]] = asyncio.Queue()

    async def pump(position: int, generation: Generation) -> None:
        try:
            async for event in generation.events():
                await queue.put((position, event))
        except GatewayError as err:
            await queue.put((position, err))
            return
        await queue.put((position, None))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(generations)]
    try:
        remaining = len(tasks)
        while remaining:
            position, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, GatewayError):
                raise item
            else:
                yield position, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close_all(generations)


def total_usage(per_choice: Sequence[tuple[int, Usage]]) -> Usage:
    """``(prompt_index, usage)`` of every choice -> the request's usage."""
    prompts: dict[int, Usage] = {}
    completion = 0
    for prompt_index, usage in per_choice:
        prompts.setdefault(prompt_index, usage)
        completion += usage.completion_tokens
    return Usage(
        prompt_tokens=sum(u.prompt_tokens for u in prompts.values()),
        completion_tokens=completion,
        cached_tokens=sum(u.cached_tokens for u in prompts.values()),
    )
