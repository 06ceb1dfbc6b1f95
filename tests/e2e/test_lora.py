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
from tests.e2e.conftest import RealCluster
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
