"""Greedy (or seeded) outputs of one monolithic vLLM engine for the API-surface cases: the
reference the gateway's answers must match for every sampling parameter the model supports.

Usage: python tests/e2e/api_reference.py MODEL_DIR CASES_JSON OUT_JSON DTYPE
A case: {"name", "params": {SamplingParams fields; "structured_outputs": {...}},
and one of "text" | "messages"; "chat": LLM.chat's rendering arguments, optional}.
OUT_JSON: {name: {"token_ids", "text", "logprobs": [[token, logprob], ...] | null,
"prompt_logprobs": [logprob | null, ...] | null}}.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def _result(out: Any) -> dict[str, Any]:
    completion = out.outputs[0]
    logprobs = None
    if completion.logprobs:
        logprobs = [
            [int(t), float(step[t].logprob)]
            for t, step in zip(completion.token_ids, completion.logprobs, strict=False)
        ]
    prompt_logprobs = None
    if out.prompt_logprobs:
        prompt_logprobs = [
            None if step is None else float(step[t].logprob)
            for t, step in zip(out.prompt_token_ids, out.prompt_logprobs, strict=False)
        ]
    return {
        "token_ids": list(completion.token_ids),
        "text": completion.text,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
    }


def main() -> None:
    model, cases_path, out_path, dtype = sys.argv[1:5]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from pdserve.worker.engine import cpu_compile_env

    # The workers' compiled graph (pdserve.worker.engine), from the same compile cache.
    cpu_compile_env(os.environ)
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

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
        fields = dict(case["params"])
        if "structured_outputs" in fields:
            fields["structured_outputs"] = StructuredOutputsParams(**fields["structured_outputs"])
        params = SamplingParams(**fields)
        if "messages" in case:
            out = llm.chat(case["messages"], params, use_tqdm=False, **case.get("chat", {}))[0]
        else:
            out = llm.generate(case["text"], params, use_tqdm=False)[0]
        results[case["name"]] = _result(out)
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
