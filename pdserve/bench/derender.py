"""What building a chat stream's chunks costs per token: vLLM's own derenderer against the
gateway's answer, in one process, in the same run.

Both turn one answer's tokens into OpenAI's chat stream chunks, token by token:
- ``vllm``: vLLM's ``ServingDerender.derender_chat_stream_response`` (the derenderer behind
  ``vllm launch render``), as a stateless client drives it: each chunk carries the stream's
  state back in, and with a tool-call or reasoning parser the parser replays the whole output
  so far on every chunk (vLLM's ``DerenderStreamState``). It also detokenizes.
- ``gateway``: what the gateway does per streamed token (``gateway.openai_serving``): vLLM's
  parser kept alive for the stream (``gateway.chat_parsing.ChoiceParser``), the chunk's body
  and its SSE line. The text comes detokenized from the decode engine (vLLM's incremental
  detokenizer, in the worker), so it is made before the clock starts.

The report gives CPU microseconds per token for each arm, with and without vLLM's hermes
parser, at each answer length, and their ratio, with the machine's CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
from typing import Any

from pdserve.placement import machine

ANSWER = "The ship sailed over the sea, and the wind carried it home before the storm. "
PARSERS = {"none": [], "hermes": ["--tool-call-parser", "hermes", "--enable-auto-tool-choice"]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", default="64,256", help="answer lengths (tokens), comma list")
    parser.add_argument("--model", default="", help="model directory (default: the default)")
    parser.add_argument("--json", default="", help="also write the results to this file")


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _answer_ids(tokenizer: Any, count: int) -> list[int]:
    ids: list[int] = tokenizer.encode(ANSWER * (count // 8 + 1), add_special_tokens=False)
    return ids[:count]


async def vllm_arm(renderer: Any, chat: Any, prompt: list[int], ids: list[int]) -> float:
    """CPU seconds of vLLM's stream derender over ``ids``, one chunk per token."""
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
        DerenderChatStreamRequest,
        GenerateTokensStreamResponse,
    )

    serving = renderer.state.serving_derender
    state = None
    started = _cpu_s()
    for i, token in enumerate(ids):
        finish = "length" if i == len(ids) - 1 else None
        chunk = GenerateTokensStreamResponse.model_validate(
            {"choices": [{"index": 0, "token_ids": [token], "finish_reason": finish}]}
        )
        request = DerenderChatStreamRequest(
            stream=True,
            generate_chunk=chunk,
            stream_state=state,
            chat_request=chat,
            prompt_token_ids=prompt,
            prompt_tokens=len(prompt),
        )
        answer = await serving.derender_chat_stream_response(request)
        if hasattr(answer, "error"):
            raise RuntimeError(f"vLLM's derenderer refused the stream: {answer.error.message}")
        body, state = answer
        json.dumps(body.model_dump(exclude_none=True))
    return _cpu_s() - started


def gateway_arm(renderer: Any, chat: Any, prompt: list[int], ids: list[int]) -> float:
    """CPU seconds of the gateway's per-token work over ``ids``."""
    from gateway import openai_format as fmt

    texts = [renderer.tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]
    pieces = [t[len(p) :] for p, t in zip(["", *texts], texts, strict=False)]
    shaper = fmt.ChunkShaper("bench", "m", chat=True, include_usage=False)
    parsed = renderer.parsed(chat)
    parser = None if parsed is None else parsed.choice(prompt)
    started = _cpu_s()
    for index, (token, text) in enumerate(zip(ids, pieces, strict=True)):
        delta = None if parser is None else parser.delta(text, [token], finished=False)
        if parser is not None and delta is None:
            continue
        fmt.sse(shaper.delta(0, text, None, [token], None if index else prompt, delta))
    return _cpu_s() - started


def measure(model_dir: str, lengths: list[int]) -> list[dict[str, Any]]:
    from gateway.render import shared_renderer

    rows = []
    for name, flags in PARSERS.items():
        renderer = shared_renderer(model_dir, ["--served-model-name", "m", *flags])
        body = {"messages": [{"role": "user", "content": "Tell me a story."}], "stream": True}
        for count in lengths:
            chat, rendered = asyncio.run(renderer.chat({**body, "max_tokens": count}))
            ids = _answer_ids(renderer.tokenizer, count)
            ours = gateway_arm(renderer, chat, rendered.token_ids, ids)
            theirs = asyncio.run(vllm_arm(renderer, chat, rendered.token_ids, ids))
            rows.append(
                {
                    "parser": name,
                    "tokens": len(ids),
                    "vllm_us_per_token": theirs / len(ids) * 1e6,
                    "gateway_us_per_token": ours / len(ids) * 1e6,
                    "vllm_over_gateway": theirs / ours if ours else None,
                }
            )
    return rows


def run(args: argparse.Namespace) -> int:
    from pdserve.model import resolve_model

    lengths = [int(n) for n in args.tokens.split(",") if n.strip()]
    if not lengths or min(lengths) < 1:
        raise SystemExit("--tokens: a comma list of positive answer lengths")
    rows = measure(args.model or resolve_model(None), lengths)
    cpu = machine.describe(machine.cpu_info())
    print(f"machine: {cpu}")
    print("parser  tokens  vLLM us/token  gateway us/token  vLLM / gateway")
    for row in rows:
        print(
            f"{row['parser']:7s} {row['tokens']:6d} {row['vllm_us_per_token']:14.1f} "
            f"{row['gateway_us_per_token']:17.1f} {row['vllm_over_gateway']:15.2f}"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"machine": cpu, "rows": rows}, out, indent=2)
    return 0
