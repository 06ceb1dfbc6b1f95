"""The OpenTelemetry SDK objects ``pdserve.telemetry.tracing`` makes, where pdserve's differ from
the SDK's own. Imported only once tracing is on (this module imports the SDK)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry.sdk.resources import Resource


class FixedResource(Resource):
    """A resource whose hash is computed once. Resources are immutable, but the SDK's hash
    serializes every attribute to JSON each time, and the OTLP encoder hashes the resource
    of every span it exports (to group them): a few µs per span, on the exporter thread
    that holds the GIL the request path needs."""

    def __init__(self, attributes: Mapping[str, Any], schema_url: str | None = None) -> None:
        super().__init__(attributes, schema_url)  # type: ignore[arg-type]
        self._hash = super().__hash__()

    def __hash__(self) -> int:
        return self._hash


def resource(attributes: Mapping[str, Any]) -> FixedResource:
    """``Resource.create`` (environment and SDK attributes added) with a fixed hash."""
    created = Resource.create(dict(attributes))
    return FixedResource(created.attributes, created.schema_url)
