"""Prometheus metrics of the gateway, in a registry of its own (served at ``GET /metrics``);
every metric is listed in docs/observability.md.

Label values: ``model`` is the served base model's name (a LoRA adapter's requests count
under their base model, so that run-time adapters cannot grow the label set); ``endpoint`` is
"completions", "chat_completions", "messages", "responses" or "grpc_generate"; ``path`` is
"disaggregated" (prefill worker + KV hand-off), "local" (the decode worker computed the prompt)
or "none" (failed before a route was chosen); ``outcome`` is "ok", "invalid", "overloaded",
"unavailable", "error", "timeout" (a worker stopped answering: 504) or "cancelled".
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from protos.v1 import common_pb2

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# A routing decision (the picker's pick): fine steps from 0.1 ms to 100 ms.
_ROUTE_BUCKETS = (0.0001, 0.0002, 0.0003, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.004,
                  0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1)  # fmt: skip
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5)


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pdserve_gateway_requests",
            "Finished requests by model (the served base model; an adapter's requests count "
            "under its base model), endpoint, path and outcome.",
            ["model", "endpoint", "path", "outcome"],
            registry=r,
        )
        self.fallbacks = Counter(
            "pdserve_gateway_local_fallbacks",
            "Requests moved to the local path after a failure, by reason "
            "(prefill_failed, kv_transfer_failed, no_handoff, handoff_spent).",
            ["reason"],
            registry=r,
        )
        self.kv_bytes = Counter(
            "pdserve_gateway_kv_transfer_bytes",
            "KV cache bytes the decode workers received from prefill workers.",
            registry=r,
        )
        self.kv_seconds = Histogram(
            "pdserve_gateway_kv_transfer_seconds",
            "Time the decode worker spent pulling one request's KV blocks.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill_deadline_seconds = Histogram(
            "pdserve_gateway_prefill_deadline_seconds",
            "Deadline given to a Prefill call (grows with the worker's queue and the prompt).",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "pdserve_gateway_retries",
            "Recoveries from a worker failure, by kind: prefill (another prefill worker), "
            "decode (another decode worker before the first token, same KV hand-off), "
            "migration (mid-stream, to another decode worker).",
            ["kind"],
            registry=r,
        )
        self.rejected = Counter(
            "pdserve_gateway_rejected",
            "Requests answered 429 / RESOURCE_EXHAUSTED before any work, by reason "
            "(gateway_limit: max_concurrent_requests; prefill_queue / decode_queue: every "
            "such worker has max_queue_per_worker requests).",
            ["reason"],
            registry=r,
        )
        self.prefill_seconds = Histogram(
            "pdserve_gateway_prefill_seconds",
            "Duration of the Prefill call, as seen by the gateway.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "pdserve_gateway_time_to_first_token_seconds",
            "From request arrival to the first generated token.",
            ["model", "path"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pdserve_gateway_inter_token_latency_seconds",
            "Time between generated tokens after the first (per token).",
            ["model", "path"],
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.slo = Counter(
            "pdserve_gateway_slo_requests",
            "Finished generations with a service-level objective (settings slo_ttft_ms, "
            "slo_tpot_ms, or the request's x-pdserve-slo-* headers), by objective (ttft, tpot; "
            "all: every objective the request had, i.e. goodput) and outcome (met, missed), "
            "per model.",
            ["model", "objective", "outcome"],
            registry=r,
        )
        self.in_flight = Gauge(
            "pdserve_gateway_in_flight_requests",
            "Generations admitted and not yet ended (each choice of an n > 1 request counts).",
            registry=r,
        )
        self.phase_seconds = Histogram(
            "pdserve_gateway_phase_seconds",
            "Where finished requests spent their time, by phase: queue (waiting before the "
            "prompt is computed: the prefill call's time less the prefill engine's, and the "
            "decode engine's queue), prefill (computing the prompt), transfer (pulling its KV "
            "blocks), decode (first to last token); from the workers' vLLM statistics.",
            ["phase"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

        self.decisions = Counter(
            "pdserve_gateway_routing_decisions",
            "Routing decisions by picker and path (disaggregated or local).",
            ["picker", "path"],
            registry=r,
        )
        self.split_decisions = Counter(
            "pdserve_gateway_split_decisions",
            "Where a prompt the picker gave a prefill worker is computed (disagg_policy; "
            "gateway.routing.split): where (prefill_worker, decode_worker) and why (static; "
            "adaptive: learning, prefill_sooner, decode_idle, within_tpot, tpot_guard, "
            "streams_unguarded).",
            ["where", "reason"],
            registry=r,
        )
        self.route_seconds = Histogram(
            "pdserve_gateway_route_seconds",
            "Duration of one routing decision: the picker's choice of workers (block hashing, "
            "the prefix-index lookup, scoring), after tokenization.",
            buckets=_ROUTE_BUCKETS,
            registry=r,
        )
        self.index_lookup_seconds = Histogram(
            "pdserve_gateway_prefix_index_lookup_seconds",
            "Duration of one prefix-index lookup (all candidate workers, one round trip).",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.index_errors = Counter(
            "pdserve_gateway_prefix_index_errors",
            "Lookups that found the prefix index unreachable (routed by load only).",
            registry=r,
        )
        self.predictions = Counter(
            "pdserve_gateway_prefix_predictions",
            "Predicted vs actual cached prompt tokens of the computing worker, per request: "
            "exact, over (predicted more) or under (none while the prefix index is unreachable).",
            ["result"],
            registry=r,
        )
        self.predicted_tokens = Counter(
            "pdserve_gateway_predicted_cached_tokens",
            "Prompt tokens the router predicted the computing worker's caches (its own, its KV "
            "tier) would serve.",
            registry=r,
        )
        self.actual_tokens = Counter(
            "pdserve_gateway_actual_cached_tokens",
            "Prompt tokens the computing worker reported served from its caches.",
            registry=r,
        )

        self.tier_corrections = Counter(
            "pdserve_gateway_tier_index_corrections",
            "Requests whose worker was served fewer prompt tokens than the prefix index said "
            "its shared KV tier holds (the tier evicted them): the tier's entries from the "
            "first chunk not served were dropped.",
            registry=r,
        )
        self.tier_index_errors = Counter(
            "pdserve_gateway_tier_index_write_errors",
            "Writes of shared KV tier entries (stores, corrections, resets) that found the "
            "prefix index unreachable (skipped: the index is best effort).",
            registry=r,
        )
        self.tier_index_resets = Counter(
            "pdserve_gateway_tier_index_resets",
            "Times a shared KV tier's entries exceeded tier_index_max_blocks and were dropped.",
            registry=r,
        )

    def prediction(self, predicted: int, actual: int) -> None:
        """Record one routing prediction against what the worker reported."""
        result = "exact" if predicted == actual else ("over" if predicted > actual else "under")
        self.predictions.labels(result).inc()
        self.predicted_tokens.inc(predicted)
        self.actual_tokens.inc(actual)

    def phases(
        self,
        prefill: common_pb2.EngineTimes | None,
        decode: common_pb2.EngineTimes | None,
        transfer: common_pb2.TransferStats,
        prefill_call_s: float = 0.0,
    ) -> dict[str, float]:
        """Record one finished request's phases (``phase_times``) and return them."""
        times = phase_times(prefill, decode, transfer, prefill_call_s)
        for phase, seconds in times.items():
            self.phase_seconds.labels(phase).observe(seconds)
        return times

    def render(self) -> bytes:
        return generate_latest(self.registry)


def phase_times(
    prefill: common_pb2.EngineTimes | None,
    decode: common_pb2.EngineTimes | None,
    transfer: common_pb2.TransferStats,
    prefill_call_s: float = 0.0,
) -> dict[str, float]:
    """Seconds of one finished request by phase: "transfer" when KV blocks were pulled;
    "queue", "prefill" and "decode" when the decode engine reported its times. ``prefill``:
    the prefill engine's times (None on the local path); ``prefill_call_s``: how long the
    gateway's prefill call took (0: not known)."""
    times: dict[str, float] = {}
    pulled = transfer.kv_transfer_seconds if transfer.kv_blocks_received else 0.0
    if pulled:
        times["transfer"] = pulled
    if decode is None:
        return times
    # The decode engine schedules a request once its KV blocks are in: its queue time
    # includes the pull.
    queue = max(0.0, decode.queue_seconds - pulled)
    computed = decode
    if prefill is not None:
        # vLLM's queue time starts when its engine core reads the request, after the step it
        # is running: a prompt sent while another is prefilled waits that long unseen.
        # Whatever of the call was not computing the prompt was waiting for it.
        queue += max(prefill.queue_seconds, prefill_call_s - prefill.prefill_seconds)
        computed = prefill
    times["queue"] = queue
    times["prefill"] = computed.prefill_seconds
    times["decode"] = decode.decode_seconds
    return times
