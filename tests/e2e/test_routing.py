"""Cache-aware routing on the real stack (2 prefill workers, 2 decode workers, Redis).

Multi-turn chats must keep going to the prefill worker that holds the conversation so far
(its prefix cache then serves it), new conversations spread over both prefill workers, and
the router's predicted cached tokens must equal what the workers report for >= 95% of
requests.
"""

from __future__ import annotations

import urllib.request
from collections import defaultdict
from typing import Any, cast

from tests.e2e.conftest import RealCluster
from tests.helpers import served_name

CONVERSATIONS = 4
TURNS = 3
BLOCK = 128


def system_prompt(i: int) -> str:
    topics = ["glaciers", "lighthouses", "beekeeping", "railway timetables", "volcanoes"]
    facts = " ".join(
        f"Fact {k} about {topics[i]}: it has property number {k * (i + 3)} and a story behind it."
        for k in range(14)
    )
    return f"You are a guide who knows this reference sheet by heart. {facts}"


def metric(text: str, name: str, label: str = "") -> float:
    for line in text.splitlines():
        if line.startswith(name) and label in line:
            return float(line.split()[-1])
    return 0.0


def predictions(cluster: RealCluster) -> dict[str, float]:
    """The gateway's prediction counters by result, now."""
    with urllib.request.urlopen(cluster.base_url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    name = "pdserve_gateway_prefix_predictions_total"
    return {r: metric(text, name, f'result="{r}"') for r in ("exact", "over", "under")}


def test_multi_turn_chats_follow_their_prefix_and_predictions_match(cluster: RealCluster) -> None:
    from openai import OpenAI

    before = predictions(cluster)

    client = OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0)
    histories: list[list[dict[str, str]]] = [
        [{"role": "system", "content": system_prompt(i)}, {"role": "user", "content": "Hi!"}]
        for i in range(CONVERSATIONS)
    ]
    served: dict[int, list[tuple[str, int, int]]] = defaultdict(list)
    for turn in range(TURNS):
        for i, history in enumerate(histories):
            raw = client.chat.completions.with_raw_response.create(
                model=served_name(),
                messages=cast(Any, history),
                max_tokens=12,
                temperature=0,
            )
            reply: Any = raw.parse()
            worker = raw.headers["x-pdserve-prefill-worker"]
            assert worker != "local", "conditional disaggregation is off in this cluster"
            usage = reply.usage
            served[i].append(
                (worker, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens)
            )
            history.append({"role": "assistant", "content": reply.choices[0].message.content})
            history.append({"role": "user", "content": f"Tell me more about fact {turn + 2}."})

    for i, turns in served.items():
        workers = {w for w, _, _ in turns}
        assert len(workers) == 1, f"conversation {i} moved between prefill workers: {turns}"
        first_prompt = turns[0][1]
        for _, _, cached in turns[1:]:  # the earlier turns' full blocks were cached there
            assert cached >= first_prompt // BLOCK * BLOCK > 0, turns
    assert len({turns[0][0] for turns in served.values()}) == 2, "new chats use both workers"

    # This test's own requests: one prediction each, >= 95 % of them exact.
    after = predictions(cluster)
    delta = {r: after[r] - before[r] for r in after}
    assert sum(delta.values()) == CONVERSATIONS * TURNS, delta
    assert delta["exact"] / (CONVERSATIONS * TURNS) >= 0.95, delta
