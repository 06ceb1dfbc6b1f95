"""Every pdserve setting that compose, the Kubernetes manifests, the Dockerfiles or the deployment
docs name exists in the settings classes: a misspelt or not-yet-existing variable would be
ignored silently by pydantic-settings, so this is the only place it can be caught."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.support import (
    DEPLOY,
    DOCKERFILES,
    KUSTOMIZATIONS,
    KV_TIER_COMPOSE_FILE,
    PROCESS_ENV,
    ROLE_SETTINGS,
    ROOT,
    compose_config,
    dockerfile_env,
    env_prefix,
    flag_problem,
    kustomize,
    setting_problem,
    workloads,
)

DOCS = ROOT / "docs" / "deploy.md"
# Every guide that names deployment settings or `pdserve <command> --flag`s.
GUIDES = [DOCS, ROOT / "docs" / "kv-tier.md"]
VARIABLE = re.compile(r"\bPDSERVE_[A-Z0-9_]*[A-Z0-9]\b")
PREFIXES = {env_prefix(cls) for cls in ROLE_SETTINGS.values()}


def pdserve_names(names: Any) -> set[str]:
    return {n for n in names if str(n).startswith("PDSERVE_")}


def flags(argv: list[str]) -> Iterator[tuple[str, str]]:
    """(command, --flag) of a pdserve argument list such as ["prefill", "--port", "1"]."""
    if argv and argv[0] in ROLE_SETTINGS:
        for arg in argv[1:]:
            if arg.startswith("--"):
                yield argv[0], arg


def compose_names() -> tuple[set[str], list[tuple[str, str]]]:
    names: set[str] = set()
    found_flags: list[tuple[str, str]] = []
    for args in ((), ("-f", str(KV_TIER_COMPOSE_FILE))):
        for service in compose_config(*args)["services"].values():
            names |= pdserve_names(service.get("environment", {}))
            found_flags += flags([str(a) for a in service.get("command", [])])
    return names, found_flags


def kubernetes_names() -> tuple[set[str], list[tuple[str, str]]]:
    names: set[str] = set()
    found_flags: list[tuple[str, str]] = []
    for path in KUSTOMIZATIONS:
        docs = kustomize(path)
        for doc in docs:
            if doc["kind"] == "ConfigMap":
                names |= pdserve_names(doc.get("data", {}))
        for w in workloads(docs):
            for c in w["spec"]["template"]["spec"]["containers"]:
                names |= pdserve_names(e["name"] for e in c.get("env", []))
                found_flags += flags([*c.get("command", [])[1:], *c.get("args", [])])
    return names, found_flags


def text_names() -> dict[str, set[str]]:
    """PDSERVE_* words in the guides and in every text file under deploy/, by file."""
    files = [*GUIDES, *(p for p in DEPLOY.rglob("*") if p.is_file())]
    found: dict[str, set[str]] = {}
    for path in files:
        words = set(VARIABLE.findall(path.read_text()))
        # "PDSERVE_PREFILL_*" names the prefix, not a variable.
        words = {w for w in words if w + "_" not in PREFIXES}
        if words:
            found[str(path.relative_to(ROOT))] = words
    return found


def problems_of(names: set[str]) -> list[str]:
    return sorted(p for p in map(setting_problem, names) if p)


def test_the_lookup_itself() -> None:
    assert setting_problem("PDSERVE_GATEWAY_HTTP_PORT") is None
    assert setting_problem("PDSERVE_PREFILL_KV_PORT") is None
    assert setting_problem("PDSERVE_DECODE_ADVERTISE_HOST") is None
    assert setting_problem("PDSERVE_CACHE_DIR") is None
    assert setting_problem("PDSERVE_DECODE_KV_PROT") is not None
    assert setting_problem("PDSERVE_ROUTER_PORT") is not None
    assert flag_problem("prefill", "--kv-port=1") is None
    assert flag_problem("gateway", "--kv-port") is not None
    assert set(PROCESS_ENV) == {
        "PDSERVE_CACHE_DIR", "PDSERVE_SECRET_FILE", "PDSERVE_TLS_DIR",
        "PDSERVE_KV_TIER_REMOTE_URL",
    }  # fmt: skip


def test_compose_settings_exist() -> None:
    names, found_flags = compose_names()
    assert len(names) > 20, "compose names the services' settings"
    problems = problems_of(names) + [p for p in (flag_problem(*f) for f in found_flags) if p]
    assert not problems, "\n".join(problems)


def test_kubernetes_settings_exist() -> None:
    names, found_flags = kubernetes_names()
    assert len(names) > 15
    problems = problems_of(names) + [p for p in (flag_problem(*f) for f in found_flags) if p]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_dockerfile_settings_exist(kind: str) -> None:
    names = pdserve_names(dockerfile_env(DOCKERFILES[kind]))
    assert names == {"PDSERVE_CACHE_DIR"}
    assert not problems_of(names)


def test_documented_settings_exist() -> None:
    found = text_names()
    assert {"docs/deploy.md", "docs/kv-tier.md"} <= set(found), "the guides name the settings"
    problems = [f"{path}: {p}" for path, names in found.items() for p in problems_of(names)]
    assert not problems, "\n".join(problems)


def test_documented_flags_exist() -> None:
    """`pdserve <command> --flag` written in the guides."""
    command = re.compile(r"pdserve (gateway|prefill|decode|up)\b([^`\n]*)")
    problems = []
    text = "\n".join(Path(guide).read_text() for guide in GUIDES)
    for role, rest in command.findall(text):
        for flag in re.findall(r"(?<!\S)--[a-z][a-z0-9-]*", rest):
            problem = flag_problem(role, flag)
            if problem and flag != "--help":
                problems.append(problem)
    assert not problems, "\n".join(problems)
