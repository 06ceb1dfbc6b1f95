"""``pdserve model lora``: a small LoRA adapter for the default model, made here, without a hub.

The adapter is written by the ``peft`` package in PEFT's format (``adapter_config.json`` and
``adapter_model.safetensors``), which vLLM's ``--lora-modules`` and pdserve's workers load: rank
8 on the attention projections of every layer, its weights drawn from a seeded generator
(PEFT's ``init_lora_weights=False``: both matrices random, so the adapter changes the model's
answers from the first token, where a trained adapter's would). The same seed writes the same
weights. Like ``prepare``, it is built next to its destination and renamed into place, and a
directory already holding an adapter is kept (``--force`` rebuilds it).

``--merged`` writes a whole model instead: the base model with the adapter's weights added in
(PEFT's ``merge_and_unload``), in the base model's dtype, with its tokenizer and generation
config: a second base model with answers of its own (``pdserve up --extra-models``).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdserve.settings import default_model_dir

RANK = 8
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
CONFIG = "adapter_config.json"
MODEL_CONFIG = "config.json"
# A merged model takes its base's other files (tokenizer, chat template, sampling defaults):
# not these (save_pretrained writes its own weights and config; the manifest describes the
# base's weights).
NOT_COPIED = (
    "*.safetensors", "*.bin", "*.safetensors.index.json", MODEL_CONFIG, "pdserve-manifest.json"
)  # fmt: skip


def default_adapter_dir() -> Path:
    """Beside the default model: ``<model dir>-lora``."""
    model = default_model_dir().expanduser().absolute()
    return model.with_name(model.name + "-lora")


def write_adapter(
    model_dir: str,
    dest: Path | None = None,
    *,
    seed: int = 0,
    force: bool = False,
    merged: bool = False,
    say: Callable[[str], None] = print,
) -> Path:
    """The adapter directory for ``model_dir`` (made unless it exists; ``force``: remade);
    ``merged``: a whole model, the base with the adapter merged in."""
    default = default_adapter_dir()
    dest = (dest or default.with_name(default.name + ("-merged" if merged else ""))).expanduser()
    dest = dest.absolute()
    if (dest / (MODEL_CONFIG if merged else CONFIG)).is_file() and not force:
        say(f"pdserve model lora: {dest} holds {'a model' if merged else 'an adapter'} already")
        return dest
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    what = "model merged with a" if merged else "adapter of"
    say(f"pdserve model lora: writing a rank-{RANK} {what} {model_dir} (seed {seed})")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(
        r=RANK,
        lora_alpha=2 * RANK,
        target_modules=list(TARGETS),
        lora_dropout=0.0,
        init_lora_weights=False,
    )
    adapted = get_peft_model(model, config)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        if merged:
            _save_merged(adapted, model_dir, tmp)
        else:
            adapted.save_pretrained(str(tmp))
        for file in tmp.iterdir():
            file.chmod(0o644)
        tmp.chmod(0o755)
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"pdserve model lora: {dest}")
    return dest


def _save_merged(adapted: Any, model_dir: str, dest: Path) -> None:
    """The adapter merged into its base, in the base's dtype, beside the base's other files."""
    import torch

    base = json.loads((Path(model_dir) / MODEL_CONFIG).read_text())
    dtype = getattr(torch, str(base.get("torch_dtype") or base.get("dtype") or "float32"))
    adapted.merge_and_unload().to(dtype).save_pretrained(str(dest))
    for file in Path(model_dir).iterdir():
        if file.is_file() and not any(file.match(pattern) for pattern in NOT_COPIED):
            shutil.copyfile(file, dest / file.name)
