"""The ``pdserve prefill`` / ``pdserve decode`` command, shared by both roles.

Each role's ``__main__`` names its settings class and where its servicer and service live;
those modules (which import vLLM) load only when the command runs.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
from dataclasses import dataclass
from typing import Any

from pdserve.settings import cli_args, from_args
from pdserve.telemetry import log, tracing
from pdserve.worker.config import WorkerSettings


def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class WorkerCommand:
    settings: type[WorkerSettings]
    servicer: str  # "module:Class" of the gRPC servicer; the module has SERVICE_NAME, register
    service: str  # "module:Class" of the transport-agnostic core

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        cli_args(parser, self.settings)

    def run(self, args: argparse.Namespace) -> int:
        from pdserve.worker.server import serve

        settings = from_args(self.settings, args)
        log.setup(settings.name, settings.log_level)
        tracing.setup(settings.role, settings.name)
        servicer = _load(self.servicer)()
        server_module = importlib.import_module(self.servicer.partition(":")[0])
        register = server_module.register(servicer)
        service_cls = _load(self.service)
        return asyncio.run(
            serve(settings, servicer, register, server_module.SERVICE_NAME, service_cls)
        )

    def main(self, prog: str) -> int:
        parser = argparse.ArgumentParser(prog=prog)
        self.add_arguments(parser)
        return self.run(parser.parse_args())
