"""``pdserve decode``: a decode worker (vLLM engine in the kv_consumer role)."""

from __future__ import annotations

import argparse
import asyncio
import sys

from decode_service.config import DecodeSettings
from pdserve import log
from pdserve.settings import cli_args, from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli_args(parser, DecodeSettings)


def run(args: argparse.Namespace) -> int:
    from decode_service.server import SERVICE_NAME, DecodeServicer, register
    from decode_service.service import DecodeService
    from pdserve.worker.server import serve

    settings = from_args(DecodeSettings, args)
    log.setup(settings.name, settings.log_level)
    servicer = DecodeServicer()
    return asyncio.run(serve(settings, servicer, register(servicer), SERVICE_NAME, DecodeService))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="pdserve decode")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
