"""A CPU engine runs its compiled graph by default, cached across starts; --enforce-eager
in the user's engine arguments still turns compilation off."""

from __future__ import annotations

from pdserve.worker.engine import cpu_compile_env, cpu_default_args, cpu_engine_env
from tests.helpers import cpu_engine_args


def parsed(user: list[str]) -> bool:
    return bool(cpu_engine_args(user).enforce_eager)


def test_the_default_is_the_compiled_graph_and_says_so() -> None:
    args, why = cpu_default_args([])
    assert "--enforce-eager" not in args
    assert any("compiled" in line for line in why)
    assert parsed([]) is False


def test_the_users_enforce_eager_stands() -> None:
    assert parsed(["--enforce-eager"]) is True
    assert not any("compiled" in line for line in cpu_default_args(["--enforce-eager"])[1])


def test_the_compile_cache_environment_keeps_what_is_set() -> None:
    env: dict[str, str] = {}
    cpu_compile_env(env)
    assert env == {"VLLM_USE_AOT_COMPILE": "0"}
    chosen = {"VLLM_USE_AOT_COMPILE": "1"}
    cpu_compile_env(chosen)
    assert chosen == {"VLLM_USE_AOT_COMPILE": "1"}


def test_a_cpu_engine_gets_both_the_compile_cache_and_tcmalloc() -> None:
    from pdserve.worker.engine import find_tcmalloc

    env: dict[str, str] = {}
    why, ok = cpu_engine_env(env)
    assert env["VLLM_USE_AOT_COMPILE"] == "0"
    assert ok and env["LD_PRELOAD"] == find_tcmalloc() and find_tcmalloc() in why
