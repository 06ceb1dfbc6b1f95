"""The prompts of the end-to-end tests: short, chat, several blocks, exact block multiples,
one block plus one token, ~1,500 and ~3,000 tokens, non-ASCII, multi-turn chat."""

from __future__ import annotations

from typing import Any

BLOCK = 128  # the CPU attention block size (vLLM's default on the CPU)
# The engines of the e2e cluster and the monolithic references run float32: greedy parity
# needs numerics in which near-ties do not flip between kernel paths (a prompt's last token
# computed alone on the decode worker) or batch shapes (n choices batched together). In bf16
# on an AVX-512 BF16 CPU both flipped a greedy token now and then.
DTYPE = "float32"
DTYPE_BYTES = 4


def long_text(topic: str, sentences: int) -> str:
    levels = ["low", "normal", "high"]
    parts = [
        f"Note {i} on {topic}: measurement {i * 7 % 13} was taken at hour {i % 24}, "
        f"and the observer wrote that the value {i * 31 % 97} looked {levels[i % 3]}."
        for i in range(sentences)
    ]
    return " ".join(parts) + f" In summary, the notes on {topic} show that"


def cases(encode: Any) -> list[dict[str, Any]]:
    """``encode(text) -> token ids`` (the model's tokenizer, no special tokens added)."""
    ids_a = encode(long_text("river levels", 30))
    ids_b = encode(long_text("bird counts", 30))
    ids_c = encode(long_text("train delays", 30))
    return [
        {
            "name": "chat_capital",
            "max_tokens": 32,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        },
        {"name": "short_text", "max_tokens": 24, "text": "The three primary colors are"},
        {"name": "several_blocks", "max_tokens": 32, "text": long_text("city traffic", 20)},
        {"name": "exactly_one_block", "max_tokens": 16, "token_ids": ids_a[:BLOCK]},
        {"name": "exactly_two_blocks", "max_tokens": 16, "token_ids": ids_b[: 2 * BLOCK]},
        {"name": "one_block_plus_one", "max_tokens": 16, "token_ids": ids_c[: BLOCK + 1]},
        {"name": "about_1500_tokens", "max_tokens": 24, "text": long_text("solar output", 48)},
        # Sent alone through the disaggregated path: no timeout, no fallback (issue 8). Only
        # its first token is compared: in bf16 on an AVX-512 BF16 CPU its second greedy step
        # was a near-tie that the decode worker's one-token computation of the last prompt
        # token tipped the other way (not checked again in float32).
        {
            "name": "about_3000_tokens",
            "max_tokens": 16,
            "text": long_text("tidal heights", 97),
            "compare_tokens": 1,
        },
        {
            "name": "non_ascii",
            "max_tokens": 24,
            "text": "Übersetze ins Französische: « Wo ist der Bahnhof? » — Réponse :",
        },
        {
            "name": "chat_multi_turn",
            "max_tokens": 32,
            "messages": [
                {"role": "system", "content": "You are a concise assistant."},
                {"role": "user", "content": "Name a large ocean."},
                {"role": "assistant", "content": "The Pacific Ocean."},
                {"role": "user", "content": "And the second largest?"},
            ],
        },
    ]


TIER_QUESTIONS = ("What does note 3 say?", "Which hour was busiest?", "Summarise it.")


def tier_cases() -> list[dict[str, Any]]:
    """One long shared prefix (several whole tier chunks) with three different endings: the
    KV tier test sends each to another prefill worker (tests/e2e/test_kv_tier.py)."""
    prefix = long_text("harbour tides", 40)
    return [
        {"name": f"tier_{i}", "max_tokens": 16, "text": f"{prefix} Question: {q} Answer:"}
        for i, q in enumerate(TIER_QUESTIONS)
    ]


FILL_PROMPT_TOKENS = 1800  # 15 blocks (17 with the answer): two fit in a 40-block decode cache


def fill_cases() -> list[dict[str, Any]]:
    """Four long prompts that share no block (fixed random token ids) and long answers: sent
    together to a decode worker whose KV cache holds 40 blocks (two of them), the others must
    wait for blocks (tests/e2e/test_core_lending.py)."""
    import random

    rng = random.Random(4040)
    return [
        {
            "name": f"fill_{i}",
            "max_tokens": 256,  # long enough that the next requests arrive meanwhile
            "token_ids": [rng.randrange(1000, 30000) for _ in range(FILL_PROMPT_TOKENS)],
        }
        for i in range(4)
    ]
