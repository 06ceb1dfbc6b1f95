"""The KV tier in the deployments (docs/kv-tier.md): compose's kv-tier.yaml and the Kubernetes
component give every worker the same tier in a Redis of its own that evicts, the index's Redis
never evicts, and the images install LMCache as the Makefile does."""

from __future__ import annotations

import itertools
import re
from typing import Any
from urllib.parse import urlsplit

import pytest

from decode_service.config import DecodeSettings
from pdserve.worker import kv_tier
from pdserve.worker.config import WorkerSettings
from prefill_service.config import PrefillSettings
from tests.deploy.support import (
    COMPOSE_FILE,
    DOCKERFILES,
    KV_TIER_COMPOSE_FILE,
    KV_TIER_OVERLAYS,
    ROOT,
    component,
    compose_config,
    container_env,
    dockerfile_env,
    dockerfile_instructions,
    gib,
    ingress_allowed,
    kustomize,
    labels_match,
    objects,
    pod_spec,
    workloads,
)

WITH_TIER = ("-f", str(KV_TIER_COMPOSE_FILE))
COMPOSE_WORKERS = {"prefill": "prefill", "decode": "decode",
                   "prefill-gpu": "prefill", "decode-gpu": "decode"}  # fmt: skip
SETTINGS: dict[str, type[WorkerSettings]] = {"prefill": PrefillSettings, "decode": DecodeSettings}
REDIS_PORT = 6379


def worker(role: str, env: dict[str, Any]) -> WorkerSettings:
    """The settings a worker builds from ``env`` (its PDSERVE_<ROLE>_* variables)."""
    prefix = f"PDSERVE_{role.upper()}_"
    fields = {k[len(prefix) :].lower(): v for k, v in env.items() if k.startswith(prefix)}
    fields = {k: v for k, v in fields.items() if isinstance(v, str)}  # not the downward API
    return SETTINGS[role](**fields)


def redis_options(args: list[str]) -> dict[str, str]:
    """``--name value`` pairs of a redis-server command line."""
    return {a[2:]: b for a, b in itertools.pairwise(args) if a.startswith("--")}


# ---- docker compose


def services(*args: str) -> dict[str, dict[str, Any]]:
    return dict(compose_config(*args)["services"])


@pytest.mark.parametrize("profile", [(), ("--profile", "gpu")], ids=["default", "gpu"])
def test_the_tier_file_validates_on_top_of_compose(profile: tuple[str, ...]) -> None:
    assert set(services(*WITH_TIER, *profile)) == set(services(*profile)) | {"tier-redis"}


def test_example_env_file_spells_out_the_tier_defaults() -> None:
    example = COMPOSE_FILE.parent / ".env.example"
    assert services(*WITH_TIER, "--env-file", str(example)) == services(*WITH_TIER)


def test_without_the_tier_file_no_worker_has_a_tier() -> None:
    svc = services()
    assert "tier-redis" not in svc
    for name, role in COMPOSE_WORKERS.items():
        assert worker(role, svc[name]["environment"]).kv_tier == "off", name


def test_every_compose_worker_shares_the_tier_redis() -> None:
    svc = services(*WITH_TIER)
    identities = set()
    for name, role in COMPOSE_WORKERS.items():
        s = svc[name]
        settings = worker(role, s["environment"])
        assert settings.kv_tier == "redis", name
        url = urlsplit(kv_tier.tier_url(settings))
        assert (url.hostname, url.port) == ("tier-redis", REDIS_PORT), name
        assert s["depends_on"]["tier-redis"]["condition"] == "service_healthy", name
        assert s["depends_on"]["redis"]["condition"] == "service_healthy", "the index stays"
        index = urlsplit(settings.redis_url)
        assert (index.hostname, index.path) == ("redis", "/0"), "the index stays in `redis`"
        identities.add(kv_tier.identity(settings))
        memory = gib(s["deploy"]["resources"]["limits"]["memory"])
        held = settings.kv_tier_cpu_gib + gib(s.get("shm_size", "0"))
        assert memory > held + 1, f"{name}: the tier's CPU level fits in the memory limit"
    assert identities == {"redis:tier-redis:6379/0"}, "one tier for all"


def test_the_tier_redis_evicts_and_the_index_redis_never_does() -> None:
    svc = services(*WITH_TIER)
    tier = svc["tier-redis"]
    options = redis_options(tier["command"])
    assert options["maxmemory-policy"] == "allkeys-lru"
    assert gib(options["maxmemory"]) < gib(tier["deploy"]["resources"]["limits"]["memory"])
    assert options["save"] == "" and options["appendonly"] == "no"
    assert tier["image"] == svc["redis"]["image"], "one Redis version in the deployment"
    assert tier["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL")
    assert int(str(tier["user"]).split(":")[0]) != 0
    index = redis_options(svc["redis"]["command"])
    assert "maxmemory" not in index and "maxmemory-policy" not in index


# ---- Kubernetes


@pytest.mark.parametrize("path", KV_TIER_OVERLAYS)
def test_the_component_gives_every_worker_the_tier_redis(path: str) -> None:
    docs = kustomize(path)
    identities = set()
    for w in workloads(docs):
        role = component(w)
        if role not in SETTINGS:
            continue
        (c,) = pod_spec(w)["containers"]
        settings = worker(role, container_env(docs, c))
        assert settings.kv_tier == "redis", role
        url = urlsplit(kv_tier.tier_url(settings))
        assert (url.hostname, url.port) == ("tier-redis", REDIS_PORT)
        identities.add(kv_tier.identity(settings))
        memory = gib(c["resources"]["limits"]["memory"])
        shm = next(v for v in pod_spec(w)["volumes"] if v["name"] == "dshm")["emptyDir"]
        held = settings.kv_tier_cpu_gib + gib(shm["sizeLimit"])
        assert memory > held + 1, f"{role}: the tier's CPU level fits in the memory limit"
    assert identities == {"redis:tier-redis:6379/0"}
    service = objects(docs, "Service")["tier-redis"]
    assert [p["port"] for p in service["spec"]["ports"]] == [REDIS_PORT]
    tier = objects(docs, "Deployment")["tier-redis"]
    labels = tier["spec"]["template"]["metadata"]["labels"]
    assert labels_match({"matchLabels": service["spec"]["selector"]}, labels)


@pytest.mark.parametrize("path", KV_TIER_OVERLAYS)
def test_the_tier_redis_evicts_within_its_limit_and_the_index_never(path: str) -> None:
    docs = kustomize(path)
    (c,) = pod_spec(objects(docs, "Deployment")["tier-redis"])["containers"]
    options = redis_options(c["args"])
    assert options["maxmemory-policy"] == "allkeys-lru"
    assert gib(options["maxmemory"]) < gib(c["resources"]["limits"]["memory"])
    assert c["resources"]["requests"]["memory"] == c["resources"]["limits"]["memory"]
    (index,) = pod_spec(objects(docs, "StatefulSet")["redis"])["containers"]
    assert "maxmemory" not in redis_options(index["args"])


@pytest.mark.parametrize("path", KV_TIER_OVERLAYS)
def test_only_workers_reach_the_tier_redis(path: str) -> None:
    docs = kustomize(path)
    policies = list(objects(docs, "NetworkPolicy").values())
    pods = {component(w): w["spec"]["template"]["metadata"]["labels"] for w in workloads(docs)}
    tier = pods["tier-redis"]
    for role in ("prefill", "decode"):
        assert ingress_allowed(policies, pods[role], tier, REDIS_PORT), role
    for other in (pods["gateway"], pods["redis"], {"app": "something-else"}):
        assert not ingress_allowed(policies, other, tier, REDIS_PORT), other


def test_without_the_component_no_worker_has_a_tier() -> None:
    for path in ("overlays/cpu", "overlays/gpu"):
        docs = kustomize(path)
        assert "tier-redis" not in objects(docs, "Deployment")
        for w in workloads(docs):
            if component(w) in SETTINGS:
                (c,) = pod_spec(w)["containers"]
                assert worker(component(w), container_env(docs, c)).kv_tier == "off"


# ---- images


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_images_install_lmcache_as_the_makefile_does(kind: str) -> None:
    steps = dockerfile_instructions(DOCKERFILES[kind])
    runs = [rest for word, rest in steps if word == "RUN"]
    (install,) = [r for r in runs if "kv-tier.txt" in r]
    mount = re.search(r"--mount=type=bind,source=(\S+),target=(\S+)", install)
    assert mount and mount[1] == "requirements/kv-tier.txt"
    assert f"pip install --no-cache-dir --no-deps -r {mount[2]}" in install
    assert (ROOT / mount[1]).is_file()
    assert not [r for r in runs if "lmcache" in r.lower() and "lmcache_deps" not in r], (
        "LMCache only from the pinned file, never with dependency resolution"
    )
    check = ("RUN", "python -m pdserve.worker.lmcache_deps")
    project = next(i for i, (_, r) in enumerate(steps) if '"/src/pdserve[model]"' in r)
    assert steps.index(("RUN", install)) < project < steps.index(check), "once pdserve is in"
    assert steps.index(next(s for s in steps if s[0] == "USER")) < steps.index(check), (
        "as the runtime user"
    )
    assert dockerfile_env(DOCKERFILES[kind])["LMCACHE_TRACK_USAGE"] == "false"
