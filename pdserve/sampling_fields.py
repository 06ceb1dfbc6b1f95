"""The fields ``pdserve.v1.SamplingParams`` and vLLM's ``SamplingParams`` share by name and
meaning: optional on the wire (unset: vLLM's default). The gateway writes them from vLLM's
renderer (``gateway.vllm_params``), the workers read them back (``pdserve.worker.sampling``)."""

from __future__ import annotations

OPTIONAL = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "prompt_logprobs",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
)
