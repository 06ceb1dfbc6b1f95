"""A CPU prefill worker computes one prompt's worth of tokens per step, so prompts that arrive
together finish one by one; decode workers and the benchmark's monolith keep vLLM's default;
the user's --max-num-batched-tokens stands."""

from __future__ import annotations

from pdserve.worker.engine import PREFILL_STEP_TOKENS, cpu_default_args
from tests.helpers import cpu_engine_args


def step_tokens(user: list[str], role: str = "") -> int | None:
    return cpu_engine_args(user, role).max_num_batched_tokens


def test_a_prefill_worker_steps_one_prompt_at_a_time_and_says_why() -> None:
    assert step_tokens([], "prefill") == PREFILL_STEP_TOKENS == 512
    assert any("--max-num-batched-tokens" in line for line in cpu_default_args([], "prefill")[1])


def test_decode_workers_and_the_monolith_keep_vllms_default() -> None:
    assert step_tokens([], "decode") is None
    assert step_tokens([]) is None
    assert not any("max-num-batched" in line for line in cpu_default_args([], "decode")[1])


def test_the_users_step_size_stands() -> None:
    assert step_tokens(["--max-num-batched-tokens", "2048"], "prefill") == 2048
    assert step_tokens(["--max-num-batched-tokens=1024"], "prefill") == 1024
    args, why = cpu_default_args(["--max-num-batched-tokens=1024"], "prefill")
    assert "--max-num-batched-tokens" not in args
    assert not any("max-num-batched" in line for line in why)
