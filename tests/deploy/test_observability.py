"""The observability profile's configuration: Prometheus scrapes the gateway's port, the Grafana
dashboard queries metrics the gateway really exports, the provisioning paths match compose."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import yaml

from gateway.metrics import GatewayMetrics
from tests.deploy.support import COMPOSE_FILE, K8S, compose_config, default, kustomize

OBSERVABILITY = COMPOSE_FILE.parent / "observability"
DASHBOARD = OBSERVABILITY / "grafana" / "dashboards" / "pdserve.json"


def exported_series() -> set[str]:
    """Every series name the gateway's /metrics can carry (histogram parts, counter _total)."""
    names = set()
    for metric in GatewayMetrics().registry.collect():
        if metric.type == "histogram":
            names |= {f"{metric.name}_{s}" for s in ("bucket", "sum", "count")}
        elif metric.type == "counter":
            names |= {f"{metric.name}_total", f"{metric.name}_created"}
        else:
            names.add(metric.name)
    return names


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_dashboard_queries_exported_metrics() -> None:
    exported = exported_series()
    used = {m for e in dashboard_exprs() for m in re.findall(r"\bpdserve_[a-z_]+", e)}
    assert used, "the dashboard queries pdserve metrics"
    assert not used - exported, f"not exported by the gateway: {sorted(used - exported)}"
    text = " ".join(dashboard_exprs())
    for topic in (
        "time_to_first_token",
        "inter_token_latency",
        "kv_transfer_bytes",
        "kv_transfer_seconds",
        "phase_seconds",
        "in_flight_requests",
    ):
        assert f"pdserve_gateway_{topic}" in text, f"the dashboard shows {topic}"


def test_dashboard_uses_the_provisioned_datasource_and_job() -> None:
    datasources = yaml.safe_load(
        (OBSERVABILITY / "grafana/provisioning/datasources/prometheus.yaml").read_text()
    )
    (source,) = datasources["datasources"]
    assert source["url"] == "http://prometheus:9090"
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == source["uid"]
    prometheus = yaml.safe_load((OBSERVABILITY / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    assert all('job="pdserve-gateway"' in e for e in dashboard_exprs())
    gateway = jobs["pdserve-gateway"]
    assert gateway["metrics_path"] == "/metrics"
    targets = gateway["static_configs"][0]["targets"]
    port = default("gateway", "http_port")
    assert sorted(targets) == sorted([f"gateway{n}:{port}" for n in ("", "-2", "-gpu", "-gpu-2")])
    services = compose_config()["services"]
    assert all(t.split(":")[0] in services for t in targets)


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    mounts = {}
    for volume in service["volumes"]:
        source, target = (
            volume.split(":")[:2]
            if isinstance(volume, str)
            else (volume["source"], volume["target"])
        )
        mounts[target] = source
    return mounts


def test_provisioning_paths_match_compose() -> None:
    services = compose_config()["services"]
    grafana = _mounts(services["grafana"])
    provider = yaml.safe_load(
        (OBSERVABILITY / "grafana/provisioning/dashboards/pdserve.yaml").read_text()
    )
    path = provider["providers"][0]["options"]["path"]
    assert grafana[path].endswith("observability/grafana/dashboards")
    assert grafana["/etc/grafana/provisioning"].endswith("observability/grafana/provisioning")
    prometheus = _mounts(services["prometheus"])
    assert prometheus["/etc/prometheus/prometheus.yml"].endswith("observability/prometheus.yml")
    collector = services["otel-collector"]
    config_path = collector["command"][0].split("=", 1)[1]
    assert _mounts(collector)[config_path].endswith("observability/otel-collector.yaml")


def test_collector_pipelines_are_wired() -> None:
    config = yaml.safe_load((OBSERVABILITY / "otel-collector.yaml").read_text())
    for name, pipeline in config["service"]["pipelines"].items():
        for part in ("receivers", "processors", "exporters"):
            for component in pipeline[part]:
                assert component in config[part], f"{name}: {part[:-1]} {component} not defined"
    prometheus = yaml.safe_load((OBSERVABILITY / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    exporter_port = config["exporters"]["prometheus"]["endpoint"].rsplit(":", 1)[1]
    assert jobs["otel-collector"]["static_configs"][0]["targets"] == [
        f"otel-collector:{exporter_port}"
    ]


def test_traces_go_to_the_collector_and_on_to_the_viewer() -> None:
    config = yaml.safe_load((OBSERVABILITY / "otel-collector.yaml").read_text())
    services = compose_config("--profile", "observability")["services"]
    http_port = config["receivers"]["otlp"]["protocols"]["http"]["endpoint"].rsplit(":", 1)[1]
    for name in ("gateway", "prefill", "decode"):
        env = services[name]["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"http://otel-collector:{http_port}"
        assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http/protobuf"
        assert env["OTEL_TRACES_EXPORTER"] == "none"  # on with OTEL_TRACES_EXPORTER=otlp
    exporters = config["service"]["pipelines"]["traces"]["exporters"]
    hosts = {config["exporters"][e]["endpoint"].split(":")[0] for e in exporters}
    assert hosts == {"jaeger"} and "jaeger" in services
    assert "observability" in services["jaeger"]["profiles"]


def test_the_kubernetes_tracing_component_sets_every_process_up(tmp_path: Path) -> None:
    """An overlay of overlays/cpu with components/tracing: each pdserve Deployment's settings
    ConfigMap carries the OTEL_* variables (and nothing else changes name)."""
    overlay = tmp_path / "traced"
    overlay.mkdir()
    cpu, component = (
        os.path.relpath(K8S / p, overlay) for p in ("overlays/cpu", "components/tracing")
    )
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{cpu}]\ncomponents: [{component}]\n"
    )
    docs = kustomize(str(overlay))
    maps = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    for d in docs:
        if d["kind"] != "Deployment" or not d["metadata"]["name"].startswith("pdserve-"):
            continue
        container = d["spec"]["template"]["spec"]["containers"][0]
        names = [ref["configMapRef"]["name"] for ref in container["envFrom"]]
        data = {k: v for name in names for k, v in maps[name].items()}
        assert data["OTEL_TRACES_EXPORTER"] == "otlp", d["metadata"]["name"]
        assert data["OTEL_EXPORTER_OTLP_ENDPOINT"].startswith("http://")
