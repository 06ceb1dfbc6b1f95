"""Property-based fuzzing of the OpenAI HTTP API (hypothesis over request bodies): more than
1,000 generated requests, valid and not (completions, chat, Responses, tokenize), against a
gateway with fake workers. No answer may be a 5xx, none may hang, and every error is
OpenAI-shaped."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import gateway_cluster

EXAMPLES = 1100
REQUEST_TIMEOUT_S = 10.0

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
    st.lists(st.integers(min_value=-5, max_value=60000), max_size=5),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)


def field(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(valid, valid, junk)


message = st.fixed_dictionaries(
    {"role": field(st.sampled_from(["system", "user", "assistant", "tool", "x"]))},
    optional={
        "content": field(
            st.one_of(
                st.text(max_size=40),
                st.lists(
                    st.fixed_dictionaries(
                        {
                            "type": st.sampled_from(["text", "image_url"]),
                            "text": st.text(max_size=10),
                        }
                    ),
                    max_size=2,
                ),
            )
        ),
        "name": field(st.text(max_size=5)),
    },
)

sampling = {
    "model": field(st.sampled_from(["", "SmolLM2-135M-Instruct", "other"])),
    "max_tokens": field(st.integers(min_value=-2, max_value=5000)),
    "temperature": field(st.floats(min_value=-1, max_value=3)),
    "top_p": field(st.floats(min_value=-0.5, max_value=1.5)),
    "top_k": field(st.integers(min_value=-3, max_value=100)),
    "min_p": field(st.floats(min_value=-0.5, max_value=1.5)),
    "seed": field(st.integers(min_value=-(2**64), max_value=2**64)),
    "stop": field(st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=3))),
    "stop_token_ids": field(st.lists(st.integers(min_value=-1, max_value=2**33), max_size=3)),
    "n": field(st.integers(min_value=-1, max_value=70)),
    "presence_penalty": field(st.floats(min_value=-3, max_value=3)),
    "frequency_penalty": field(st.floats(min_value=-3, max_value=3)),
    "repetition_penalty": field(st.floats(min_value=-1, max_value=3)),
    "min_tokens": field(st.integers(min_value=-1, max_value=6000)),
    "ignore_eos": field(st.booleans()),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "logit_bias": field(st.dictionaries(st.text(max_size=6), st.floats(-200, 200), max_size=3)),
    "response_format": field(
        st.one_of(
            st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "xml"])}),
            st.fixed_dictionaries(
                {"type": st.just("json_schema"), "json_schema": junk | st.just({"schema": {}})}
            ),
        )
    ),
}

completion = st.fixed_dictionaries(
    {},
    optional={
        **sampling,
        "prompt": field(
            st.one_of(
                st.text(max_size=60),
                st.lists(st.text(max_size=20), max_size=3),
                st.lists(st.integers(min_value=-1, max_value=60000), max_size=8),
                st.lists(
                    st.lists(st.integers(min_value=0, max_value=50000), max_size=4), max_size=2
                ),
            )
        ),
        "logprobs": field(st.integers(min_value=-1, max_value=25)),
        "echo": field(st.booleans()),
        "suffix": field(st.text(max_size=3)),
        "best_of": field(st.integers(min_value=0, max_value=3)),
    },
)

chat = st.fixed_dictionaries(
    {},
    optional={
        **sampling,
        "messages": field(st.lists(message, max_size=4)),
        "max_completion_tokens": field(st.integers(min_value=-1, max_value=5000)),
        "logprobs": field(st.booleans()),
        "top_logprobs": field(st.integers(min_value=-1, max_value=25)),
        "tools": field(
            st.lists(
                st.fixed_dictionaries(
                    {
                        "type": st.just("function"),
                        "function": st.fixed_dictionaries({"name": st.text(max_size=5)}),
                    }
                ),
                max_size=2,
            )
        ),
        "tool_choice": field(st.sampled_from(["none", "auto", "required"])),
    },
)

response_item = st.one_of(
    message,
    st.fixed_dictionaries(
        {"type": st.sampled_from(["function_call", "function_call_output", "message", "x"])},
        optional={"call_id": junk, "output": junk, "name": junk, "arguments": junk},
    ),
)
responses = st.fixed_dictionaries(
    {},
    optional={
        **{k: v for k, v in sampling.items() if k not in ("max_tokens", "n", "stream_options")},
        "input": field(st.one_of(st.text(max_size=40), st.lists(response_item, max_size=3))),
        "instructions": field(st.text(max_size=10)),
        "max_output_tokens": field(st.integers(min_value=-2, max_value=5000)),
        "include": field(st.lists(st.sampled_from(["message.output_text.logprobs", "x"]))),
        "top_logprobs": field(st.integers(min_value=-1, max_value=25)),
        "tools": field(
            st.lists(
                st.fixed_dictionaries(
                    {"type": st.sampled_from(["function", "mcp"]), "name": st.text(max_size=5)}
                ),
                max_size=2,
            )
        ),
        "tool_choice": field(st.sampled_from(["none", "auto", "required"])),
        "truncation": field(st.sampled_from(["auto", "disabled", "x"])),
        "previous_input_messages": field(st.lists(message, max_size=2)),
    },
)

requests = st.one_of(
    st.tuples(st.just("/v1/completions"), completion),
    st.tuples(st.just("/v1/chat/completions"), chat),
    st.tuples(st.just("/v1/responses"), responses),
    st.tuples(st.just("/tokenize"), st.one_of(completion, chat)),
    st.tuples(
        st.just("/detokenize"),
        st.fixed_dictionaries({"tokens": field(st.lists(st.integers(-2, 60000), max_size=5))}),
    ),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/responses"]), junk),
)


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    """A gateway with fake workers, served from its own thread and loop."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    state: dict[str, Any] = {}

    async def serve() -> None:
        state["stop"] = asyncio.Event()
        async with gateway_cluster(max_concurrent_requests=64) as c:
            state["url"] = c.base_url
            ready.set()
            await state["stop"].wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(60), "the gateway did not start"
    yield state["url"]
    loop.call_soon_threadsafe(state["stop"].set)
    thread.join(30)
    assert not thread.is_alive(), "the gateway did not stop"
    loop.close()  # a loop left open keeps grpc.aio's poller delivering to it


SENT: list[int] = []


def test_generated_requests_never_get_a_5xx_or_hang(base_url: str) -> None:
    with httpx.Client(base_url=base_url, timeout=REQUEST_TIMEOUT_S) as http:

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(requests)
        def check(request: tuple[str, Any]) -> None:
            path, body = request
            response = http.post(path, json=body)  # a hang raises httpx.TimeoutException
            SENT.append(response.status_code)
            assert response.status_code < 500, (path, body, response.text)
            if response.status_code >= 400:
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}, response.text
            elif not response.headers["content-type"].startswith("text/event-stream"):
                pass
            elif path == "/v1/responses":  # the Responses API's last event
                assert "event: response.completed\n" in response.text, response.text[-200:]
            else:
                assert response.text.endswith("data: [DONE]\n\n"), response.text[-200:]

        check()
    assert len(SENT) >= 1000, len(SENT)
    assert any(code == 200 for code in SENT) and any(code == 400 for code in SENT)
