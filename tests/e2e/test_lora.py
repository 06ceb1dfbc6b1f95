"""A LoRA adapter under disaggregation on the real stack: the shared cluster's workers serve
the adapter of ``pdserve model lora`` (as ``LORA_NAME``, its ``--lora-modules``). Its answers
equal ``vllm serve --enable-lora``'s with the same adapter token for token (the conformance
battery's ``lora_*`` cases); here: an adapter's request is prefilled with the adapter, its KV
moved and decoded with it (its answer is not the base model's, whose answer stays its own);
an adapter's KV never serves the base model's prompt nor the other way round (vLLM's block
hashes, the prefix index and the KV tier's chunk tags keep them apart); and an adapter's
multi-turn chats follow their prefix's holder, which the prefix index predicts exactly."""

from __future__ import annotations

from typing import Any, cast

from tests.e2e.conformance import LORA_NAME
from tests.e2e.conftest import RealCluster, metric_sum
from tests.e2e.test_faults import wait_until
from tests.e2e.test_routing import BLOCK, TURNS, predictions, system_prompt
from tests.helpers import served_name

QUESTION = [{"role": "user", "content": "Name three colors."}]


def _client(cluster: RealCluster) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0)


def _ask(client: Any, model: str, messages: list[dict[str, str]]) -> tuple[str, Any, str]:
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=cast(Any, messages), max_tokens=16, temperature=0
    )
    reply: Any = raw.parse()
    return reply.choices[0].message.content, reply.usage, raw.headers["x-pdserve-prefill-worker"]


def test_an_adapter_request_is_prefilled_and_decoded_with_the_adapter(
    cluster: RealCluster,
) -> None:
    client = _client(cluster)
    listed = {m.id: m for m in client.models.list().data}
    assert getattr(listed[LORA_NAME], "parent", None) == served_name()
    base, _, base_worker = _ask(client, served_name(), QUESTION)
    adapted, usage, worker = _ask(client, LORA_NAME, QUESTION)
    again, _, _ = _ask(client, served_name(), QUESTION)
    assert "local" not in (worker, base_worker), "every request moves its KV in this cluster"
    assert adapted != base, "the adapter changes the answer"
    assert again == base, "the base model's answer is its own after the adapter's"
    assert usage.completion_tokens > 0


def test_an_adapters_kv_never_serves_the_base_models_prompt(cluster: RealCluster) -> None:
    """The same long prompt, first for the base model, then for the adapter: the adapter's
    first turn finds nothing cached (neither in the engines nor in the KV tier), its second
    finds its own blocks; the base model's KV is still its own."""
    client = _client(cluster)
    long = [{"role": "system", "content": system_prompt(4) * 3}, *QUESTION]
    _, base_first, _ = _ask(client, served_name(), long)
    _, adapter_first, _ = _ask(client, LORA_NAME, long)
    _, adapter_second, _ = _ask(client, LORA_NAME, long)
    _, base_second, _ = _ask(client, served_name(), long)
    # the full blocks before the last prompt token (vLLM computes that one at least)
    full = (base_first.prompt_tokens - 1) // BLOCK * BLOCK
    assert full >= 4 * BLOCK, base_first.prompt_tokens
    assert adapter_first.prompt_tokens_details.cached_tokens == 0, adapter_first
    assert adapter_second.prompt_tokens_details.cached_tokens >= full, adapter_second
    assert base_second.prompt_tokens_details.cached_tokens >= full, base_second


def test_an_adapters_chats_follow_their_prefix_and_predictions_match(
    cluster: RealCluster,
) -> None:
    client = _client(cluster)
    before = predictions(cluster)
    conversations = 2
    histories = [
        [{"role": "system", "content": system_prompt(i)}, {"role": "user", "content": "Hi!"}]
        for i in range(conversations)
    ]
    served: dict[int, list[tuple[str, int, int]]] = {i: [] for i in range(conversations)}
    for turn in range(TURNS):
        for i, history in enumerate(histories):
            text, usage, worker = _ask(client, LORA_NAME, history)
            served[i].append(
                (worker, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens)
            )
            history.append({"role": "assistant", "content": text})
            history.append({"role": "user", "content": f"Tell me more about fact {turn + 2}."})
    for i, turns in served.items():
        assert len({w for w, _, _ in turns}) == 1, f"conversation {i} moved: {turns}"
        first = turns[0][1]
        for _, _, cached in turns[1:]:  # the earlier turns' full blocks were cached there
            assert cached >= first // BLOCK * BLOCK > 0, turns
    after = predictions(cluster)
    delta = {r: after[r] - before[r] for r in after}
    assert sum(delta.values()) == conversations * TURNS, delta
    assert delta["exact"] / (conversations * TURNS) >= 0.95, delta


def test_an_adapter_evicted_from_the_engines_lora_cache_is_loaded_again_and_counted(
    cluster: RealCluster, lora_adapters: tuple[str, str]
) -> None:
    """Each engine's LoRA cache holds 4 adapters (``--max-loras`` 4 with run-time loading,
    vLLM's ``--max-cpu-loras`` as many). A request for a resident adapter needs no load; 4
    adapters loaded at run time evict ``LORA_NAME``, and its next request on each worker
    loads it again (the workers' ``lora_loads``, exported by the gateway), with the same
    answer, never the base model's."""
    import httpx

    client = _client(cluster)

    def counters() -> tuple[float, float]:
        return (metric_sum(cluster, "pdserve_gateway_worker_lora_requests_total"),
                metric_sum(cluster, "pdserve_gateway_worker_lora_loads_total"))  # fmt: skip

    # A prompt of several blocks, so that every ask follows its prefix to the same prefill and
    # decode worker: a short one went round robin, and the resident ask and the evicted one
    # could land on different workers (a fresh-clone run counted 1 load where 2 were due).
    sticky = [{"role": "system", "content": system_prompt(1)}, *QUESTION]
    workers: list[str] = []

    def ask_counted() -> tuple[str, float]:
        """The adapter's answer, and the loads its prefill and decode worker needed."""
        requests, loads = counters()
        text, _, worker = _ask(client, LORA_NAME, sticky)
        assert "local" not in worker, "a prefill worker and a decode worker"
        workers.append(worker)
        wait_until(lambda: counters()[0] >= requests + 2, 30, "the workers report it")
        return text, counters()[1] - loads

    first, _ = ask_counted()  # resident now, whatever ran before
    resident, loads = ask_counted()
    assert (resident, loads) == (first, 0), "a resident adapter needs no load"
    names = [f"lru-{i}" for i in range(4)]
    with httpx.Client(base_url=cluster.base_url, timeout=120) as http:
        try:
            for name in names:
                body = {"lora_name": name, "lora_path": lora_adapters[1]}
                answer = http.post("/v1/load_lora_adapter", json=body)
                assert answer.status_code == 200, answer.text
            evicted, loads = ask_counted()
        finally:
            for name in names:
                http.post("/v1/unload_lora_adapter", json={"lora_name": name})
    assert len(set(workers)) == 1, f"every ask on the holder of its prefix: {workers}"
    assert loads == 2, "its prefill and its decode worker each loaded it again"
    assert evicted == first
    base, _, _ = _ask(client, served_name(), sticky)
    assert base != first
