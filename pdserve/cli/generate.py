"""``pdserve generate`` and ``pdserve chat``: stream a generation from the gateway's gRPC API
to the terminal (``pdserve.cli.client``)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

from pdserve.settings import GATEWAY_GRPC_PORT

API_KEY_ENV = "PDSERVE_API_KEY"


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target", default=f"127.0.0.1:{GATEWAY_GRPC_PORT}", help="gateway gRPC host:port"
    )
    parser.add_argument("--model", default="", help="served model name (default: the gateway's)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeat)")
    parser.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds")
    parser.add_argument(
        "--api-key", default=None, help=f"API key (default: ${API_KEY_ENV} when set)"
    )
    parser.add_argument("--usage", action="store_true", help="print token usage at the end")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="prompt text")
    add_common(parser)


def sampling_fields(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop,
    }


async def stream_to_terminal(args: argparse.Namespace, **prompt: Any) -> str:
    """Print the generation as it arrives; returns the text. Raises ``GatewayCallError``."""
    from pdserve.cli.client import GatewayClient

    api_key = args.api_key or os.environ.get(API_KEY_ENV)
    parts: list[str] = []
    async with GatewayClient(args.target, api_key=api_key, timeout_s=args.timeout) as client:
        last = None
        async for piece in client.generate(model=args.model, **prompt, **sampling_fields(args)):
            sys.stdout.write(piece.text)
            sys.stdout.flush()
            parts.append(piece.text)
            last = piece
    sys.stdout.write("\n")
    if args.usage and last is not None and last.usage is not None:
        u = last.usage
        print(
            f"[{last.finish_reason}] prompt {u.prompt_tokens} tokens "
            f"({u.cached_tokens} cached), completion {u.completion_tokens} tokens",
            file=sys.stderr,
        )
    return "".join(parts)


def report(err: Exception, target: str) -> int:
    from pdserve.cli.client import GatewayCallError

    if isinstance(err, GatewayCallError) and err.code == "UNAVAILABLE":
        print(f"pdserve: cannot reach the gateway at {target}: {err.message}", file=sys.stderr)
    else:
        print(f"pdserve: {err}", file=sys.stderr)
    return 1


def run(args: argparse.Namespace) -> int:
    from pdserve.cli.client import GatewayCallError

    try:
        asyncio.run(stream_to_terminal(args, text=args.prompt))
    except GatewayCallError as err:
        return report(err, args.target)
    except KeyboardInterrupt:
        return 130
    return 0
