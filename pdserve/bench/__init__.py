"""The project's benchmarks: one module per ``pdserve bench`` command, their shared report and
client code, and the fake worker that load-tests the gateway."""
