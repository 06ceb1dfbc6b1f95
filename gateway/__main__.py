"""``pdserve gateway``: run the gateway until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from pydantic import ValidationError

from gateway.config import GatewaySettings
from pdserve.placement import front_cores
from pdserve.rpc.server import stop_event_on_signals
from pdserve.rpc.tls import deployment_tls
from pdserve.runtime.heap import freeze_startup_objects
from pdserve.settings import cli_args, from_args
from pdserve.telemetry import log as pdlog
from pdserve.telemetry import tracing

log = logging.getLogger("gateway")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli_args(parser, GatewaySettings)


async def _serve(settings: GatewaySettings) -> int:
    from gateway.server import GatewayServer  # after logging is set up

    front_cores.bind_this_process("gateway")  # before its threads start: they inherit it
    stop = stop_event_on_signals()
    server = GatewayServer(settings)
    try:
        await server.start()
        freeze_startup_objects()  # full collections stop walking them
        await stop.wait()
        log.info("stopping")
    finally:
        await server.stop()
    return 0


def run(args: argparse.Namespace) -> int:
    # The model is a local directory: nothing comes from a model hub. Set before anything
    # imports huggingface_hub (it reads this once), so vLLM's tokenizer says so as vllm serve's
    # does when run offline (local_files_only in /tokenizer_info).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    pdlog.setup("gateway")
    tracing.setup("gateway")
    try:
        settings = from_args(GatewaySettings, args)
    except ValidationError as err:
        print(f"pdserve gateway: invalid settings:\n{err}", file=sys.stderr)
        return 2
    from gateway.routing import plugins, registry  # after logging is set up, as the server

    problem = registry.unknown_picker(settings.picker)
    if problem:
        print(f"pdserve gateway: invalid settings: picker: {problem} "
              f"(built in: {', '.join(plugins.BUILT_IN)})", file=sys.stderr)  # fmt: skip
        return 2
    if not settings.decode_workers:
        log.warning("no decode workers configured (--decode-workers): every request gets 503")
    try:  # the workers' clients read it when first made, perhaps long after start-up
        tls = deployment_tls()
    except ValueError as err:
        log.error("cannot start the gateway: %s", err)
        return 1
    if tls is not None:
        log.info("dialling the workers with mutual TLS (%s)", tls.directory)
    try:
        return asyncio.run(_serve(settings))
    except (OSError, ValueError) as err:  # bind failures, missing model or tokenizer
        log.error("cannot start the gateway: %s", err)
        return 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m gateway")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
