"""Logs and traces: structured logging, OpenTelemetry tracing, the OTLP receiver the tests and
benchmarks read spans from."""
