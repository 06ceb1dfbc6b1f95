"""A worker's engine environment for core lending (pdserve.worker.engine.lending_env)."""

from __future__ import annotations

import pytest

from pdserve.worker import vllm_plugin
from pdserve.worker.config import WorkerSettings
from pdserve.worker.engine import BORROWER_SPIN_COUNT, lending_env


class _Decode(WorkerSettings):
    @property
    def role(self) -> str:  # type: ignore[override]
        return "decode"


def settings(**values: str) -> WorkerSettings:
    return _Decode.model_validate({"cpu_lending": "/run/table", **values})


def test_a_lender_keeps_vllm_binding_and_names_its_cores() -> None:
    env, line = lending_env(settings(cpu_cores="0"))
    assert env == {vllm_plugin.LENDING_ENV: "/run/table", vllm_plugin.LEND_ENV: "0"}
    assert "cores 0 lent" in line


def test_a_borrower_binds_its_own_threads_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    env, line = lending_env(settings(cpu_cores="1", cpu_borrow="0"))
    assert env == {
        vllm_plugin.LENDING_ENV: "/run/table",
        vllm_plugin.OWN_ENV: "1",
        vllm_plugin.BORROW_ENV: "0",
        # vLLM would bind in ascending order (the model runner's thread on core 0, the
        # prefill engine's): the worker binds the threads itself, its own core first.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "2",
        "GOMP_CPU_AFFINITY": "1 0",
        # Idle threads spin briefly, then sleep: the gateway and workers need the cores too.
        "GOMP_SPINCOUNT": BORROWER_SPIN_COUNT,
    }
    assert "on cores 1, and on 0 too" in line


def test_a_borrower_leaves_out_its_own_cores_from_those_it_borrows() -> None:
    env, _ = lending_env(settings(cpu_cores="2-3", cpu_borrow="0-2"))
    assert env[vllm_plugin.BORROW_ENV] == "0-1"
    assert env["GOMP_CPU_AFFINITY"] == "2 3 0 1"
    assert env["OMP_NUM_THREADS"] == "4"


def test_the_users_spin_count_stands(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOMP_SPINCOUNT", "INFINITY")
    env, _ = lending_env(settings(cpu_cores="1", cpu_borrow="0"))
    assert env["GOMP_SPINCOUNT"] == "INFINITY"
    lender, _ = lending_env(settings(cpu_cores="0"))
    assert "GOMP_SPINCOUNT" not in lender  # an engine of one thread has none that spin


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"cpu_cores": ""}, "needs the engine's own --cpu-cores"),
        ({"cpu_cores": "nobind"}, "needs the engine's own --cpu-cores"),
        ({"cpu_cores": "1", "cpu_borrow": "1"}, "names only the engine's own cores"),
        ({"cpu_cores": "1", "cpu_borrow": "x"}, "not a list of CPU cores"),
    ],
)
def test_settings_that_cannot_lend_are_refused(values: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        lending_env(settings(**values))
