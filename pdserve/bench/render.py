"""What rendering a request costs: vLLM's own front end (its render server's ``ServingRender``)
against the gateway's own path, in one process, in the same run.

Both turn the same OpenAI request body into token ids and sampling parameters: vLLM's request
model and ``render_chat_request`` / ``render_completion_request`` (chat template, tools,
truncation, generation-config defaults, ``max_tokens``) built as ``vllm launch render`` builds
them, without an engine; the gateway's request model, chat template and tokenizer
(``gateway.openai_models``, ``gateway.tokenizer``). Rounds alternate between the two. The
report gives CPU milliseconds per request for each, their ratio, whether the token ids agree,
and what vLLM's front end costs to start (seconds, resident memory), with the machine's CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.vllm_front_end import front_end
from pdserve.placement import machine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=200, help="requests per round and arm")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the two arms")
    parser.add_argument("--prompt-words", type=int, default=400, help="words of the prompt")
    parser.add_argument("--model", default="", help="model directory (default: the default)")
    parser.add_argument("--json", default="", help="also write the results to this file")


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def vllm_render(model_dir: str, engine_args: list[str]) -> Any:
    """vLLM's ``ServingRender`` for ``model_dir``, built as ``vllm launch render`` builds it."""
    return front_end(model_dir, engine_args).serving_render


def bodies(model: str, words: int) -> dict[str, dict[str, Any]]:
    text = " ".join(f"word{i}" for i in range(words))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    return {
        "chat": {"model": model, "messages": chat, "max_tokens": 32, "temperature": 0.7},
        "completion": {"model": model, "prompt": text, "max_tokens": 32, "temperature": 0.7},
    }


def arms(model_dir: str, render: Any) -> dict[str, dict[str, Callable[[dict[str, Any]], Any]]]:
    """kind -> arm -> an async function from a body to its token ids."""
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionRequest as VllmChat,
    )
    from vllm.entrypoints.openai.completion.protocol import (
        CompletionRequest as VllmCompletion,
    )

    from gateway.openai_models import ChatCompletionRequest, CompletionRequest
    from gateway.tokenizer import HfTokenizer

    tokenizer = HfTokenizer(model_dir)

    async def vllm_chat(body: dict[str, Any]) -> list[int]:
        rendered = await render.render_chat_request(VllmChat.model_validate(body))
        return list(rendered.token_ids)

    async def vllm_completion(body: dict[str, Any]) -> list[int]:
        rendered = await render.render_completion_request(VllmCompletion.model_validate(body))
        return list(rendered[0].token_ids)

    async def gateway_chat(body: dict[str, Any]) -> list[int]:
        request = ChatCompletionRequest.model_validate(body)
        request.sampling_params()
        prompt = request.to_prompt()
        messages = [dict(m) for m in prompt.messages or ()]
        return tokenizer.encode_chat(messages, options=prompt.chat)

    async def gateway_completion(body: dict[str, Any]) -> list[int]:
        request = CompletionRequest.model_validate(body)
        request.sampling_params()
        prompt = request.prompts()[0]
        return tokenizer.encode_text(prompt.text or "", prompt.add_special_tokens)

    return {
        "chat": {"vllm": vllm_chat, "gateway": gateway_chat},
        "completion": {"vllm": vllm_completion, "gateway": gateway_completion},
    }


def cpu_ms(fn: Callable[[dict[str, Any]], Awaitable[Any]], body: dict[str, Any], n: int) -> float:
    async def loop() -> None:
        for _ in range(n):
            await fn(body)

    started = time.process_time()
    asyncio.run(loop())
    return (time.process_time() - started) / n * 1000


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from pdserve.model import resolve_model

    model_dir = args.model or resolve_model(None)
    before = _rss_mib()
    started = time.perf_counter()
    render = vllm_render(model_dir, ["--dtype", "float32"])
    start_s = time.perf_counter() - started
    grown = _rss_mib() - before
    work = bodies(model_dir, args.prompt_words)
    functions = arms(model_dir, render)
    results: dict[str, Any] = {}
    for kind, by_arm in functions.items():
        body = work[kind]
        ids = {arm: asyncio.run(fn(body)) for arm, fn in by_arm.items()}
        times: dict[str, list[float]] = {arm: [] for arm in by_arm}
        for _ in range(args.rounds):
            for arm, fn in by_arm.items():
                cpu_ms(fn, body, 5)  # warm
                times[arm].append(cpu_ms(fn, body, args.requests))
        vllm, gateway = (statistics.median(times[a]) for a in ("vllm", "gateway"))
        results[kind] = {
            "prompt_tokens": len(ids["gateway"]),
            "same_token_ids": ids["vllm"] == ids["gateway"],
            "cpu_ms_per_request": {a: round(statistics.median(t), 3) for a, t in times.items()},
            "rounds": {a: [round(x, 3) for x in t] for a, t in times.items()},
            "vllm_over_gateway": round(vllm / gateway, 2),
        }
    report = {
        "machine": machine.describe(machine.cpu_info()),
        "vllm_front_end_start_s": round(start_s, 1),
        "vllm_front_end_rss_mib": round(grown),
        "results": results,
    }
    print(f"machine: {report['machine']}")
    print(f"vLLM's front end: start {start_s:.1f} s, resident memory +{grown:.0f} MiB")
    for kind, r in results.items():
        ms = r["cpu_ms_per_request"]
        print(
            f"{kind:10s} {r['prompt_tokens']} prompt tokens, same ids: {r['same_token_ids']}; "
            f"CPU ms/request vLLM {ms['vllm']:.3f}, gateway {ms['gateway']:.3f}, "
            f"ratio x{r['vllm_over_gateway']:.2f}"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    return 0
