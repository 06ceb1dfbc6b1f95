"""KV integrity and internal authentication on the real cluster (``pdserve up``: real vLLM
prefill and decode workers that share the secret ``pdserve up`` wrote into its log directory).

The test talks to the workers directly, as the gateway does, to send what a buggy or hostile
caller would: the hand-off of one prompt with another prompt.
"""

from __future__ import annotations

import json
import random
import re
import uuid
from pathlib import Path
from typing import Any

import pytest

from decode_service.client import DecodeClient
from kv_transfer import seal
from kv_transfer.auth import AuthenticationFailed, load_secret
from kv_transfer.client import release
from pdserve.rpc.client import RpcCallError
from prefill_service.client import PrefillClient
from protos.v1 import common_pb2, worker_pb2
from tests.e2e.conftest import RealCluster

PROMPT_TOKENS = 300  # two full blocks and a partial one


def worker_flag(cluster: RealCluster, worker: str, flag: str) -> int:
    """A port from the worker's command line, as ``pdserve up`` logged it."""
    header = (cluster.log_dir / f"{worker}.log").read_text().splitlines()[0]
    match = re.search(rf"{flag} (\d+)", header)
    assert match, header
    return int(match.group(1))


def fresh_prompt() -> list[int]:
    """Token ids no earlier request used, so no prefix cache holds them."""
    rng = random.Random(uuid.uuid4().int)
    return [rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)]


async def decode_all(
    client: DecodeClient,
    request_id: str,
    prompt: list[int],
    handoff: worker_pb2.KvTransferParams | None,
) -> tuple[list[int], worker_pb2.DecodeChunk]:
    params = common_pb2.SamplingParams(max_tokens=12, temperature=0.0)
    tokens: list[int] = []
    last = None
    async for chunk in client.decode(request_id, prompt, params, handoff, timeout=300):
        tokens.extend(chunk.token_ids)
        last = chunk
    assert last is not None and last.finish_reason
    return tokens, last


async def test_a_hand_off_for_another_prompt_is_refused_and_nothing_is_cached(
    cluster: RealCluster,
) -> None:
    secret, tls = load_secret(cluster.log_dir / "secret"), cluster.worker_tls
    prefill = f"127.0.0.1:{worker_flag(cluster, 'prefill-0', '--port')}"
    decode = f"127.0.0.1:{worker_flag(cluster, 'decode-0', '--port')}"
    prompt_a, prompt_b = fresh_prompt(), fresh_prompt()
    params = common_pb2.SamplingParams(max_tokens=1, temperature=0.0)
    async with (
        PrefillClient(prefill, secret=secret, tls=tls, default_timeout_s=300) as p,
        DecodeClient(decode, secret=secret, tls=tls) as d,
    ):
        handoff_a = (await p.prefill(f"a-{uuid.uuid4()}", prompt_a, params)).kv_transfer_params
        # A's blocks with B's prompt (same block count): refused before the engine.
        with pytest.raises(RpcCallError) as info:
            await decode_all(d, f"b-{uuid.uuid4()}", prompt_b, handoff_a)
        assert info.value.code == "INVALID_ARGUMENT", info.value
        assert "another prompt" in info.value.details
        # Re-pointing A's hand-off at B without the secret breaks its seal: refused too.
        forged = worker_pb2.KvTransferParams()
        forged.CopyFrom(handoff_a)
        extra = json.loads(forged.extra_json)
        extra[seal.DIGEST] = seal.prompt_digest(prompt_b)
        forged.extra_json = json.dumps(extra)
        with pytest.raises(RpcCallError) as info:
            await decode_all(d, f"b-{uuid.uuid4()}", prompt_b, forged)
        assert info.value.code == "INVALID_ARGUMENT" and "not signed" in info.value.details
        # Nothing of A was cached under B's hashes: B computed locally finds no cached token.
        reference, final = await decode_all(d, f"b-{uuid.uuid4()}", prompt_b, None)
        assert final.usage.cached_tokens == 0, final.usage
        # B's own hand-off is accepted: every prompt token is either pulled or already held.
        # (Its greedy text is not compared with B computed locally: the last prompt token
        # computed alone against transferred KV takes another bf16 kernel than a whole prompt
        # and may round differently; parity with a monolithic engine on fixed prompts is
        # test_disaggregated's.)
        handoff_b = (await p.prefill(f"b-{uuid.uuid4()}", prompt_b, params)).kv_transfer_params
        tokens, final = await decode_all(d, f"b-{uuid.uuid4()}", prompt_b, handoff_b)
        assert len(tokens) == len(reference) > 0
        assert final.transfer.prompt_tokens_computed == 1, final.transfer
        assert final.transfer.kv_tokens_received + final.transfer.local_cached_tokens == (
            PROMPT_TOKENS
        )


async def test_workers_refuse_calls_and_kv_connections_without_the_secret(
    cluster: RealCluster, tmp_path: Path
) -> None:
    decode = f"127.0.0.1:{worker_flag(cluster, 'decode-0', '--port')}"
    wrong_file = tmp_path / "wrong"
    wrong_file.write_text("w" * 64)
    tls = cluster.worker_tls
    assert tls is not None, "pdserve up runs the cluster with mutual TLS by default"
    # A certificate of the cluster's CA does not do without the secret (defence in depth).
    for secret in (None, load_secret(wrong_file)):
        async with DecodeClient(decode, secret=secret, tls=tls) as client:
            with pytest.raises(RpcCallError) as info:
                await client.capabilities()
            assert info.value.code == "UNAUTHENTICATED"
        with pytest.raises(AuthenticationFailed):
            release("127.0.0.1", worker_flag(cluster, "prefill-0", "--kv-port"), "x", secret=secret)


async def test_workers_refuse_clients_without_a_certificate_of_the_clusters_ca(
    cluster: RealCluster,
) -> None:
    """The secret does not do without a certificate: plain text is refused in the handshake."""
    secret = load_secret(cluster.log_dir / "secret")
    for role, client_class in (("prefill-0", PrefillClient), ("decode-0", DecodeClient)):
        address = f"127.0.0.1:{worker_flag(cluster, role, '--port')}"
        async with client_class(address, secret=secret, tls=None) as client:
            with pytest.raises(RpcCallError) as info:
                await client.capabilities(timeout=5)
            assert info.value.code == "UNAVAILABLE", info.value
        async with client_class(address, secret=secret, tls=cluster.worker_tls) as client:
            assert (await client.capabilities(timeout=5)).worker_id == role


async def test_a_cache_salt_keeps_kv_apart_on_both_workers(cluster: RealCluster) -> None:
    """vLLM's cache_salt through pdserve: the same prompt under another salt (or none) finds
    nothing cached, on the prefill worker, on the decode worker and after a KV transfer. Each
    part has a prompt of its own: the suite's shared KV tier rightly serves a prompt computed
    without a salt on one worker to a request without a salt on another."""
    secret, tls = load_secret(cluster.log_dir / "secret"), cluster.worker_tls
    prefill = f"127.0.0.1:{worker_flag(cluster, 'prefill-1', '--port')}"
    decode = f"127.0.0.1:{worker_flag(cluster, 'decode-1', '--port')}"
    full = PROMPT_TOKENS // 128 * 128

    def params(salt: str | None) -> common_pb2.SamplingParams:
        return common_pb2.SamplingParams(max_tokens=1, temperature=0.0, cache_salt=salt)

    async with (
        PrefillClient(prefill, secret=secret, tls=tls, default_timeout_s=300) as p,
        DecodeClient(decode, secret=secret, tls=tls) as d,
    ):

        async def prefilled(prompt: list[int], salt: str | None) -> worker_pb2.PrefillResponse:
            return await p.prefill(f"s-{uuid.uuid4()}", prompt, params(salt))

        async def decoded(
            prompt: list[int], salt: str | None, handoff: Any = None
        ) -> worker_pb2.DecodeChunk:
            last = None
            async for chunk in d.decode(f"s-{uuid.uuid4()}", prompt, params(salt), handoff):
                last = chunk
            assert last is not None and last.finish_reason
            return last

        # the prefill worker's own cache
        prompt = fresh_prompt()
        cached = [(await prefilled(prompt, s)).cached_tokens for s in ("a", "a", "b", None)]
        assert cached == [0, full, 0, 0]
        # the decode worker's own cache (prompts computed there: the local path)
        prompt = fresh_prompt()
        cached = [(await decoded(prompt, s)).usage.cached_tokens for s in ("c", "c", "d", None)]
        assert cached == [0, full, 0, 0]
        # KV moved under a salt is cached on the decode worker under that salt only
        prompt = fresh_prompt()
        handoff = (await prefilled(prompt, "e")).kv_transfer_params
        moved = await decoded(prompt, "e", handoff)
        assert moved.transfer.kv_tokens_received >= full, moved.transfer
        assert moved.transfer.local_cached_tokens == 0, moved.transfer
        assert (await decoded(prompt, "e")).usage.cached_tokens == full
        assert (await decoded(prompt, "f")).usage.cached_tokens == 0
