"""``pdserve chat``: an interactive chat (or one ``--message``) over the gateway's gRPC API,
the assistant's replies streamed to the terminal. An empty line or EOF ends the session."""

from __future__ import annotations

import argparse
import asyncio
import sys

from pdserve.cli.generate import add_common, report, stream_to_terminal


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--system", default=None, help="system prompt")
    parser.add_argument(
        "--message", "-m", default=None, help="one user message: answer it and exit"
    )
    add_common(parser)


async def _session(args: argparse.Namespace) -> None:
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = args.message is None
    while True:
        if interactive:
            try:
                line = input("> ")
            except EOFError:
                return
            if not line.strip():
                return
        else:
            line = args.message
        messages.append({"role": "user", "content": line})
        reply = await stream_to_terminal(args, messages=messages)
        messages.append({"role": "assistant", "content": reply})
        if not interactive:
            return


def run(args: argparse.Namespace) -> int:
    from pdserve.cli.client import GatewayCallError

    try:
        asyncio.run(_session(args))
    except GatewayCallError as err:
        return report(err, args.target)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return 0
