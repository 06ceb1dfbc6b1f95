"""``pdserve bench``: the project's benchmarks.

- ``pdserve bench kv``: KV transfer throughput of the connector vs a raw loopback socket.
- ``pdserve bench routing``: prefix-cache hit rate and TTFT of cache-aware vs round-robin
  routing on a real cluster, in the same run.
- ``pdserve bench serve``: pdserve vs monolithic ``vllm serve`` on the same cores, same
  workloads (vLLM's own benchmark client), with tables and plots.
- ``pdserve bench goodput``: goodput under SLOs as DistServe measures it (Poisson arrivals at
  a sweep of request rates, the SLO pair scaled from 0.5 to 4) of ``vllm serve`` and of
  pdserve with its static and its adaptive disaggregation policy.
- ``pdserve bench engine``: each worker's engine speed vs a bare vLLM engine, same settings.
- ``pdserve bench gateway``: the gateway's added TTFT/ITL (fake workers, many concurrent
  streams) against a direct connection to the decode worker, in the same run; with
  ``--tracing compare``, what turning tracing on costs its throughput.
- ``pdserve bench soak``: minutes of mixed load with periodic worker faults; failed requests,
  memory growth and p99 drift.
- ``pdserve bench fleet``: N fake workers, M gateway replicas and one Redis at a fixed request
  rate: routing time, Redis load and memory, stickiness of conversations, spread, against N.
- ``pdserve bench derender``: CPU per streamed token of vLLM's own derenderer against the
  gateway's answer, with and without a tool-call parser, in the same run.
- ``pdserve bench gpu``: the GPU path end to end on one GPU (NIXL), greedy parity with
  ``vllm serve``, KV GB/s, then ``bench serve`` (needs an NVIDIA GPU; not run in CI).
"""

from __future__ import annotations

import argparse
import importlib
import signal
from types import FrameType

BENCHES = {
    "kv": "kv_transfer.bench",
    "routing": "pdserve.bench.routing",
    "serve": "pdserve.bench.serve",
    "goodput": "pdserve.bench.goodput",
    "engine": "pdserve.bench.engine",
    "gateway": "pdserve.bench.gateway",
    "soak": "pdserve.bench.soak",
    "tier": "pdserve.bench.tier",
    "fleet": "pdserve.bench.fleet",
    "gpu": "pdserve.bench.gpu",
    "derender": "pdserve.bench.derender",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, module in BENCHES.items():
        mod = importlib.import_module(module)
        doc = (mod.__doc__ or name).strip().splitlines()[0]
        mod.add_arguments(sub.add_parser(name, help=doc, description=doc))


def stop_on_sigterm() -> None:
    """Make SIGTERM end this process as Ctrl-C does, through its ``finally`` blocks: the
    benchmarks stop the clusters and servers they started there (each in its own process
    group), and a plain SIGTERM (``kill``, a job runner) would leave those running."""

    def stop(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def run(args: argparse.Namespace) -> int:
    stop_on_sigterm()
    return int(importlib.import_module(BENCHES[args.bench]).run(args) or 0)
