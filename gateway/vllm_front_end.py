"""vLLM's own front end in the gateway's process, built as ``vllm launch render`` builds it: a
GPU-less pre- and post-processing server (vLLM's renderer, derenderer, tokenization and model
registry over the model's ``ModelConfig``), with no engine.

Building it imports torch (seconds, about 700 MiB), so the gateway builds it once per process,
in a thread, while it starts (``gateway.render.shared_renderer``). It renders every OpenAI
request (``gateway.render``) and answers ``/tokenize``, ``/detokenize`` and
``GET /tokenizer_info`` (``gateway.tokenizer_info``).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from typing import Any


def front_end(model_dir: str, args: Sequence[str] = ()) -> Any:
    """The app state of vLLM's render server for ``model_dir`` (``serving_render``,
    ``serving_tokenization``, ...); ``args``: more of vLLM's command-line flags."""
    from starlette.datastructures import State
    from vllm import AsyncEngineArgs
    from vllm.config import VllmConfig
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.entrypoints.launchers.render.app_state import init_render_app_state
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(exit_on_error=False))
    try:
        parsed = parser.parse_args(["--model", model_dir, *args])
    except (argparse.ArgumentError, SystemExit) as err:  # an unknown parser name, ...
        raise ValueError(f"vLLM's front end refuses the flags {' '.join(args)}: {err}") from err
    engine = AsyncEngineArgs.from_cli_args(parsed)
    config = VllmConfig(
        model_config=engine.create_model_config(),
        logging_config=engine.create_logging_config(),
        structured_outputs_config=engine.create_structured_outputs_config(),
    )
    state = State()
    try:
        asyncio.run(init_render_app_state(config, state, parsed))
    except (KeyError, TypeError) as err:  # a parser name vLLM does not know, ...
        raise ValueError(f"vLLM's front end cannot start with {' '.join(args)}: {err}") from err
    return state
