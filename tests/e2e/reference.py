"""The references the e2e tests compare the cluster with, computed by one monolithic vLLM
engine (no connector, no prefix caching) in one process:

- ``greedy``: greedy outputs the disaggregated path must match token for token. A case:
  {"name", "max_tokens", and one of "text" | "token_ids" | "messages"}; its result:
  {"token_ids", "text", "prompt_token_ids"}. The prompts run as one batch (the chats as a
  second one): a greedy output does not depend on its batch on this engine, and one batch
  takes a fraction of the time of one prompt after the other.
- ``api``: the API-surface cases (tests/e2e/api_cases.py), one after the other. A case:
  {"name", "params": {SamplingParams fields; "structured_outputs": {...}}, and one of
  "text" | "messages"; "chat": LLM.chat's rendering arguments, optional}; its result:
  {"token_ids", "text", "logprobs": [[token, logprob], ...] | null,
  "prompt_logprobs": [logprob | null, ...] | null}.

Usage: python tests/e2e/reference.py MODEL_DIR CASES_JSON OUT_JSON DTYPE
CASES_JSON: {"greedy": [...], "api": [...]}; OUT_JSON: {"greedy": {name: result},
"api": {name: result}}.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def _api_result(out: Any) -> dict[str, Any]:
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


def _greedy(llm: Any, cases: list[dict[str, Any]]) -> dict[str, Any]:
    from vllm import SamplingParams, TokensPrompt

    def params(case: dict[str, Any]) -> Any:
        return SamplingParams(temperature=0.0, max_tokens=case["max_tokens"])

    chats = [case for case in cases if "messages" in case]
    prompts = [case for case in cases if "messages" not in case]
    inputs = [
        TokensPrompt(prompt_token_ids=c["token_ids"]) if "token_ids" in c else c["text"]
        for c in prompts
    ]
    outs = llm.generate(inputs, [params(c) for c in prompts], use_tqdm=False) if prompts else []
    if chats:
        conversations = [c["messages"] for c in chats]
        outs += llm.chat(conversations, [params(c) for c in chats], use_tqdm=False)
    return {
        case["name"]: {
            "token_ids": list(out.outputs[0].token_ids),
            "text": out.outputs[0].text,
            "prompt_token_ids": list(out.prompt_token_ids or []),
        }
        for case, out in zip([*prompts, *chats], outs, strict=True)
    }


def _api(llm: Any, cases: list[dict[str, Any]]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

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
        results[case["name"]] = _api_result(out)
    return results


def main() -> None:
    model, cases_path, out_path, dtype = sys.argv[1:5]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from pdserve.worker.engine import cpu_compile_env

    # The workers' compiled graph (pdserve.worker.engine), from the same compile cache.
    cpu_compile_env(os.environ)
    from vllm import LLM

    # The e2e cluster's dtype (tests/e2e/cases.py DTYPE).
    llm = LLM(
        model=model,
        dtype=dtype,
        gpu_memory_utilization=0.5,
        enable_prefix_caching=False,
    )
    with open(cases_path) as f:
        cases = json.load(f)
    results = {"greedy": _greedy(llm, cases["greedy"]), "api": _api(llm, cases["api"])}
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
