"""The gateway's tokenizer: same ids as the model's AutoTokenizer (which vLLM uses), no torch.

vLLM's OpenAI server renders chat templates to text and encodes it without extra special tokens,
and encodes completion prompts with them; the gateway must produce exactly those ids.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import model_dir, tokenizer

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


@pytest.fixture(scope="module")
def reference():  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer  # the tests may import torch; the gateway may not

    return AutoTokenizer.from_pretrained(model_dir())


@pytest.mark.parametrize("chat", CHATS)
def test_chat_ids_match_reference(reference, chat) -> None:  # type: ignore[no-untyped-def]
    text = reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    expected = reference.encode(text, add_special_tokens=False)
    assert tokenizer().encode_chat(chat) == expected
    assert tokenizer().render_chat(chat).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("text", TEXTS)
def test_completion_ids_match_reference(reference, text) -> None:  # type: ignore[no-untyped-def]
    assert tokenizer().encode_text(text) == reference.encode(text, add_special_tokens=True)


def test_gateway_imports_neither_torch_nor_vllm() -> None:
    code = (
        "import sys\n"
        "import gateway.__main__, gateway.server\n"
        "from gateway.tokenizer import HfTokenizer\n"
        f"HfTokenizer({model_dir()!r}).encode_chat([{{'role': 'user', 'content': 'hi'}}])\n"
        "bad = sorted(m for m in ('torch', 'vllm') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


PREFILLED = [
    {"role": "user", "content": "Name three colors."},
    {"role": "assistant", "content": "Red, green and"},
]


def test_chat_options_render_as_vllm_asks_the_template(reference) -> None:  # type: ignore[no-untyped-def]
    from gateway.interfaces import ChatOptions

    options = ChatOptions(add_generation_prompt=False, continue_final_message=True)
    text = reference.apply_chat_template(
        PREFILLED, add_generation_prompt=False, continue_final_message=True, tokenize=False
    )
    assert text.endswith("Red, green and")  # the assistant's turn stays open
    assert tokenizer().render_chat(PREFILLED, options=options) == text
    assert tokenizer().encode_chat(PREFILLED, options=options) == reference.encode(
        text, add_special_tokens=False
    )
    closed = ChatOptions(add_generation_prompt=False)
    assert not tokenizer().render_chat(CHATS[0], options=closed).endswith("assistant\n")
    special = ChatOptions(add_special_tokens=True)
    plain = reference.apply_chat_template(CHATS[0], add_generation_prompt=True, tokenize=False)
    assert tokenizer().encode_chat(CHATS[0], options=special) == reference.encode(
        plain, add_special_tokens=True
    )
    # template variables go to the template; the ones vLLM refuses are a 400
    kwargs = ChatOptions(template_kwargs={"enable_thinking": False})
    assert tokenizer().render_chat(CHATS[0], options=kwargs) == plain


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"continue_final_message": True}, "continue_final_message"),  # with the generation prompt
        ({"template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template_kwargs"),
        ({"template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ],
)
def test_chat_options_vllm_refuses_are_400(options, param) -> None:  # type: ignore[no-untyped-def]
    from gateway.errors import InvalidRequest
    from gateway.interfaces import ChatOptions

    with pytest.raises(InvalidRequest) as raised:
        tokenizer().render_chat(PREFILLED, options=ChatOptions(**options))
    assert raised.value.param == param


@pytest.mark.parametrize("text", TEXTS)
def test_completion_ids_without_special_tokens(reference, text) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer().encode_text(text, add_special_tokens=False)
    assert ids == reference.encode(text, add_special_tokens=False)
