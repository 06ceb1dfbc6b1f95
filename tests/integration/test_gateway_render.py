"""The gateway renders with vLLM's own front end (``gateway.render``): the ids are those of
the model's own tokenizer and chat template, as vLLM's OpenAI server makes them, and the
gateway runs no engine."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import pytest

from tests.helpers import model_dir, renderer

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi there  \n  multiple   spaces"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Ünïcødé 🙂 and <|im_end|> inside text"},
    ],
]
TEXTS = ["Once upon a time", "  leading spaces\nand <|im_start|> special", "🙂"]
PREFILLED = [
    {"role": "user", "content": "Name three colors."},
    {"role": "assistant", "content": "Red, green and"},
]


@pytest.fixture(scope="module")
def reference():  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir())


def _chat(body: dict[str, Any]) -> list[int]:
    return asyncio.run(renderer().chat({"max_completion_tokens": 1, **body}))[1].token_ids


@pytest.mark.parametrize("chat", CHATS)
def test_chat_ids_match_reference(reference, chat) -> None:  # type: ignore[no-untyped-def]
    text = reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    assert _chat({"messages": chat}) == reference.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_completion_ids_match_reference(reference, text) -> None:  # type: ignore[no-untyped-def]
    rendered = asyncio.run(renderer().completion({"prompt": text}))[1]
    assert rendered[0].token_ids == reference.encode(text, add_special_tokens=True)


def test_chat_options_render_as_vllm_asks_the_template(reference) -> None:  # type: ignore[no-untyped-def]
    text = reference.apply_chat_template(
        PREFILLED, add_generation_prompt=False, continue_final_message=True, tokenize=False
    )
    assert text.endswith("Red, green and")  # the assistant's turn stays open
    continued = _chat(
        {"messages": PREFILLED, "add_generation_prompt": False, "continue_final_message": True}
    )
    assert continued == reference.encode(text, add_special_tokens=False)
    plain = reference.apply_chat_template(CHATS[0], add_generation_prompt=True, tokenize=False)
    special = _chat({"messages": CHATS[0], "add_special_tokens": True})
    assert special == reference.encode(plain, add_special_tokens=True)


def test_the_gateway_runs_no_engine() -> None:
    """Importing the gateway loads neither torch nor vLLM (a CLI or a test that only reads its
    settings stays light); its front end loads vLLM's renderer and never vLLM's engine."""
    code = (
        "import sys\n"
        "import gateway.__main__, gateway.server\n"
        "bad = sorted(m for m in ('torch', 'vllm') if m in sys.modules)\n"
        "assert not bad, bad\n"
        "from gateway.render import shared_renderer\n"
        f"shared_renderer({model_dir()!r}, ['--served-model-name', 'm'])\n"
        "engine = ('vllm.v1.engine.async_llm', 'vllm.v1.engine.core')\n"
        "bad = sorted(m for m in engine if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
