"""One real engine with the KV tier (LMCache on the CPU) in this process, where a request is
looked up in the tier, waits for KV blocks and is aborted before its first step;
test_tier_lookup_pins.py runs it as a separate process and reads what it writes.

argv: model directory, output JSON path, dtype. The output: the worker's lookup pins (chunks
pinned per request id) while the request waits and after it was aborted and another request
ran, whether it was waiting for blocks, and the scheduler's lookup state for it afterwards.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any

from pdserve.worker import kv_tier
from pdserve.worker.config import WorkerSettings

CHUNK = 128  # tokens per tier chunk, one KV block
BLOCKS = 9  # the engine's whole KV cache: the long request below leaves one block free
SHARED = list(range(1000, 1000 + 4 * CHUNK + 8))  # four whole chunks in the tier
LONG = list(range(5000, 5900))
STORE_WAIT_S = 120.0


def main() -> int:
    model, out, dtype = sys.argv[1:4]
    settings = WorkerSettings(kv_tier="cpu", kv_tier_chunk_tokens=CHUNK, kv_tier_cpu_gib=0.5)
    os.environ.update(kv_tier.lmcache_env(settings))
    os.environ.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",  # scheduler and worker in this process
        VLLM_RPC_BASE_PATH=tempfile.mkdtemp(prefix="pdserve-tier-pins-"),
        LMCACHE_DISABLE_BANNER="1",
    )
    from vllm import EngineArgs, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.v1.engine.llm_engine import LLMEngine

    from kv_transfer import TIER_CONNECTOR_MODULE, TIER_CONNECTOR_NAME

    config = KVTransferConfig(kv_connector=TIER_CONNECTOR_NAME, kv_role="kv_producer",
                              kv_connector_module_path=TIER_CONNECTOR_MODULE,
                              engine_id="tier-pins")  # fmt: skip
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=model, dtype=dtype, enforce_eager=True, max_model_len=1024, block_size=CHUNK,
        num_gpu_blocks_override=BLOCKS, max_num_batched_tokens=1024, kv_transfer_config=config,
        enable_prefix_caching=False, gpu_memory_utilization=0.2,
    ))  # fmt: skip
    worker = get_kv_transfer_group()._lmcache_engine.lmcache_engine
    scheduler = engine.engine_core.engine_core.scheduler
    tier = scheduler.connector._lmcache_engine

    def add(req_id: str, prompt: list[int], tokens: int) -> None:
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0)
        engine.add_request(req_id, {"prompt_token_ids": prompt}, params)

    def finish() -> None:
        while engine.has_unfinished_requests():
            engine.step()

    def pins() -> dict[str, int]:
        return {k: sum(map(len, by_place.values())) for k, by_place in worker.lookup_pins.items()}

    add("store", SHARED, 1)
    finish()
    deadline = time.monotonic() + STORE_WAIT_S  # the tier stores in the background
    while worker.lookup(tokens=SHARED) < 4 * CHUNK and time.monotonic() < deadline:
        time.sleep(0.1)
    add("long", LONG, 100)  # takes all but one block
    engine.step()
    add("waiting", SHARED, 4)  # looked up (its four chunks pinned), then no blocks for it
    for _ in range(3):
        engine.step()
    report: dict[str, Any] = {
        "stored_tokens": worker.lookup(tokens=SHARED),
        "pins_while_waiting": pins(),
        "waiting": [r.request_id for r in scheduler.waiting],
    }
    engine.abort_request(["waiting"])
    finish()
    add("next", list(range(9000, 9100)), 2)  # a step after the abort
    finish()
    waiting_id = next((r for r in report["waiting"] if r.startswith("waiting")), "")
    report.update(
        pins_after=pins(),
        lookup_state_after=tier.lookup_client.lookup_cache(lookup_id=waiting_id) != -1,
        load_spec_after=waiting_id in tier.load_specs,
    )
    with open(out, "w") as f:
        json.dump(report, f)
    sys.stdout.flush()
    os._exit(0)  # LMCache's threads would keep the process alive


if __name__ == "__main__":
    sys.exit(main())
