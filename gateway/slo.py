"""Service-level objectives: the time to first token and the time per output token a request
should get, and whether it got them.

The gateway's objectives are settings (``slo_ttft_ms``, ``slo_tpot_ms``; 0: none); a request
may set its own with the headers ``x-pdserve-slo-ttft-ms`` and ``x-pdserve-slo-tpot-ms`` (gRPC:
metadata of the same names). When a generation finishes, each objective it has is counted met
or missed in ``pdserve_gateway_slo_requests``, and ``objective="all"`` counts the requests that
met every objective they had: DistServe's and ``vllm bench serve --goodput``'s measure of
goodput. Time per output token is vLLM's: (last token - first token) / (tokens - 1), met by
a one-token answer. Requests that fail are not counted here (``pdserve_gateway_requests``
counts them by outcome); they are never good.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from gateway.errors import InvalidRequest

TTFT_HEADER = "x-pdserve-slo-ttft-ms"
TPOT_HEADER = "x-pdserve-slo-tpot-ms"


@dataclass(frozen=True)
class Slo:
    """Objectives in seconds (None: no such objective)."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    @classmethod
    def from_ms(cls, ttft_ms: float, tpot_ms: float) -> Slo:
        return cls(ttft_ms / 1000 if ttft_ms else None, tpot_ms / 1000 if tpot_ms else None)

    def with_headers(self, headers: Mapping[str, str]) -> Slo:
        """This, with the objectives a request's headers (or gRPC metadata) set; a value that
        is not a positive number of milliseconds is a 400 naming the header."""
        return Slo(
            _header(headers, TTFT_HEADER, self.ttft_s), _header(headers, TPOT_HEADER, self.tpot_s)
        )

    def outcomes(self, ttft_s: float, tpot_s: float) -> dict[str, bool]:
        """Whether each objective this has was met (and ``all``: every one), or {}."""
        met = {}
        if self.ttft_s is not None:
            met["ttft"] = ttft_s <= self.ttft_s
        if self.tpot_s is not None:
            met["tpot"] = tpot_s <= self.tpot_s
        if met:
            met["all"] = all(met.values())
        return met


def _header(headers: Mapping[str, str], name: str, default: float | None) -> float | None:
    value = headers.get(name)
    if value is None:
        return default
    try:
        ms = float(value)
    except ValueError:
        ms = math.nan
    if not (math.isfinite(ms) and ms > 0):
        raise InvalidRequest(
            f"{name} must be a positive number of milliseconds, not {value[:32]!r}"
        )
    return ms / 1000


def time_per_output_token(first_s: float, last_s: float, tokens: int) -> float:
    """vLLM's TPOT of one request: the time between its first and last token per further
    token (0 for a single token)."""
    return (last_s - first_s) / (tokens - 1) if tokens > 1 else 0.0
