"""vLLM 0.32's own NIXL scheduler code, runnable without a GPU or the nixl package.

``scheduler`` builds a real ``NixlPullConnectorScheduler`` without running its ``__init__``
(which needs a whole engine configuration) and sets the state that ``__init__`` sets for a
dense model with TP 1, no data parallelism and no host buffer
(vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py:60-191). Every method the
tests call is vLLM's: ``on_new_request``, ``get_num_new_matched_tokens``,
``update_state_after_alloc``, ``request_finished`` (nixl/pull_scheduler.py) and
``build_connector_meta`` (nixl/base_scheduler.py:474-520). ``request`` makes a real
``vllm.v1.request.Request`` from SamplingParams, as the engine core does.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import Request

LEASE_S = 30  # NIXL's default kv_lease_duration (base_scheduler.py:82-86)


def scheduler(engine_id: str, host: str, port: int, lease_s: int = LEASE_S) -> Any:
    """The scheduler half of vLLM's NixlConnector of engine ``engine_id`` whose side channel
    is ``host``:``port`` (what ``envs.VLLM_NIXL_SIDE_CHANNEL_*`` give it)."""
    s = NixlPullConnectorScheduler.__new__(NixlPullConnectorScheduler)
    parallel = SimpleNamespace(
        tensor_parallel_size=1,
        decode_context_parallel_size=1,
        pipeline_parallel_size=1,
        data_parallel_index=0,
    )
    s.vllm_config = SimpleNamespace(parallel_config=parallel, num_prefill_lookahead_tokens=0)
    s.transfer_tp_size = 1
    s.block_size = 16
    s.engine_id = engine_id
    # A dense model: every block of the one KV cache group is transferred.
    s.kv_cache_config = SimpleNamespace(select_transfer_block_ids=lambda ids: ids)
    s.side_channel_host = host
    s.side_channel_port = port
    s._kv_lease_duration = lease_s
    s._heartbeat_interval = lease_s // 6
    s.use_host_buffer = False
    s._is_hma_required = False
    s._has_mamba = False
    s._bounded_replay = False
    s._nixl_handshake_listener_t = None
    s._stop_event = threading.Event()
    s._reqs_need_recv = {}
    s._reqs_need_save = {}
    s._reqs_need_send = {}
    s._reqs_in_batch = set()
    s._reqs_not_processed = set()
    s._heartbeat_by_engine = {}
    s._heartbeat_req_engine = {}
    s._last_heartbeat_time = 0.0
    s.blocks_per_sw = [0]
    s._ssm_spec_blocks = [None]
    s.kv_recompute_threshold = 64
    s.is_bidirectional_kv_xfer_enabled = False
    s.decoder_kv_blocks_ttl = 480
    return s


def request(request_id: str, prompt: list[int], params: SamplingParams) -> Request:
    """The engine core's request for ``prompt`` (its ``kv_transfer_params`` come from
    ``params.extra_args``, vllm/v1/request.py:119-122)."""
    return Request(request_id, list(prompt), params, None)


def blocks(block_ids: list[int]) -> KVCacheBlocks:
    """What the KV cache manager allocated: new (unhashed) blocks of the one group."""
    return KVCacheBlocks(([KVCacheBlock(block_id=i) for i in block_ids],))
