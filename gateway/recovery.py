"""A request's life as a state machine: its phases, what can fail in each, what happens then.

A generation moves ADMITTED -> PREFILLING -> KV_STAGED -> DECODING -> DONE; the local path
(no prefill worker) goes ADMITTED -> DECODING. ``advance`` is the only way along that line and
refuses any other step (a programming error).

A failure is decided by ``TABLE``, the one table (docs/reliability.md shows the same rows, and
tests/unit/test_recovery_table.py keeps them equal): for a (phase, failure) it lists the actions
in the order they are tried. Each failure has one transition function (``on_prefill_failed``,
``on_decode_failed_before_first_token``, ``on_pull_failed``, ``on_stream_lost``, ...) that is
given what is left (retries, ``prefill_failure_policy``, migrations, a structured output) and
returns the first action of the row that is still possible, with the phase the request is in
while it runs:

- RETRY_PREFILL: another prefill worker, after a backoff (PREFILLING again);
- RETRY_DECODE: another compatible decode worker with the same hand-off, still leased;
- LOCAL: the decode worker computes the prompt: the local path, from ADMITTED;
- MIGRATE: the prompt and the tokens so far are admitted again as a new prompt and decoding goes
  on on another decode worker; the client's stream goes on;
- ABORT: the request ends with its error; ``Generation.abandon`` sends ``Abort`` to every worker
  the request touched, counts the outcome once and moves it to DONE.

Every attempt uses a fresh internal request id; a failed attempt's workers are sent ``Abort``
at once (its decode worker, and its prefill worker unless a retry still uses the hand-off), so
nothing stays pinned. A worker that fails is ejected by the pool's circuit breaker
(``WorkerPool.mark_failed``) and requests streaming from it move on.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import NamedTuple, TypeVar

from protos.v1 import common_pb2


class Phase(enum.Enum):
    ADMITTED = "admitted"
    PREFILLING = "prefilling"
    KV_STAGED = "kv_staged"
    DECODING = "decoding"
    DONE = "done"


class Failure(enum.Enum):
    PREFILL_FAILED = "the prefill worker dies, refuses, times out or is ejected"
    NO_HANDOFF = "the prefill worker answers without a KV hand-off"
    DECODE_FAILED = "the decode worker fails before its first token"
    PULL_FAILED = "the KV pull fails, or a failed decode worker may have spent the hand-off"
    STREAM_LOST = "the decode worker dies, hangs or is ejected mid-stream"
    ENGINE_ERROR = "the decode worker finishes the stream with an error"
    INVALID = "a worker refuses the request as invalid"
    ENDED_EARLY = "the client goes away, or the request ends with an error"


class Action(enum.Enum):
    RETRY_PREFILL = "retry_prefill"
    RETRY_DECODE = "retry_decode"
    LOCAL = "local"
    MIGRATE = "migrate"
    ABORT = "abort"


ANY = None  # a row that holds in every phase

# THE table: (phase, failure) -> the actions, in the order they are tried.
TABLE: dict[tuple[Phase | None, Failure], tuple[Action, ...]] = {
    (Phase.PREFILLING, Failure.PREFILL_FAILED): (Action.RETRY_PREFILL, Action.LOCAL, Action.ABORT),
    (Phase.PREFILLING, Failure.NO_HANDOFF): (Action.LOCAL,),
    (Phase.ADMITTED, Failure.DECODE_FAILED): (Action.RETRY_DECODE, Action.ABORT),
    (Phase.KV_STAGED, Failure.DECODE_FAILED): (Action.RETRY_DECODE, Action.ABORT),
    (Phase.KV_STAGED, Failure.PULL_FAILED): (Action.LOCAL, Action.ABORT),
    (Phase.DECODING, Failure.STREAM_LOST): (Action.MIGRATE, Action.ABORT),
    (Phase.DECODING, Failure.ENGINE_ERROR): (Action.ABORT,),
    (ANY, Failure.INVALID): (Action.ABORT,),
    (ANY, Failure.ENDED_EARLY): (Action.ABORT,),
}

# The normal steps (``advance``); every other change of phase is a recovery's.
NEXT: dict[Phase, frozenset[Phase]] = {
    Phase.ADMITTED: frozenset({Phase.PREFILLING, Phase.DECODING}),
    Phase.PREFILLING: frozenset({Phase.KV_STAGED}),
    Phase.KV_STAGED: frozenset({Phase.DECODING}),
    Phase.DECODING: frozenset({Phase.DONE}),
    Phase.DONE: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A step the state machine does not have: a programming error, never a worker's."""


class Transition(NamedTuple):
    action: Action
    phase: Phase  # the phase the request is in while the action runs (DONE: it ends)

    @property
    def aborts(self) -> bool:
        return self.action is Action.ABORT


def advance(phase: Phase, to: Phase) -> Phase:
    """The normal step from ``phase`` to ``to``; raises ``IllegalTransition`` for any other."""
    if to not in NEXT[phase]:
        raise IllegalTransition(f"no step {phase.name} -> {to.name}")
    return to


def actions(phase: Phase, failure: Failure) -> tuple[Action, ...]:
    """The table's row for ``failure`` in ``phase`` (``IllegalTransition`` when it has none)."""
    row = TABLE.get((phase, failure)) or TABLE.get((ANY, failure))
    if row is None:
        raise IllegalTransition(f"{failure.name} cannot happen in {phase.name}")
    return row


# The phase a request is in while an action runs (None: the phase it failed in).
AFTER: dict[Action, Phase | None] = {
    Action.RETRY_PREFILL: Phase.PREFILLING,
    Action.RETRY_DECODE: None,  # the same hand-off (KV_STAGED), or the local path (ADMITTED)
    Action.LOCAL: Phase.ADMITTED,  # the local path: ADMITTED -> DECODING
    Action.MIGRATE: Phase.ADMITTED,  # the prompt and the tokens so far, admitted again
    Action.ABORT: Phase.DONE,  # through Generation.abandon
}


def _decide(phase: Phase, failure: Failure, possible: Mapping[Action, bool]) -> Transition:
    """The first action of the row that ``possible`` allows, and the phase it leads to."""
    for action in actions(phase, failure):
        if possible.get(action, False):
            return Transition(action, AFTER[action] or phase)
    raise IllegalTransition(f"no action of {failure.name} in {phase.name} applies")


def on_prefill_failed(phase: Phase, *, retries_left: int, another: bool, policy: str) -> Transition:
    """Another prefill worker while a retry is left and one is there; then
    ``prefill_failure_policy``: "local" computes the prompt on the decode worker, "fail" aborts
    (503; 504 when it timed out)."""
    possible = {
        Action.RETRY_PREFILL: retries_left > 0 and another,
        Action.LOCAL: policy == "local",
        Action.ABORT: True,
    }
    return _decide(phase, Failure.PREFILL_FAILED, possible)


def on_no_handoff(phase: Phase) -> Transition:
    """A prefill answered without a hand-off: the decode worker computes the prompt."""
    return _decide(phase, Failure.NO_HANDOFF, {Action.LOCAL: True})


def on_decode_failed_before_first_token(
    phase: Phase, *, retries_left: int, another: bool
) -> Transition:
    """Another compatible decode worker (the same hand-off) while a retry is left and one is
    there; else abort."""
    possible = {
        Action.RETRY_DECODE: retries_left > 0 and another,
        Action.ABORT: True,
    }
    return _decide(phase, Failure.DECODE_FAILED, possible)


def on_pull_failed(phase: Phase, *, policy: str) -> Transition:
    """The hand-off can no longer be pulled: the local path under policy "local", else abort."""
    return _decide(
        phase, Failure.PULL_FAILED, {Action.LOCAL: policy == "local", Action.ABORT: True}
    )


def on_stream_lost(
    phase: Phase, *, migrations_left: int, structured: bool, another: bool | None
) -> Transition:
    """Migrate while a migration is left, the output is not structured (its grammar state lives
    in the engine that generated it) and another decode worker is there (``another`` None: not
    looked for yet, the lost stream is closed first); else abort."""
    possible = {
        Action.MIGRATE: migrations_left > 0 and not structured and another is not False,
        Action.ABORT: True,
    }
    return _decide(phase, Failure.STREAM_LOST, possible)


def on_engine_error(phase: Phase) -> Transition:
    """The engine itself reported an error: no other worker is tried."""
    return _decide(phase, Failure.ENGINE_ERROR, {Action.ABORT: True})


def on_invalid(phase: Phase) -> Transition:
    """A request a worker refuses is refused by every worker: never retried (400)."""
    return _decide(phase, Failure.INVALID, {Action.ABORT: True})


def on_ended_early(phase: Phase) -> Transition:
    """The request ends before its finish, whatever the cause: abort, then DONE."""
    return _decide(phase, Failure.ENDED_EARLY, {Action.ABORT: True})


# The transition function of each failure (the docs' table names them).
TRANSITIONS: dict[Failure, Callable[..., Transition]] = {
    Failure.PREFILL_FAILED: on_prefill_failed,
    Failure.NO_HANDOFF: on_no_handoff,
    Failure.DECODE_FAILED: on_decode_failed_before_first_token,
    Failure.PULL_FAILED: on_pull_failed,
    Failure.STREAM_LOST: on_stream_lost,
    Failure.ENGINE_ERROR: on_engine_error,
    Failure.INVALID: on_invalid,
    Failure.ENDED_EARLY: on_ended_early,
}

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
