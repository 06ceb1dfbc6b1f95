"""``pdserve prefill``: a prefill worker (vLLM engine in the kv_producer role)."""

from __future__ import annotations

import argparse
import asyncio
import sys

from pdserve import log
from pdserve.settings import cli_args, from_args
from prefill_service.config import PrefillSettings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli_args(parser, PrefillSettings)


def run(args: argparse.Namespace) -> int:
    from pdserve.worker.server import serve
    from prefill_service.server import SERVICE_NAME, PrefillServicer, register
    from prefill_service.service import PrefillService

    settings = from_args(PrefillSettings, args)
    log.setup(settings.name, settings.log_level)
    servicer = PrefillServicer()
    return asyncio.run(serve(settings, servicer, register(servicer), SERVICE_NAME, PrefillService))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="pdserve prefill")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
