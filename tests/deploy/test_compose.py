"""docker compose: the file validates with a real compose implementation (Debian's
docker-compose 1.29, `config`), and the policies hold on the interpolated result."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pdserve.cluster.redis_server import redacted
from pdserve.worker.engine import nixl_env
from tests.deploy.support import (
    COMPOSE_FILE,
    DOCKERFILES,
    IMAGES,
    SHM_HEADROOM_GIB,
    compose_config,
    default,
    dockerfile_env,
    gib,
    worker_settings,
)

PROFILE_ARGS = [(), ("--profile", "gpu"), ("--profile", "observability")]
EXAMPLE_ENV = COMPOSE_FILE.parent / ".env.example"
MAIN_STACK = {"redis", "model-prepare", "prefill", "decode", "gateway", "gateway-2"}
# The gateway replicas of each stack: the same service but for the host ports.
GATEWAYS = {"gateway": "", "gateway-2": "", "gateway-gpu": "-gpu", "gateway-gpu-2": "-gpu"}
GPU_STACK = {"model-prepare-gpu", "prefill-gpu", "decode-gpu", "gateway-gpu", "gateway-gpu-2"}
OBSERVABILITY = {"otel-collector", "jaeger", "prometheus", "grafana"}
TWO_MODELS = {"model-prepare-second", "prefill-b", "decode-b"}  # a second model's workers
# Services that cannot have a Docker health check, and why.
NO_HEALTHCHECK = {
    "model-prepare": "one-shot; dependants wait for service_completed_successfully",
    "model-prepare-gpu": "one-shot; dependants wait for service_completed_successfully",
    "model-prepare-second": "one-shot; dependants wait for service_completed_successfully",
    "otel-collector": "distroless image: no shell or client to run a check with",
}


def services(*args: str) -> dict[str, dict[str, Any]]:
    return dict(compose_config(*args)["services"])


def image_kind(service: dict[str, Any]) -> str | None:
    """The kind ("cpu" or "gpu") of a service on a pdserve image; None for other images."""
    for kind, image in IMAGES.items():
        if service["image"] == image:
            return kind
    return None


def role(service: dict[str, Any]) -> str:
    return str(service["command"][0])


@pytest.mark.parametrize("args", PROFILE_ARGS, ids=["default", "gpu", "observability"])
def test_compose_file_is_valid(args: tuple[str, ...]) -> None:
    assert set(services(*args)) == MAIN_STACK | GPU_STACK | OBSERVABILITY | TWO_MODELS


def test_example_env_file_interpolates() -> None:
    with_example = services("--env-file", str(EXAMPLE_ENV))
    assert with_example == services(), ".env.example must spell out the defaults"


def test_profiles() -> None:
    svc = services()
    assert all("profiles" not in svc[name] for name in MAIN_STACK), "the CPU stack is the default"
    assert all(svc[name]["profiles"] == ["gpu"] for name in GPU_STACK)
    assert all(svc[name]["profiles"] == ["observability"] for name in OBSERVABILITY)
    assert all(svc[name]["profiles"] == ["two-models"] for name in TWO_MODELS)


def test_the_two_models_profile_serves_a_second_model_beside_the_first(tmp_path: Path) -> None:
    """docs/api.md, "Several models": prefill-b and decode-b serve the second model (prepared
    into the model cache by model-prepare-second) as the first model's workers serve theirs,
    on cores of their own; the gateways serve it with EXTRA_MODELS set."""
    from decode_service.config import DecodeSettings
    from gateway.config import GatewaySettings

    second = "second-model=/opt/pdserve/cache/models/second-model"
    env_file = tmp_path / "two-models.env"
    env_file.write_text(f"EXTRA_MODELS={second}\n")
    svc = services("--env-file", str(env_file))
    prepare = svc["model-prepare-second"]["command"]
    assert prepare[:3] == ["model", "lora", "--merged"]
    path = prepare[prepare.index("--dest") + 1]
    cores = set()
    for name, first in (("prefill-b", "prefill"), ("decode-b", "decode")):
        env, p = _env(svc[name]), f"PDSERVE_{role(svc[name]).upper()}_"
        assert (env[p + "MODEL"], env[p + "SERVED_MODEL_NAME"]) == (path, "second-model")
        assert env[p + "WORKER_ID"] != _env(svc[first])[p + "WORKER_ID"]
        differ = {k for k in env if env[k] != _env(svc[first]).get(k)}
        assert differ == {p + k for k in ("WORKER_ID", "ADVERTISE_HOST", "MODEL",
                                          "SERVED_MODEL_NAME", "CPU_CORES")}  # fmt: skip
        assert "model-prepare-second" in svc[name]["depends_on"]
        cores |= {env[p + "CPU_CORES"], _env(svc[first])[p + "CPU_CORES"]}
    assert len(cores) == 4, "each engine on a core of its own"
    decode = DecodeSettings(**{k[len("PDSERVE_DECODE_"):].lower(): v
                               for k, v in _env(svc["decode-b"]).items()
                               if k.startswith("PDSERVE_DECODE_")})  # fmt: skip
    assert decode.served_model_name == "second-model"
    for gateway in ("gateway", "gateway-2"):
        env = _env(svc[gateway])
        settings = GatewaySettings(
            extra_models=env["PDSERVE_GATEWAY_EXTRA_MODELS"],
            redis_url=env["PDSERVE_GATEWAY_REDIS_URL"],
            model="/opt/pdserve/cache/models/first",
        )
        assert settings.served_models()[1] == ("second-model", path)


def test_images_and_builds_agree() -> None:
    for name, svc in services().items():
        kind = image_kind(svc)
        if kind is None:
            assert name in {"redis"} | OBSERVABILITY, f"{name} uses {svc['image']}"
            assert ":" in svc["image"] and not svc["image"].endswith(":latest"), name
            continue
        assert (name in GPU_STACK) == (kind == "gpu"), name
        build = svc["build"]
        assert Path(build["context"]).resolve() == COMPOSE_FILE.parents[2]
        assert Path(build["dockerfile"]).name == DOCKERFILES[kind].name


def test_health_checks_and_startup_order() -> None:
    svc = services()
    for name, s in svc.items():
        if name in NO_HEALTHCHECK:
            assert "healthcheck" not in s
            continue
        assert s["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL"), name
        if image_kind(s):
            assert s["healthcheck"]["test"][-1] == "/opt/pdserve/healthcheck.py", name
        for dep, cond in s.get("depends_on", {}).items():
            wanted = "service_healthy" if dep not in NO_HEALTHCHECK else None
            if dep.startswith("model-prepare"):
                wanted = "service_completed_successfully"
            if wanted:
                assert cond["condition"] == wanted, (name, dep)
    for gateway, suffix in GATEWAYS.items():
        deps = svc[gateway]["depends_on"]
        for dep in ("redis", f"prefill{suffix}", f"decode{suffix}"):
            assert deps[dep]["condition"] == "service_healthy", (gateway, dep)
    for worker in ("prefill", "decode", "prefill-gpu", "decode-gpu"):
        assert svc[worker]["depends_on"]["redis"]["condition"] == "service_healthy"


def test_resource_limits_and_non_root() -> None:
    for name, s in services().items():
        limits = s.get("deploy", {}).get("resources", {}).get("limits", {})
        assert "cpus" in limits and "memory" in limits, f"{name}: no cpu/memory limit"
        if image_kind(s) is None:  # ours run as the image's USER (test_dockerfiles)
            uid = str(s.get("user", "0")).split(":")[0]
            assert uid.isdigit() and int(uid) != 0, f"{name} must run as a non-root user"
        else:
            assert "user" not in s, f"{name}: keep the image's non-root user"


def _env(s: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in s.get("environment", {}).items()}


def test_workers_bind_all_interfaces_and_advertise_their_service_name() -> None:
    for name, s in services().items():
        if image_kind(s) is None or role(s) not in ("prefill", "decode"):
            continue
        env, p = _env(s), f"PDSERVE_{role(s).upper()}_"
        assert env[p + "HOST"] == "0.0.0.0"
        assert env[p + "ADVERTISE_HOST"] == name
        assert env[p + "PORT"] == str(default(role(s), "port"))
        assert redacted(env[p + "REDIS_URL"]) == "redis://redis:6379/0"  # + its login
        if role(s) == "prefill" and env[p + "KV_CONNECTOR"] == "pdserve":
            assert env[p + "KV_BIND_HOST"] == "0.0.0.0"
            assert env[p + "KV_PORT"] == str(default("prefill", "kv_port"))


def _container_port(port: Any) -> int:
    """The container side of a ports entry ("127.0.0.1:8000:8000/tcp" or the long form)."""
    if isinstance(port, dict):
        return int(port["target"])
    return int(str(port).rsplit(":", 1)[1].split("/")[0])


def test_gateways_point_at_their_workers() -> None:
    svc = services()
    for gateway, suffix in GATEWAYS.items():
        env = _env(svc[gateway])
        assert env["PDSERVE_GATEWAY_HTTP_HOST"] == "0.0.0.0"
        prefill, decode = f"prefill{suffix}", f"decode{suffix}"
        assert env["PDSERVE_GATEWAY_PREFILL_WORKERS"] == f"{prefill}:{default('prefill', 'port')}"
        assert env["PDSERVE_GATEWAY_DECODE_WORKERS"] == f"{decode}:{default('decode', 'port')}"
        assert redacted(env["PDSERVE_GATEWAY_REDIS_URL"]) == "redis://redis:6379/0"  # + its login
        published = {_container_port(p) for p in svc[gateway]["ports"]}
        assert all(str(p).startswith("127.0.0.1:") for p in svc[gateway]["ports"]), "no API keys"
        assert published == {default("gateway", "http_port"), default("gateway", "grpc_port")}
        assert env["PDSERVE_GATEWAY_HTTP_PORT"] == str(default("gateway", "http_port"))
        assert env["PDSERVE_GATEWAY_GRPC_PORT"] == str(default("gateway", "grpc_port"))


def _host_port(port: Any) -> int:
    """The host side of a ports entry ("127.0.0.1:8000:8000/tcp" or the long form)."""
    if isinstance(port, dict):
        return int(port["published"])
    return int(str(port).rsplit(":", 2)[1])


def test_two_gateway_replicas_share_their_load_by_default() -> None:
    """docs/deploy.md, "Several gateways": the default stack runs two gateways, alike but for
    their host ports, on one Redis, with load sharing on."""
    svc = services()
    for first, second in ((svc["gateway"], svc["gateway-2"]),
                          (svc["gateway-gpu"], svc["gateway-gpu-2"])):  # fmt: skip
        assert {k: v for k, v in first.items() if k != "ports"} == {
            k: v for k, v in second.items() if k != "ports"
        }
        hosts = [{_host_port(p) for p in s["ports"]} for s in (first, second)]
        assert len(hosts[0]) == len(hosts[1]) == 2 and not hosts[0] & hosts[1]
        assert {_container_port(p) for p in second["ports"]} == {
            _container_port(p) for p in first["ports"]
        }
        interval = float(_env(first)["PDSERVE_GATEWAY_LOAD_SHARE_INTERVAL_S"])
        assert interval == default("gateway", "load_share_interval_s") > 0


def test_cpu_workers_have_shared_memory_for_the_kv_cache() -> None:
    for name, s in services().items():
        if image_kind(s) != "cpu" or role(s) not in ("prefill", "decode"):
            continue
        env, p = _env(s), f"PDSERVE_{role(s).upper()}_"
        assert env[p + "KV_CONNECTOR"] == "pdserve"
        kv = float(env.get(p + "KV_CACHE_GIB", default(role(s), "kv_cache_gib")))
        shm = gib(s["shm_size"])
        assert shm >= kv + SHM_HEADROOM_GIB, f"{name}: shm_size {s['shm_size']} < KV cache {kv}"
        memory = gib(s["deploy"]["resources"]["limits"]["memory"])
        assert memory > shm, f"{name}: /dev/shm counts against the memory limit"
        assert env[p + "CPU_CORES"], f"{name}: pin each engine to its own cores"
    cores = {
        _env(s).get(f"PDSERVE_{role(s).upper()}_CPU_CORES")
        for n, s in services().items()
        if n in ("prefill", "decode")
    }
    assert len(cores) == 2, "two engines on the same cores halve each other's speed"


def test_gpu_workers() -> None:
    svc = services("--profile", "gpu")
    side_channels = []
    for name in ("prefill-gpu", "decode-gpu"):
        s = svc[name]
        env, p = _env(s), f"PDSERVE_{role(s).upper()}_"
        assert env[p + "KV_CONNECTOR"] == "nixl"
        # The worker sets vLLM's side-channel variables from its settings (nixl_env); one
        # set here directly would be overridden, so none is.
        assert not [k for k in env if k.startswith("VLLM_NIXL_")]
        settings = worker_settings(role(s), env)
        side = nixl_env(settings)
        # Bound in the container and given to decode workers as remote_host: the service's
        # name, which resolves to the container on the compose network.
        assert side["VLLM_NIXL_SIDE_CHANNEL_HOST"] == name
        side_channels.append(side["VLLM_NIXL_SIDE_CHANNEL_PORT"])
        (device,) = s["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert s.get("ipc") == "host" or gib(s.get("shm_size", "0")) >= 8
    gpus = [
        svc[n]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
        for n in ("prefill-gpu", "decode-gpu")
    ]
    assert gpus[0] != gpus[1], "one GPU per worker by default"
    assert len(set(side_channels)) == 2, "a side-channel port each (also with host networking)"


def test_model_cache_is_a_named_volume_at_the_cache_dir() -> None:
    config = compose_config()
    assert "model-cache" in config["volumes"]
    for name, s in config["services"].items():
        kind = image_kind(s)
        if kind is None:
            continue
        cache = dockerfile_env(DOCKERFILES[kind])["PDSERVE_CACHE_DIR"]
        volumes = [
            v if isinstance(v, str) else f"{v['source']}:{v['target']}" for v in s["volumes"]
        ]
        mounts = {v.split(":")[1]: v.split(":")[0] for v in volumes}
        assert mounts.get(cache) == "model-cache", f"{name}: model-cache not at {cache}"
        read_only = any(v.endswith(":ro") for v in volumes if v.split(":")[1] == cache)
        assert read_only == (s["command"][0] != "model"), f"{name}: only model prepare writes"


def test_gateways_and_workers_mount_their_tls_identity(tmp_path: Path) -> None:
    """Each pdserve service (CPU and GPU) has PDSERVE_TLS_DIR holding the CA and its role's
    certificate and key, from the directory `pdserve certs` writes by default."""
    from pdserve.cli.certs import DEFAULT_NAMES
    from pdserve.rpc.ca import write_set
    from pdserve.rpc.tls import CA_FILE, CERT_FILE, KEY_FILE, load

    config = compose_config("--profile", "gpu")
    default_dir = COMPOSE_FILE.parent / "tls"
    written = write_set(tmp_path, DEFAULT_NAMES.split(","))
    files = {name: Path(s["file"]).relative_to(default_dir) for name, s in config["secrets"].items()
             if Path(s["file"]).is_relative_to(default_dir)}  # fmt: skip
    checked = set()
    for name, svc in config["services"].items():
        if image_kind(svc) is None or role(svc) not in ("gateway", "prefill", "decode"):
            continue
        tls_dir = svc["environment"]["PDSERVE_TLS_DIR"]
        mounted = {s["target"]: files[s["source"]] for s in svc["secrets"] if "target" in s}
        assert set(mounted) == {f"{tls_dir}/{f}" for f in (CA_FILE, CERT_FILE, KEY_FILE)}, name
        for file in (CERT_FILE, KEY_FILE):
            assert mounted[f"{tls_dir}/{file}"] == Path(role(svc)) / file, name
        # What the container would read, from a set as `pdserve certs` writes it.
        container = tmp_path / "container" / name
        container.mkdir(parents=True)
        for target, source in mounted.items():
            (container / Path(target).name).write_bytes((tmp_path / source).read_bytes())
        assert load(container).names == load(written[role(svc)]).names
        checked.add(name)
    workers = {"prefill", "decode", "gateway", "gateway-2", "prefill-b", "decode-b"}
    assert checked == workers | GPU_STACK - {"model-prepare-gpu"}
