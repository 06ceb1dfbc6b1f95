"""What a generation yields to its transport adapters: token deltas and one final ``Finish``."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.errors import (
    GatewayError,
    NoWorkerAvailable,
    Overloaded,
    WorkerFailed,
    WorkerTimedOut,
)
from protos.v1 import common_pb2

PATH_DISAGGREGATED = "disaggregated"
PATH_LOCAL = "local"
# a further choice of an n > 1 request, from its first choice's KV on the same decode worker
PATH_SIBLING = "sibling"


@dataclass(frozen=True)
class TokenDelta:
    """Newly generated tokens and their text (text may be empty while a character is partial);
    ``logprobs`` one per token when the request asked for them."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[common_pb2.TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Finish:
    """The last event of a generation."""

    finish_reason: str  # "stop", "length" or "abort"
    # The stop string (str) or stop token id (int) that ended generation; None: neither.
    stop_reason: str | int | None
    usage: Usage
    path: str  # PATH_DISAGGREGATED, PATH_LOCAL or PATH_SIBLING
    prefill_worker: str  # address, or "local"
    decode_worker: str
    transfer: common_pb2.TransferStats


Event = TokenDelta | Finish


def outcome_for(err: GatewayError) -> str:
    """The metrics ``outcome`` label of a failed request."""
    if isinstance(err, WorkerTimedOut):
        return "timeout"
    if isinstance(err, WorkerFailed):
        return "error"
    if isinstance(err, NoWorkerAvailable):
        return "unavailable"
    if isinstance(err, Overloaded):
        return "overloaded"
    return "invalid"
