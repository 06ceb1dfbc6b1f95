"""What a request does when a worker fails: the one table of states and recovery actions.

A generation moves ADMITTED -> PREFILLING -> KV_STAGED -> DECODING -> DONE (the local path
skips KV_STAGED). A worker failure in each state leads to exactly one action:

- PREFILLING, the prefill worker fails: another prefill worker (``prefill_retries``, with
  backoff); then ``prefill_failure_policy``: "local" (the decode worker computes the prompt)
  or "fail" (503; 504 when it timed out).
- KV_STAGED, the decode worker fails before its first token: another compatible decode worker
  with the same hand-off, still leased (``decode_retries``).
- KV_STAGED, the KV pull fails (the hand-off is gone): the local path on the decode worker
  (policy "local").
- DECODING, the decode worker dies, hangs (no token for ``inter_token_timeout_s``) or is
  ejected by the pool: migration. The prompt and the tokens so far are prefilled again and
  decoding goes on on another decode worker (``max_migrations``); the client's stream goes on.
- Any state, the client goes away, the request is refused as invalid, or no retry is left:
  ``Abort`` to every worker the request touched; the outcome is counted once.

Every attempt uses a fresh internal request id; a failed attempt's workers are sent ``Abort``
at once (its decode worker, and its prefill worker unless a retry still uses the hand-off), so
nothing stays pinned. A worker that fails is ejected by the pool's circuit breaker
(``WorkerPool.mark_failed``) and requests streaming from it move on.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Sequence
from typing import TypeVar

from protos.v1 import common_pb2


class Phase(enum.Enum):
    ADMITTED = "admitted"
    PREFILLING = "prefilling"
    KV_STAGED = "kv_staged"
    DECODING = "decoding"
    DONE = "done"


W = TypeVar("W")


def alternative(
    candidates: Sequence[W],
    tried: Collection[W],
    load: Callable[[W], float],
    fits: Callable[[W], bool] = lambda _: True,
) -> W | None:
    """The least-loaded candidate not yet tried that ``fits`` (None when there is none)."""
    left = [w for w in candidates if w not in tried and fits(w)]
    return min(left, key=load) if left else None


def backoff_s(base_s: float, retry: int) -> float:
    """Wait before retry number ``retry`` (1, 2, ...): ``base_s`` doubling, at most 5 s."""
    return min(5.0, base_s * 2 ** max(0, retry - 1))


def migratable(params: common_pb2.SamplingParams) -> str:
    """Why a request cannot continue on another worker mid-stream ("" when it can).

    A constrained output's grammar state lives in the engine that generated the tokens so
    far; another engine cannot resume it from a prompt."""
    if params.HasField("structured_output") and params.structured_output.WhichOneof("kind"):
        return "a structured-output request cannot resume on another worker"
    return ""


def continuation(params: common_pb2.SamplingParams, generated: int) -> common_pb2.SamplingParams:
    """The sampling parameters of the rest of a generation after ``generated`` tokens.

    ``max_tokens``/``min_tokens`` count what is left. Penalties that count output tokens
    (presence, frequency) start over on the new worker: only with them does a greedy
    continuation's output differ from an uninterrupted run."""
    rest = common_pb2.SamplingParams()
    rest.CopyFrom(params)
    if params.max_tokens:
        rest.max_tokens = max(1, params.max_tokens - generated)
    rest.min_tokens = max(0, params.min_tokens - generated)
    return rest
