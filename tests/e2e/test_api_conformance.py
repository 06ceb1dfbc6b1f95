"""pdserve answers as plain ``vllm serve`` answers: the battery of tests/e2e/conformance.py sent
to a monolithic ``vllm serve`` (started first, alone, with pdserve's CPU engine arguments, the
e2e dtype and vLLM's hermes tool parser) and then to the shared cluster, compared field by
field. The file's name puts it first among the shared cluster's tests, so that ``vllm serve``
runs and stops before that cluster starts (this machine has no memory for both)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from pdserve.bench.systems import _wait_http, child_process, monolith_argv
from tests.e2e import conformance
from tests.e2e.cases import DTYPE
from tests.e2e.conftest import RealCluster, free_port_run
from tests.helpers import model_dir, served_name

SERVE_ARGS = f"--dtype {DTYPE} --tool-call-parser hermes --enable-auto-tool-choice"


@pytest.fixture(scope="session")
def vllm_serve_answers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The battery's answers from ``vllm serve`` (started and stopped here)."""
    from pdserve.worker.engine import cpu_engine_env

    log: Path = tmp_path_factory.mktemp("vllm-serve") / "vllm-serve.log"
    port = free_port_run(1)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    cpu_engine_env(env)
    argv = monolith_argv(model_dir(), served_name(), port, engine_args=SERVE_ARGS)
    with child_process(argv, env, log) as process:
        try:
            _wait_http(f"http://127.0.0.1:{port}/health", process, 600, "vllm serve")
        except RuntimeError as err:
            pytest.fail(f"{err}:\n{log.read_text(errors='replace')[-3000:]}")
        return asyncio.run(conformance.answers(f"http://127.0.0.1:{port}", served_name()))


def test_pdserve_answers_the_battery_as_vllm_serve(
    vllm_serve_answers: dict[str, Any], cluster: RealCluster
) -> None:
    ours = asyncio.run(conformance.answers(cluster.base_url, served_name()))
    both = {"vllm_serve": vllm_serve_answers, "pdserve": ours}
    (cluster.log_dir / "conformance.json").write_text(json.dumps(both, indent=1))
    found = []
    for name in conformance.BATTERY:
        reference = conformance.project(vllm_serve_answers[name])
        mine = conformance.project(ours[name])
        for difference in conformance.differences(reference, mine):
            if not conformance.intended(name, difference):
                found.append(f"{name}{difference}")
    assert not found, "pdserve differs from vllm serve:\n" + "\n".join(found)
