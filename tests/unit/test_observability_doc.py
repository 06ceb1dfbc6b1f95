"""docs/observability.md lists exactly the metrics the gateway exports, with their labels."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.metrics import MetricWrapperBase

from gateway.metrics import GatewayMetrics

DOC = Path(__file__).resolve().parents[2] / "docs" / "observability.md"
ROW = re.compile(r"^\| `(pdserve_[a-z_]+)` \| (\w+) \|([a-z_, ]*)\|", re.MULTILINE)


def test_the_metric_table_matches_the_registry() -> None:
    rows = ROW.findall(DOC.read_text())
    documented = {name: (kind, labels.strip()) for name, kind, labels in rows}
    assert len(documented) == len(rows), "a metric is listed twice"
    exported = {
        m._name: (m._type, ", ".join(m._labelnames))
        for m in vars(GatewayMetrics()).values()
        if isinstance(m, MetricWrapperBase)
    }
    assert documented == exported
