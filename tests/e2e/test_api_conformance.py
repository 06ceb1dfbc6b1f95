"""pdserve answers as plain ``vllm serve`` answers: the battery of tests/e2e/conformance.py sent
to a monolithic ``vllm serve`` (the ``vllm_serve_answers`` fixture: started alone, before the
shared cluster, with pdserve's CPU engine arguments, the e2e dtype and vLLM's hermes tool
parser) and then to the shared cluster, compared field by field."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from tests.e2e import conformance
from tests.e2e.conftest import RealCluster
from tests.helpers import served_name


def test_pdserve_answers_the_battery_as_vllm_serve(
    vllm_serve_answers: dict[str, Any], cluster: RealCluster, lora_adapters: tuple[str, str]
) -> None:
    ours = asyncio.run(conformance.answers(cluster.base_url, served_name(), lora_adapters[1]))
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
