"""What a worker's KV compatibility description says about its vLLM build and its weights."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kv_transfer import compat
from kv_transfer.errors import IncompatibleWorkers
from pdserve import model as pdmodel


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(cache))
    return cache


def fake_config() -> Any:
    import torch

    model = SimpleNamespace(
        hf_config=SimpleNamespace(model_type="llama", num_hidden_layers=30),
        model="org/model",
        revision="abc",
        quantization=None,
        dtype=torch.bfloat16,
        get_num_layers=lambda parallel: 30,
        get_num_kv_heads=lambda parallel: 3,
        get_head_size=lambda: 64,
    )
    return SimpleNamespace(
        model_config=model,
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        cache_config=SimpleNamespace(block_size=128, cache_dtype="auto", kv_cache_layout=None),
        kv_transfer_config=None,
    )


def test_compat_differs_when_the_vllm_version_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm

    ours = compat.describe(fake_config())
    assert ours["vllm"].endswith(f" {vllm.__version__}") and ours["cpu_kernels"] != ""
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    upgraded = compat.describe(fake_config())
    assert upgraded["vllm"] != ours["vllm"]
    with pytest.raises(IncompatibleWorkers, match="vllm: ours="):
        compat.check(ours, upgraded, who="decode worker")


def _model(root: Path, weights: bytes) -> Path:
    root.mkdir()
    (root / "config.json").write_text('{"hidden_size": 8}')
    (root / "model.safetensors").write_bytes(weights)
    (root / "README.md").write_text("not part of the weights")
    return root


def test_weights_that_differ_between_the_old_samples_are_told_apart(tmp_path: Path) -> None:
    """The old identity read 16 x 64 KiB per file; a change at byte 100,000 of a 3 MB file fell
    between those chunks and two different checkpoints paired."""
    weights = bytearray(b"\1" * 3_000_000)
    base = _model(tmp_path / "base", bytes(weights))
    weights[100_000] ^= 0xFF
    tuned = _model(tmp_path / "tuned", bytes(weights))
    assert compat.weights_identity(str(base)) != compat.weights_identity(str(tuned))


def test_a_prepared_model_is_identified_by_the_digest_prepare_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prepared = _model(tmp_path / "prepared", b"\2" * 100_000)
    manifest = pdmodel.write_manifest(prepared, {"test": "1"})
    plain = _model(tmp_path / "plain", b"\2" * 100_000)  # same weights, no manifest
    expected = compat.weights_identity(str(plain))

    def no_hashing(path: Path) -> str:
        raise AssertionError(f"{path} hashed again")

    monkeypatch.setattr(compat, "_sha256_file", no_hashing)
    assert compat.weights_identity(str(prepared)) == manifest["weights_digest"] == expected
    (plain / "README.md").write_text("changed; not a weight file")
    assert compat.weights_identity(str(plain)) == expected  # from the cache, nothing hashed


def test_a_model_without_a_digest_is_hashed_once_and_again_when_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _model(tmp_path / "m", b"\3" * 100_000)
    hashed: list[str] = []
    real = compat._sha256_file

    def counting(path: Path) -> str:
        hashed.append(path.name)
        return real(path)

    monkeypatch.setattr(compat, "_sha256_file", counting)
    first = compat.weights_identity(str(root))
    assert sorted(hashed) == ["config.json", "model.safetensors"]
    assert compat.weights_identity(str(root)) == first and len(hashed) == 2
    (root / "model.safetensors").write_bytes(b"\4" * 100_000)  # same size, new bytes
    assert compat.weights_identity(str(root)) != first
    assert hashed[2:] == ["model.safetensors"]
