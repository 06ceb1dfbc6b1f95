"""The model's own sampling defaults, applied as ``vllm serve`` applies them.

vLLM's OpenAI server takes a request's sampling value first, then the model's
``generation_config.json`` (its ``--generation-config``: ``auto``, ``vllm`` for none, or a
directory holding that file), then its own default (``ModelConfig.get_diff_sampling_param``).
The gateway does the same before a request reaches any worker, so both workers see the
values ``vllm serve`` would have used.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from protos.v1 import common_pb2

log = logging.getLogger(__name__)

# The generation-config fields vLLM takes as sampling defaults (``max_new_tokens`` becomes
# ``max_tokens``: the default of a request that names none).
FIELDS = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
)


def load_defaults(source: str, model_dir: str) -> dict[str, Any]:
    """The sampling defaults ``source`` names ("auto": the model's, "vllm": none, else a
    directory with a ``generation_config.json``); a missing file gives none, as in vLLM."""
    if source == "vllm":
        return {}
    path = Path(model_dir if source == "auto" else source) / "generation_config.json"
    if not path.is_file():
        if source != "auto":
            raise ValueError(f"--generation-config {source}: no generation_config.json there")
        return {}
    config = json.loads(path.read_text())
    defaults = {f: config[f] for f in FIELDS if config.get(f) is not None}
    if config.get("max_new_tokens") is not None:
        defaults["max_tokens"] = int(config["max_new_tokens"])
    if defaults:
        log.warning(
            "sampling defaults from %s: %s (as vLLM; --generation-config vllm for none)",
            path,
            defaults,
        )
    return defaults


def with_defaults(
    params: common_pb2.SamplingParams, defaults: dict[str, Any]
) -> common_pb2.SamplingParams:
    """``params`` with every field the request left unset taken from ``defaults``."""
    if not defaults:
        return params
    out = common_pb2.SamplingParams()
    out.CopyFrom(params)
    for name in FIELDS:
        if name in defaults and not params.HasField(name):
            setattr(out, name, defaults[name])
    if "max_tokens" in defaults and not params.max_tokens:
        out.max_tokens = defaults["max_tokens"]
    return out
