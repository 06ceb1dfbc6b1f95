"""Settings common to both worker roles; each role subclasses with its own env prefix."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings

from pdserve.settings import PREFILL_KV_PORT


class WorkerSettings(BaseSettings):
    worker_id: str = Field("", description="name shown in logs and routing (default: role-port)")
    model: str = Field("", description="local Hugging Face model directory (default: prepared)")
    served_model_name: str = Field("", description="model name clients use (default: dir name)")
    host: str = Field("127.0.0.1", description="gRPC bind address")
    port: int = Field(0, description="gRPC port")
    kv_connector: Literal["pdserve", "nixl"] = Field(
        "pdserve",
        description="KV connector: pdserve (TCP, CPU KV caches only) or nixl (vLLM's "
        "NixlConnector over UCX: GPU KV caches, NVLink/RDMA/TCP)",
    )
    nixl_host: str = Field(
        "",
        description="nixl: address of this worker's NIXL side channel (vLLM's "
        "VLLM_NIXL_SIDE_CHANNEL_HOST), where decode workers fetch its KV memory descriptors; "
        "it is bound, so it must be an address of this host (default: advertise_host, else host)",
    )
    nixl_port: int = Field(
        5600,
        ge=1,
        le=65535,
        description="nixl: port of the side channel (vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT); "
        "workers sharing a host need one each",
    )
    advertise_host: str = Field(
        "",
        description="address the gateway and other workers use to reach this worker's gRPC and "
        "KV ports (default: host; set it to the pod IP when host is 0.0.0.0)",
    )
    redis_url: str = Field(
        "", description="Redis for the worker registry and prefix index (empty: none)"
    )
    redis_prefix: str = Field(
        "pdserve", description="key prefix of pdserve in Redis; must equal the gateway's"
    )
    kv_bind_host: str = Field("", description="KV transfer bind address (default: host)")
    kv_port: int = Field(PREFILL_KV_PORT, description="KV transfer port of a prefill worker")
    kv_lease_s: float = Field(30.0, description="seconds a prefill keeps unpulled blocks pinned")
    kv_load_failure_policy: Literal["fail", "recompute"] = Field(
        "fail", description="decode: on a failed KV pull, fail the request or recompute the prompt"
    )
    kv_tier: Literal["off", "cpu", "disk", "redis", "fs", "lm"] = Field(
        "off",
        description="second KV tier (LMCache) beneath vLLM's cache: off; cpu or disk (this "
        "worker only); redis, fs or lm (shared by every worker naming the same kv_tier_url)",
    )
    kv_tier_url: str = Field(
        "",
        description="where the tier lives: redis://host:port[/db] (default: redis_url with "
        "db 1), a directory for fs and disk, lm://host:port for an LMCache server",
    )
    kv_tier_cpu_gib: float = Field(
        1.0, gt=0, description="GiB of CPU memory LMCache keeps as its first (local) level"
    )
    kv_tier_chunk_tokens: int = Field(
        256, ge=16, description="tokens per tier chunk (only whole chunks are stored)"
    )
    kv_cache_gib: int = Field(
        1, ge=1, description="CPU only: KV cache size in whole GiB (vLLM's VLLM_CPU_KVCACHE_SPACE)"
    )
    cpu_cores: str = Field("", description="CPU only: cores for the engine, e.g. '0' or '0-3'")
    cpu_lending: str = Field(
        "",
        description="CPU only: the core lending table of engines sharing this machine (pdserve "
        "up makes it): with it a worker lends its cpu_cores while its engine has nothing to "
        "compute, or, with cpu_borrow, borrows",
    )
    cpu_borrow: str = Field(
        "",
        description="CPU only, with cpu_lending: other engines' cores this engine also computes "
        "on while they have nothing to compute, e.g. '0' (pdserve up: decode workers borrow "
        "the prefill workers' cores)",
    )
    hash_seed: int = Field(
        42,
        ge=0,
        le=4294967295,
        description="PYTHONHASHSEED of the engine, the same in the whole deployment (block hashes)",
    )
    engine_args: str = Field(
        "", description="vLLM engine arguments as for `vllm serve`, e.g. '--max-model-len 4096'"
    )
    lora_modules: str = Field(
        "",
        description="LoRA adapters the engine serves, as vLLM's --lora-modules: "
        "name=path[,name=path...], each path a PEFT adapter directory (turns on vLLM's "
        "--enable-lora, --max-loras and --max-lora-rank unless engine_args set them)",
    )
    runtime_lora: bool = Field(
        False,
        description="the engine runs vLLM's LoRA for adapters loaded at run time (the "
        "gateway's /v1/load_lora_adapter) too: room for 4 more, of rank 16 at most, unless "
        "engine_args set --max-loras and --max-lora-rank",
    )
    shutdown_grace_s: float = Field(10.0, description="seconds to finish requests on shutdown")
    log_level: str = Field("INFO", description="log level")

    @property
    def reachable_host(self) -> str:
        """The address others use to reach this worker."""
        if self.advertise_host:
            return self.advertise_host
        return "127.0.0.1" if self.host in ("", "0.0.0.0", "::") else self.host

    @property
    def side_channel_host(self) -> str:
        """The address of the NIXL side channel: bound by this worker, given to others."""
        return self.nixl_host or self.reachable_host

    @property
    def name(self) -> str:
        return self.worker_id or f"{self.role}-{self.port}"

    @property
    def role(self) -> Literal["prefill", "decode"]:
        raise NotImplementedError
