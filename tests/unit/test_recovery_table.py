"""gateway.recovery, a request's life as a state machine: docs/reliability.md shows the very rows
of ``TABLE`` (a change to either alone fails here), each transition function decides as its row
and what is left say, and ``advance`` refuses every step the machine does not have."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway import recovery
from gateway.recovery import (
    ANY,
    TABLE,
    TRANSITIONS,
    Action,
    Failure,
    IllegalTransition,
    Phase,
    Transition,
    advance,
)
from protos.v1 import common_pb2

DOC = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"
SECTION = "## A request's states and what a failure in each does"
NAME = re.compile(r"`([A-Za-z_]+)`")


def doc_rows() -> list[tuple[Phase | None, Failure, str, tuple[Action, ...], str]]:
    """(state, failure, its description, actions, function) of each row of the doc's table."""
    section = DOC.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if not line.startswith("| ") or line.startswith("| state |"):
            continue
        state, failure, actions, function, _what = (c.strip() for c in line.strip("|").split("|"))
        name, _, said = failure.partition(": ")
        assert NAME.fullmatch(name), line
        assert actions == ", ".join(f"`{a}`" for a in NAME.findall(actions)), line
        assert NAME.fullmatch(function), line
        rows.append((
            ANY if state == "any" else Phase[state],
            Failure[name.strip("`")],
            said,
            tuple(Action[a] for a in NAME.findall(actions)),
            function.strip("`"),
        ))  # fmt: skip
    return rows


def test_the_doc_table_has_the_rows_of_the_code_table() -> None:
    rows = doc_rows()
    documented = {(phase, failure): actions for phase, failure, _, actions, _ in rows}
    assert len(documented) == len(rows), "a (state, failure) is listed twice"
    assert documented == TABLE


def test_the_doc_names_each_rows_transition_function_and_its_failure() -> None:
    for _, failure, said, _, function in doc_rows():
        assert function == TRANSITIONS[failure].__name__
        assert getattr(recovery, function) is TRANSITIONS[failure]
        assert said == failure.value
    assert set(TRANSITIONS) == set(Failure)


# --- the normal steps ---

LEGAL = {
    (Phase.ADMITTED, Phase.PREFILLING),
    (Phase.ADMITTED, Phase.DECODING),  # the local path
    (Phase.PREFILLING, Phase.KV_STAGED),
    (Phase.KV_STAGED, Phase.DECODING),
    (Phase.DECODING, Phase.DONE),
}


def test_the_normal_paths_advance() -> None:
    for path in (
        [Phase.ADMITTED, Phase.PREFILLING, Phase.KV_STAGED, Phase.DECODING, Phase.DONE],
        [Phase.ADMITTED, Phase.DECODING, Phase.DONE],
    ):
        phase = path[0]
        for to in path[1:]:
            phase = advance(phase, to)
        assert phase is Phase.DONE


@pytest.mark.parametrize(
    ("phase", "to"), [p for p in itertools.product(Phase, Phase) if p not in LEGAL]
)
def test_every_other_step_is_refused(phase: Phase, to: Phase) -> None:
    with pytest.raises(IllegalTransition):
        advance(phase, to)


# --- the transition functions ---


def test_prefill_failure_retries_elsewhere_then_applies_the_policy() -> None:
    p = Phase.PREFILLING
    decide = recovery.on_prefill_failed
    retry = Transition(Action.RETRY_PREFILL, Phase.PREFILLING)
    local = Transition(Action.LOCAL, Phase.ADMITTED)
    abort = Transition(Action.ABORT, Phase.DONE)
    assert decide(p, retries_left=1, another=True, policy="local") == retry
    assert decide(p, retries_left=1, another=True, policy="fail") == retry
    assert decide(p, retries_left=0, another=True, policy="local") == local  # none left
    assert decide(p, retries_left=1, another=False, policy="local") == local  # no other worker
    assert decide(p, retries_left=0, another=True, policy="fail") == abort
    assert decide(p, retries_left=1, another=False, policy="fail") == abort


def test_a_prefill_without_a_handoff_goes_local_whatever_the_policy() -> None:
    assert recovery.on_no_handoff(Phase.PREFILLING) == (Action.LOCAL, Phase.ADMITTED)


@pytest.mark.parametrize("phase", [Phase.ADMITTED, Phase.KV_STAGED])
def test_decode_failure_before_the_first_token_retries_in_the_same_phase(phase: Phase) -> None:
    decide = recovery.on_decode_failed_before_first_token
    assert decide(phase, retries_left=1, another=True) == (Action.RETRY_DECODE, phase)
    assert decide(phase, retries_left=0, another=True) == (Action.ABORT, Phase.DONE)
    assert decide(phase, retries_left=2, another=False) == (Action.ABORT, Phase.DONE)


def test_a_handoff_that_cannot_be_pulled_goes_local_under_policy_local_only() -> None:
    decide = recovery.on_pull_failed
    assert decide(Phase.KV_STAGED, policy="local") == (Action.LOCAL, Phase.ADMITTED)
    assert decide(Phase.KV_STAGED, policy="fail") == (Action.ABORT, Phase.DONE)


def test_a_lost_stream_migrates_while_a_migration_and_a_worker_are_left() -> None:
    def decide(left: int, structured: bool = False, another: bool | None = None) -> Action:
        return recovery.on_stream_lost(
            Phase.DECODING, migrations_left=left, structured=structured, another=another
        ).action

    assert recovery.on_stream_lost(
        Phase.DECODING, migrations_left=2, structured=False, another=None
    ) == (Action.MIGRATE, Phase.ADMITTED)
    assert decide(1, another=True) is Action.MIGRATE
    assert decide(0) is Action.ABORT  # none left
    assert decide(0, another=True) is Action.ABORT
    assert decide(2, another=False) is Action.ABORT  # no other decode worker
    assert decide(2, structured=True) is Action.ABORT
    assert decide(2, structured=True, another=True) is Action.ABORT


def test_structured_output_is_what_cannot_migrate() -> None:
    plain = common_pb2.SamplingParams(max_tokens=8)
    constrained = common_pb2.SamplingParams(max_tokens=8)
    constrained.structured_output.regex = "[0-9]+"
    assert recovery.migratable(plain) == ""
    assert recovery.migratable(constrained)


@pytest.mark.parametrize("phase", list(Phase))
def test_invalid_and_early_ends_abort_in_every_phase(phase: Phase) -> None:
    assert recovery.on_invalid(phase) == (Action.ABORT, Phase.DONE)
    assert recovery.on_ended_early(phase) == (Action.ABORT, Phase.DONE)


def test_an_engine_error_aborts() -> None:
    assert recovery.on_engine_error(Phase.DECODING) == (Action.ABORT, Phase.DONE)


@pytest.mark.parametrize(
    "call",
    [
        lambda: recovery.on_prefill_failed(
            Phase.KV_STAGED, retries_left=1, another=True, policy="local"
        ),
        lambda: recovery.on_no_handoff(Phase.DECODING),
        lambda: recovery.on_decode_failed_before_first_token(
            Phase.DECODING, retries_left=1, another=True
        ),
        lambda: recovery.on_pull_failed(Phase.ADMITTED, policy="local"),
        lambda: recovery.on_stream_lost(
            Phase.KV_STAGED, migrations_left=1, structured=False, another=True
        ),
        lambda: recovery.on_engine_error(Phase.PREFILLING),
    ],
)
def test_a_failure_in_a_phase_without_its_row_is_refused(call: Callable[[], Transition]) -> None:
    with pytest.raises(IllegalTransition):
        call()


def every_decision() -> list[tuple[Phase, Failure, Transition]]:
    """Each transition function's answer for every phase of its rows and every input."""
    answers = []
    for (row_phase, failure), _ in TABLE.items():
        for phase in list(Phase) if row_phase is ANY else [row_phase]:
            fn = TRANSITIONS[failure]
            if failure is Failure.PREFILL_FAILED:
                inputs = [
                    {"retries_left": n, "another": a, "policy": p}
                    for n, a, p in itertools.product((0, 1), (False, True), ("local", "fail"))
                ]
            elif failure is Failure.DECODE_FAILED:
                inputs = [
                    {"retries_left": n, "another": a}
                    for n, a in itertools.product((0, 1), (False, True))
                ]
            elif failure is Failure.PULL_FAILED:
                inputs = [{"policy": p} for p in ("local", "fail")]
            elif failure is Failure.STREAM_LOST:
                inputs = [
                    {"migrations_left": n, "structured": s, "another": a}
                    for n, s, a in itertools.product((0, 1), (False, True), (None, False, True))
                ]
            else:
                inputs = [{}]
            answers += [(phase, failure, fn(phase, **kwargs)) for kwargs in inputs]
    return answers


def test_every_decision_is_an_action_of_its_row_and_leads_to_its_phase() -> None:
    seen: dict[tuple[Phase | None, Failure], set[Action]] = {}
    for phase, failure, (action, after) in every_decision():
        key = (phase, failure) if (phase, failure) in TABLE else (ANY, failure)
        assert action in TABLE[key]
        assert after is (recovery.AFTER[action] or phase)
        seen.setdefault(key, set()).add(action)
    assert {key: set(actions) for key, actions in TABLE.items()} == seen  # every action reachable
