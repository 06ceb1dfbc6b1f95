"""A chat's ``echo`` as vLLM's: the last message's content starts every choice's message when
that message has the answer's role (whole and streamed; equal to ``vllm serve`` in the
conformance battery, tests/e2e/conformance.py ``chat_echo*``); the answer's role is the
assistant's, or without a generation prompt the last message's."""

from __future__ import annotations

from typing import Any

import httpx

from pdserve.bench.fake_worker import DEFAULT_PIECES
from tests.helpers import gateway_cluster, parse_sse

ANSWER = "".join(text for _, text in DEFAULT_PIECES)
CONTINUED = [{"role": "user", "content": "Colors?"}, {"role": "assistant", "content": "Red, "}]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}


async def _chat(http: httpx.AsyncClient, **body: Any) -> httpx.Response:
    answer = await http.post("/v1/chat/completions", json={"max_tokens": 64, **body})
    assert answer.status_code == 200, answer.text
    return answer


async def test_echo_and_the_answers_role_follow_the_continued_message() -> None:
    async with gateway_cluster() as c, httpx.AsyncClient(base_url=c.base_url) as http:
        whole = (await _chat(http, messages=CONTINUED, echo=True, n=2, **CONTINUE)).json()
        streamed = await _chat(http, messages=CONTINUED, echo=True, stream=True, **CONTINUE)
        # The answer's role is the assistant's and the last message is the user's: no echo.
        user_last = (await _chat(http, messages=CONTINUED[:1], echo=True)).json()
        plain = (await _chat(http, messages=CONTINUED, **CONTINUE)).json()
        # Without a generation prompt the answer continues the last message, whatever its role.
        users = await _chat(http, messages=CONTINUED[:1], echo=True, add_generation_prompt=False)
        streamed_users = await _chat(
            http, messages=CONTINUED[:1], add_generation_prompt=False, stream=True
        )
    assert [ch["message"]["content"] for ch in whole["choices"]] == ["Red, " + ANSWER] * 2
    # As vLLM's: a whole answer under echo carries the prompt's logprobs at its top.
    prompt = whole["prompt_logprobs"]
    assert prompt[0] is None and len(prompt) == whole["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in prompt[1:])  # the token itself, no alternatives
    assert "prompt_logprobs" not in plain
    events = parse_sse(streamed.text)
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert deltas[1] == {"content": "Red, "}  # the echo, in a chunk of its own
    assert "".join(d.get("content") or "" for d in deltas) == "Red, " + ANSWER
    assert user_last["choices"][0]["message"]["content"] == ANSWER
    assert plain["choices"][0]["message"]["content"] == ANSWER
    assert users.json()["choices"][0]["message"] == {"role": "user", "content": "Colors?" + ANSWER}
    assert parse_sse(streamed_users.text)[0]["choices"][0]["delta"] == {
        "role": "user",
        "content": "",
    }
