"""vLLM's own front end in the gateway's process, built as ``vllm launch render`` builds it: a
GPU-less pre- and post-processing server (vLLM's renderer, derenderer, tokenization and model
registry over the model's ``ModelConfig``), with no engine.

Building it imports torch (seconds, about 700 MiB: ``pdserve bench render``), so the gateway
builds it once, on first use, off the event loop (``gateway.offload.BuiltOnce``). Today it
answers ``GET /tokenizer_info`` (``gateway.tokenizer_info``); ``pdserve bench render``
measures its rendering against the gateway's own.
"""

from __future__ import annotations

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

    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", model_dir, *args])
    engine = AsyncEngineArgs.from_cli_args(parsed)
    config = VllmConfig(
        model_config=engine.create_model_config(),
        logging_config=engine.create_logging_config(),
        structured_outputs_config=engine.create_structured_outputs_config(),
    )
    state = State()
    asyncio.run(init_render_app_state(config, state, parsed))
    return state
