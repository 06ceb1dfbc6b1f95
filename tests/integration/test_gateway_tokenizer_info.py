"""``GET /tokenizer_info`` (``gateway.tokenizer_info``): served only with vLLM's flag, built by
vLLM's own code. That its body equals ``vllm serve``'s is the e2e conformance battery's case
``tokenizer_info`` (tests/e2e/conformance.py)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from tests.helpers import gateway_cluster, model_dir


async def test_tokenizer_info_is_vllms_and_only_with_the_flag() -> None:
    async with gateway_cluster() as c, httpx.AsyncClient(base_url=c.base_url) as http:
        assert (await http.get("/tokenizer_info")).status_code == 404
    served = gateway_cluster(enable_tokenizer_info_endpoint=True)
    async with served as c, httpx.AsyncClient(base_url=c.base_url, timeout=120) as http:
        response = await http.get("/tokenizer_info")
    assert response.status_code == 200
    body = response.json()
    config = json.loads((Path(model_dir()) / "tokenizer_config.json").read_text())
    # vLLM's wrapper class, the tokenizer's own settings, no file paths
    assert body["tokenizer_class"].endswith("CachedTokenizersBackend"), body["tokenizer_class"]
    assert body["model_max_length"] == config["model_max_length"]
    assert body["eos_token"] == config["eos_token"]
    assert "vocab_file" not in body and "merges_file" not in body
