"""Kubernetes manifests: every kustomization renders with real kustomize, every object validates
against the Kubernetes schemas, and the policies hold on what is rendered."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from pdserve.cluster.redis_server import redacted
from pdserve.worker.engine import nixl_env
from tests.deploy.support import (
    IMAGES,
    KUSTOMIZATIONS,
    OVERLAYS,
    SHM_HEADROOM_GIB,
    TWO_MODELS,
    VERSION,
    component,
    container_env,
    default,
    find_tool,
    gib,
    ingress_allowed,
    kustomize,
    labels_match,
    objects,
    pod_spec,
    run,
    worker_settings,
    workloads,
)

# The oldest Kubernetes we support (native gRPC probes are GA since 1.27) and the newest schemas.
SCHEMA_VERSIONS = ["1.29.0", "1.37.0"]
PDSERVE_COMPONENTS = {"gateway", "prefill", "decode"}
WORKER_PORTS = {"prefill": default("prefill", "port"), "decode": default("decode", "port")}
# The images' health check (deploy/docker/healthcheck.py, tests/deploy/test_healthcheck.py).
HEALTHCHECK = ["/opt/pdserve/venv/bin/python", "/opt/pdserve/healthcheck.py"]


def pdserve_containers(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (component(w), c)
        for w in workloads(docs)
        if component(w) in PDSERVE_COMPONENTS
        for c in pod_spec(w)["containers"]
    ]


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_objects_validate_against_kubernetes_schemas(path: str, version: str) -> None:
    docs = kustomize(path)
    assert docs, f"{path} rendered nothing"
    errors = []
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            errors.append(f"{doc['kind']}/{doc['metadata']['name']}: {err.message} at {err.path}")
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("path", OVERLAYS)
def test_overlay_has_every_part(path: str) -> None:
    docs = kustomize(path)
    deployments = objects(docs, "Deployment")
    assert {"pdserve-gateway", "pdserve-prefill", "pdserve-decode"} <= set(deployments)
    assert "redis" in objects(docs, "StatefulSet")
    assert {"pdserve-gateway", "redis"} <= set(objects(docs, "Service"))
    assert "pdserve-gateway" in objects(docs, "HorizontalPodAutoscaler")
    assert "pdserve-gateway" in objects(docs, "PodDisruptionBudget")
    assert "pdserve-api-keys" in objects(docs, "Secret")
    assert len(objects(docs, "NetworkPolicy")) >= 4
    assert all(
        d["metadata"].get("namespace") == "pdserve" for d in docs if d["kind"] != "Namespace"
    )


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_every_container_has_probes_resources_and_runs_as_non_root(path: str) -> None:
    problems = []
    for w in workloads(kustomize(path)):
        name, pod = w["metadata"]["name"], pod_spec(w)
        pod_sc = pod.get("securityContext", {})
        if pod.get("enableServiceLinks") is not False:  # would inject PDSERVE_*_PORT=tcp://...
            problems.append(f"{name}: enableServiceLinks is not false")
        if pod.get("automountServiceAccountToken") is not False:
            problems.append(f"{name}: mounts a service account token it does not use")
        init = [c["name"] for c in pod.get("initContainers", [])]
        for c in pod["containers"] + pod.get("initContainers", []):
            where = f"{name}/{c['name']}"
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe not in c and c["name"] not in init:  # init containers take none
                    problems.append(f"{where}: no {probe}")
            for kind in ("requests", "limits"):
                for resource in ("cpu", "memory"):
                    if resource not in c.get("resources", {}).get(kind, {}):
                        problems.append(f"{where}: no {resource} {kind}")
            sc = {**pod_sc, **c.get("securityContext", {})}
            if sc.get("runAsNonRoot") is not True or not sc.get("runAsUser"):
                problems.append(f"{where}: not runAsNonRoot with a non-zero runAsUser")
            if sc.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{where}: allowPrivilegeEscalation is not false")
            if "ALL" not in sc.get("capabilities", {}).get("drop", []):
                problems.append(f"{where}: capabilities not dropped")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", OVERLAYS)
def test_images_are_the_pdserve_release(path: str) -> None:
    want = IMAGES["gpu" if path.startswith("overlays/gpu") else "cpu"]
    images = {c["image"] for _, c in pdserve_containers(kustomize(path))}
    assert images == {want}
    base = {c["image"] for _, c in pdserve_containers(kustomize("base"))}
    assert base == {"pdserve"}, "base keeps the placeholder that overlays set"
    labels = {d["metadata"]["labels"].get("app.kubernetes.io/version") for d in kustomize("base")}
    assert labels == {VERSION}


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_ports_and_probes_agree_with_the_settings_defaults(path: str) -> None:
    for role, c in pdserve_containers(kustomize(path)):
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert c["args"][0] == role
        if role == "gateway":
            http, grpc_port = default("gateway", "http_port"), default("gateway", "grpc_port")
            assert ports["http"] == http and ports["grpc"] == grpc_port
            assert c["startupProbe"]["grpc"]["port"] == grpc_port
            assert c["livenessProbe"]["grpc"]["port"] == grpc_port
            assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        else:
            assert ports["grpc"] == WORKER_PORTS[role]
            # The kubelet's gRPC probe has no TLS: the image's health check script asks the
            # worker's port (from its settings) over mutual TLS.
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert c[probe]["exec"]["command"] == HEALTHCHECK, (role, probe)
            # Loading takes minutes: the startup probe must allow at least 5 of them.
            startup = c["startupProbe"]
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
        if role == "prefill":
            assert ports["kv"] == default("prefill", "kv_port")


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_workers_bind_all_interfaces_and_advertise_the_pod_ip(path: str) -> None:
    docs = kustomize(path)
    pod_ip = {"fieldRef": {"fieldPath": "status.podIP"}}
    for role, c in pdserve_containers(docs):
        env = container_env(docs, c)
        prefix = f"PDSERVE_{role.upper()}_"
        if role == "gateway":
            assert env[prefix + "HTTP_HOST"] == "0.0.0.0"
            assert env[prefix + "HTTP_PORT"] == str(default("gateway", "http_port"))
            assert env[prefix + "GRPC_PORT"] == str(default("gateway", "grpc_port"))
        else:
            assert env[prefix + "HOST"] == "0.0.0.0"
            assert env[prefix + "PORT"] == str(WORKER_PORTS[role])
            assert env[prefix + "ADVERTISE_HOST"] == pod_ip
        if role == "prefill":
            assert env[prefix + "KV_BIND_HOST"] == "0.0.0.0"
            assert env[prefix + "KV_PORT"] == str(default("prefill", "kv_port"))
        # Kubernetes discovery is through Redis: no static worker lists.
        assert not {k for k in env if k.endswith("_WORKERS")}, role
        if path != "base":
            assert redacted(env[prefix + "REDIS_URL"]) == "redis://redis:6379/0"  # + its login


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_shared_memory_holds_the_kv_cache(path: str) -> None:
    docs = kustomize(path)
    for w in workloads(docs):
        role = component(w)
        if role not in WORKER_PORTS:
            continue
        pod = pod_spec(w)
        (c,) = pod["containers"]
        env = container_env(docs, c)
        prefix = f"PDSERVE_{role.upper()}_"
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        shm = volumes[mounts["/dev/shm"]]["emptyDir"]
        assert shm["medium"] == "Memory"
        if env.get(prefix + "KV_CONNECTOR", default(role, "kv_connector")) == "pdserve":
            kv = float(env.get(prefix + "KV_CACHE_GIB", default(role, "kv_cache_gib")))
            assert gib(shm["sizeLimit"]) >= kv + SHM_HEADROOM_GIB, (path, role)
        memory = gib(c["resources"]["limits"]["memory"])
        assert memory > gib(shm["sizeLimit"]), f"{role}: /dev/shm counts against memory"


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_selectors_and_references_resolve(path: str) -> None:
    docs = kustomize(path)
    by_name = {w["metadata"]["name"]: w for w in workloads(docs)}
    labels = {name: w["spec"]["template"]["metadata"]["labels"] for name, w in by_name.items()}
    for name, w in by_name.items():
        assert labels_match(w["spec"]["selector"], labels[name]), name
        if component(w) in WORKER_PORTS:
            assert labels[name]["pdserve/role"] == component(w), "workers carry a role label"
    for name, svc in objects(docs, "Service").items():
        selector = {"matchLabels": svc["spec"]["selector"]}
        targets = [w for w in by_name if labels_match(selector, labels[w])]
        assert targets, f"Service {name} selects no pods"
        named = {
            p["name"]
            for w in targets
            for c in pod_spec(by_name[w])["containers"]
            for p in c.get("ports", [])
        }
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in named, f"Service {name}: no port {port['targetPort']}"
    for name, pdb in objects(docs, "PodDisruptionBudget").items():
        assert any(labels_match(pdb["spec"]["selector"], pod) for pod in labels.values()), name
    for name, hpa in objects(docs, "HorizontalPodAutoscaler").items():
        assert hpa["spec"]["scaleTargetRef"]["name"] in objects(docs, "Deployment"), name


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_gateway_service_exposes_http_and_grpc(path: str) -> None:
    svc = objects(kustomize(path), "Service")["pdserve-gateway"]
    ports = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
    assert ports == {
        "http": default("gateway", "http_port"),
        "grpc": default("gateway", "grpc_port"),
    }


def _labels(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {component(w): w["spec"]["template"]["metadata"]["labels"] for w in workloads(docs)}


@pytest.mark.parametrize("path", OVERLAYS)
def test_network_policies(path: str) -> None:
    docs = kustomize(path)
    policies = list(objects(docs, "NetworkPolicy").values())
    pods = _labels(docs)
    outsider = {"app": "something-else"}
    gw, pf, dc, redis = pods["gateway"], pods["prefill"], pods["decode"], pods["redis"]
    http, grpc_port = default("gateway", "http_port"), default("gateway", "grpc_port")
    p_grpc, d_grpc, kv = (
        WORKER_PORTS["prefill"],
        WORKER_PORTS["decode"],
        default("prefill", "kv_port"),
    )

    def allowed(src: dict[str, str], dst: dict[str, str], port: int) -> bool:
        return ingress_allowed(policies, src, dst, port)

    # Clients reach the gateway, and nothing else.
    assert allowed(outsider, gw, http) and allowed(outsider, gw, grpc_port)
    for dst, port in [(pf, p_grpc), (dc, d_grpc), (pf, kv), (redis, 6379)]:
        assert not allowed(outsider, dst, port), (dst, port)
    # Only the gateway reaches the workers' gRPC ports.
    assert allowed(gw, pf, p_grpc) and allowed(gw, dc, d_grpc)
    assert not allowed(gw, pf, kv), "the gateway has no business on the KV port"
    # Only workers reach the prefill workers' KV port.
    assert allowed(dc, pf, kv) and allowed(pf, pf, kv)
    assert not allowed(redis, pf, kv)
    # Everything of ours reaches Redis.
    assert all(allowed(src, redis, 6379) for src in (gw, pf, dc))
    # UCX picks its ports at run time: workers reach each other freely.
    if path.startswith("overlays/gpu"):
        assert allowed(dc, pf, 40000) and allowed(pf, dc, 40000)
        assert not allowed(gw, pf, 40000)
    else:
        assert not allowed(dc, pf, 40000)


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_two_gateway_replicas_and_an_autoscaler(path: str) -> None:
    """Gateways are replicas that share their load (docs/deploy.md, "Several gateways"): two
    by default, more by the HorizontalPodAutoscaler, on CPU utilisation."""
    docs = kustomize(path)
    assert objects(docs, "Deployment")["pdserve-gateway"]["spec"]["replicas"] == 2
    hpa = objects(docs, "HorizontalPodAutoscaler")["pdserve-gateway"]["spec"]
    assert hpa["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "pdserve-gateway",
    }
    assert hpa["minReplicas"] == 2 < hpa["maxReplicas"]
    (metric,) = hpa["metrics"]
    assert metric["resource"]["name"] == "cpu"
    assert 0 < metric["resource"]["target"]["averageUtilization"] <= 100


def test_cpu_overlay_fits_one_box() -> None:
    docs = kustomize("overlays/cpu")
    deployments = objects(docs, "Deployment")
    for name in ("pdserve-prefill", "pdserve-decode"):
        assert deployments[name]["spec"]["replicas"] == 1
    for name in ("pdserve-prefill", "pdserve-decode"):
        assert deployments[name]["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
        (c,) = pod_spec(deployments[name])["containers"]
        assert c["resources"]["requests"] == c["resources"]["limits"], "Guaranteed QoS"
        assert "nvidia.com/gpu" not in c["resources"]["limits"]
        env = container_env(docs, c)
        assert env[f"PDSERVE_{component(deployments[name]).upper()}_KV_CONNECTOR"] == "pdserve"


def test_gpu_overlay() -> None:
    docs = kustomize("overlays/gpu")
    deployments = objects(docs, "Deployment")
    for name in ("pdserve-prefill", "pdserve-decode"):
        d = deployments[name]
        role = component(d)
        assert d["spec"]["replicas"] >= 2, "xPyD: more than one worker per role"
        pod = pod_spec(d)
        (c,) = pod["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert c["resources"]["requests"]["nvidia.com/gpu"] == "1"
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
            "tolerations"
        ]
        env = container_env(docs, c)
        p = f"PDSERVE_{role.upper()}_"
        assert env[p + "KV_CONNECTOR"] == "nixl"
        # The side channel (vLLM's VLLM_NIXL_SIDE_CHANNEL_HOST/PORT, set by the worker from
        # its settings: nixl_env) is bound at the advertised host, the pod IP, on the port the
        # container declares; nothing sets vLLM's variables behind the worker's back.
        assert not [k for k in env if k.startswith("VLLM_NIXL_")]
        assert env[p + "ADVERTISE_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert p + "NIXL_HOST" not in env, "default: the advertised host"
        pod_ip = "10.1.2.3"  # what the fieldRef gives the pod
        values = {k: v for k, v in env.items() if isinstance(v, str)}
        settings = worker_settings(role, {**values, p + "ADVERTISE_HOST": pod_ip})
        side = nixl_env(settings)
        assert side["VLLM_NIXL_SIDE_CHANNEL_HOST"] == pod_ip
        ports = {port["name"]: port["containerPort"] for port in c["ports"]}
        assert int(side["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == ports["nixl"]
        startup = c["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800
    gateway = pod_spec(deployments["pdserve-gateway"])
    assert "nvidia.com/gpu" not in gateway["containers"][0]["resources"]["limits"]


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_gateway_and_workers_mount_their_tls_secret(path: str) -> None:
    """Internal mutual TLS: each role's pods read PDSERVE_TLS_DIR from the mounted Secret
    pdserve-tls-<role> (kubernetes.io/tls with ca.crt, as cert-manager writes it), which
    kustomize does not generate (docs/deploy.md)."""
    docs = kustomize(path)
    assert not [d for d in objects(docs, "Secret") if d.startswith("pdserve-tls")]
    for w in workloads(docs):
        role = component(w)
        if role not in PDSERVE_COMPONENTS:
            continue
        pod = pod_spec(w)
        volumes = {v["name"]: v for v in pod["volumes"]}
        for c in pod["containers"]:
            tls_dir = container_env(docs, c)["PDSERVE_TLS_DIR"]
            mounts = [m for m in c["volumeMounts"] if m["mountPath"] == tls_dir]
            assert len(mounts) == 1 and mounts[0]["readOnly"] is True, (path, role)
            secret = volumes[mounts[0]["name"]]["secret"]
            assert secret["secretName"] == f"pdserve-tls-{role}", (path, role)
            assert "items" not in secret, "ca.crt, tls.crt and tls.key under their own names"
            assert secret["defaultMode"] & 0o007 == 0, "not readable by other users"


def test_the_documented_tls_secrets_hold_what_the_pods_read(tmp_path: Path) -> None:
    """`pdserve certs` and the `kubectl create secret` of docs/deploy.md (and the base's
    kustomization) make a valid kubernetes.io/tls Secret whose keys are the files
    ``pdserve.rpc.tls.load`` reads from the mounted directory."""
    from pdserve.cli.certs import DEFAULT_NAMES
    from pdserve.rpc.ca import write_set
    from pdserve.rpc.tls import SERVER_NAME, load

    names = DEFAULT_NAMES.split(",")
    assert set(names) == PDSERVE_COMPONENTS
    written = write_set(tmp_path / "set", names)
    out = run([find_tool("kubectl"), "-n", "pdserve", "create", "secret", "generic",
               "pdserve-tls-prefill", "--type=kubernetes.io/tls",
               f"--from-file={written['prefill']}", "--dry-run=client", "-o", "yaml"])  # fmt: skip
    secret = yaml.safe_load(out)
    for version in SCHEMA_VERSIONS:
        kubernetes_validate.validate(secret, version, strict=True)
    mounted = tmp_path / "mounted"
    mounted.mkdir()
    for key, value in secret["data"].items():
        (mounted / key).write_bytes(base64.b64decode(value))
    assert load(mounted).names == (SERVER_NAME, "prefill")


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_no_two_controllers_or_budgets_select_the_same_pods(path: str) -> None:
    """Each pod is its own Deployment's or StatefulSet's alone, and under at most one
    PodDisruptionBudget (the eviction API refuses a pod under two, which blocks a drain)."""
    docs = kustomize(path)
    pods = {w["metadata"]["name"]: w["spec"]["template"]["metadata"]["labels"]
            for w in workloads(docs)}  # fmt: skip
    budgets = objects(docs, "PodDisruptionBudget").values()
    for name, labels in pods.items():
        owners = [w["metadata"]["name"] for w in workloads(docs)
                  if labels_match(w["spec"]["selector"], labels)]  # fmt: skip
        assert owners == [name], f"{name}'s pods are selected by {owners}"
        under = [b["metadata"]["name"] for b in budgets
                 if labels_match(b["spec"]["selector"], labels)]  # fmt: skip
        assert len(under) <= 1, f"{name}'s pods are under {under}"


def test_the_two_models_overlay_serves_a_second_model_beside_the_first() -> None:
    """docs/deploy.md, "Kubernetes: two models": the gateways serve each model that
    PDSERVE_GATEWAY_EXTRA_MODELS names from a directory their pods hold, and a prefill and a
    decode Deployment serve it from the same directory under that name; the first model's
    workers serve the default model as in the cpu overlay."""
    from gateway.config import GatewaySettings
    from pdserve.settings import DEFAULT_MODEL_NAME

    docs = kustomize(TWO_MODELS)
    deployments = objects(docs, "Deployment")

    def mounted(deployment: dict[str, Any], directory: str) -> bool:
        """``directory`` is on a volume of the pod that an init container writes."""
        pod = pod_spec(deployment)
        (c,) = pod["containers"]
        volumes = {m["name"] for m in c.get("volumeMounts", []) if directory.startswith(
            m["mountPath"].rstrip("/") + "/")}  # fmt: skip
        writers = [i for i in pod.get("initContainers", [])
                   if volumes & {m["name"] for m in i.get("volumeMounts", [])}]  # fmt: skip
        return bool(writers) and any(directory in i["args"] for i in writers)

    (gateway,) = pod_spec(deployments["pdserve-gateway"])["containers"]
    env = container_env(docs, gateway)
    settings = GatewaySettings(extra_models=env["PDSERVE_GATEWAY_EXTRA_MODELS"],
                               redis_url="redis://redis:6379/0")  # fmt: skip
    first, *extra = settings.served_models()
    assert extra, "the gateways serve a second model"
    served: dict[str, list[str]] = {}
    for name, deployment in deployments.items():
        role = component(deployment)
        if role not in WORKER_PORTS:
            continue
        (c,) = pod_spec(deployment)["containers"]
        env = container_env(docs, c)  # less the downward API's fieldRefs
        worker = worker_settings(role, {k: v for k, v in env.items() if isinstance(v, str)})
        model = worker.served_model_name or (
            Path(worker.model).name if worker.model else DEFAULT_MODEL_NAME)  # fmt: skip
        served.setdefault(model, []).append(role)
        label = deployment["spec"]["template"]["metadata"]["labels"]["pdserve/model"]
        assert label == model, f"{name} serves {model} but is labelled {label}"
        for model_name, directory in extra:
            if model == model_name:
                assert worker.model == directory, name
                assert mounted(deployment, directory), f"{name} has no {directory}"
    for model_name, directory in extra:
        assert sorted(served.get(model_name, [])) == ["decode", "prefill"], model_name
        assert mounted(deployments["pdserve-gateway"], directory), directory
    assert sorted(served[first[0]]) == ["decode", "prefill"], "the first model keeps its workers"
    assert len(served) == 1 + len(extra)
