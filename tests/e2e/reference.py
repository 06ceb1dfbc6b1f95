"""Greedy outputs of one monolithic vLLM engine (no connector, no prefix caching): the
reference the disaggregated path must match token for token.

Usage: python tests/e2e/reference.py MODEL_DIR CASES_JSON OUT_JSON DTYPE
CASES_JSON: a list of {"name", "max_tokens", and one of "text" | "token_ids" | "messages"}.
OUT_JSON: {name: {"token_ids": [...], "text": str, "prompt_token_ids": [...]}}.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    model, cases_path, out_path, dtype = sys.argv[1:5]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from pdserve.worker.engine import cpu_compile_env

    # The workers' compiled graph (pdserve.worker.engine), from the same compile cache.
    cpu_compile_env(os.environ)
    from vllm import LLM, SamplingParams, TokensPrompt

    # The e2e cluster's dtype (tests/e2e/cases.py DTYPE).
    llm = LLM(
        model=model,
        dtype=dtype,
        gpu_memory_utilization=0.5,
        enable_prefix_caching=False,
    )
    with open(cases_path) as f:
        cases = json.load(f)
    results = {}
    for case in cases:
        params = SamplingParams(temperature=0.0, max_tokens=case["max_tokens"])
        if "messages" in case:
            out = llm.chat(case["messages"], params, use_tqdm=False)[0]
        elif "token_ids" in case:
            out = llm.generate(
                TokensPrompt(prompt_token_ids=case["token_ids"]), params, use_tqdm=False
            )[0]
        else:
            out = llm.generate(case["text"], params, use_tqdm=False)[0]
        results[case["name"]] = {
            "token_ids": list(out.outputs[0].token_ids),
            "text": out.outputs[0].text,
            "prompt_token_ids": list(out.prompt_token_ids or []),
        }
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
