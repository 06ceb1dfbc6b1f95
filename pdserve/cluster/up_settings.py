"""``pdserve up``'s settings: every flag of the command (``--name`` or ``PDSERVE_UP_NAME``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings

from pdserve import settings as shared
from pdserve.cluster import gpu as up_gpu
from pdserve.cluster import tier as up_tier
from pdserve.placement import topology


class UpSettings(BaseSettings):
    model_config = shared.base_config("PDSERVE_UP_")

    prefill: int = Field(1, ge=0, description="prefill workers (0: decode workers do prompts)")
    decode: int = Field(1, ge=1, description="decode workers")
    model: str = Field("", description="model directory (empty: the prepared default model)")
    served_model_name: str = Field(
        "",
        description="model name clients use, on the gateway and every worker (empty: the "
        "model directory's name)",
    )
    extra_models: str = Field(
        "",
        description="more base models behind the gateway, name=dir[,name=dir...]: each gets "
        "one prefill worker (none with --prefill 0) and one decode worker of its own, on the "
        "same cores as the first model's",
    )
    lora_modules: str = Field(
        "",
        description="LoRA adapters every worker serves, as vLLM's --lora-modules: "
        "name=path[,name=path...] (PEFT directories; `pdserve model lora` writes one)",
    )
    generation_config: str = Field(
        "auto",
        description="the gateway's sampling defaults, as vLLM's flag: auto (the model's "
        "generation_config.json), vllm (none) or a directory holding one",
    )
    chat_template: str = Field(
        "", description="the gateway's chat template, as vLLM's flag (empty: the model's)"
    )
    trust_request_chat_template: bool = Field(
        False, description="the gateway renders a request's own chat_template (vLLM's flag)"
    )
    tool_call_parser: str = Field(
        "", description="the gateway's vLLM tool-call parser, e.g. hermes (empty: none)"
    )
    enable_auto_tool_choice: bool = Field(
        False, description="the gateway serves tool_choice auto (needs tool_call_parser)"
    )
    reasoning_parser: str = Field(
        "", description="the gateway's vLLM reasoning parser, e.g. qwen3 (empty: none)"
    )
    enable_tokenizer_info_endpoint: bool = Field(
        False, description="the gateway serves GET /tokenizer_info (as vLLM's flag)"
    )
    allow_runtime_lora_updating: bool = Field(
        False,
        description="the gateway serves /v1/load_lora_adapter and /v1/unload_lora_adapter "
        "(as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING); the workers run vLLM's LoRA",
    )
    host: str = Field("127.0.0.1", description="address the gateway binds (HTTP and gRPC)")
    http_port: int = Field(shared.GATEWAY_HTTP_PORT, description="gateway OpenAI HTTP port")
    grpc_port: int = Field(shared.GATEWAY_GRPC_PORT, description="gateway gRPC port")
    prefill_port: int = Field(shared.PREFILL_GRPC_PORT, description="gRPC port of prefill-0 (+i)")
    decode_port: int = Field(shared.DECODE_GRPC_PORT, description="gRPC port of decode-0 (+i)")
    kv_port: int = Field(shared.PREFILL_KV_PORT, description="KV port of prefill-0 (+i)")
    kv_connector: up_gpu.ConnectorChoice = Field(
        "auto",
        description="KV connector of every worker: auto (nixl when GPUs are found, else "
        "pdserve), pdserve (TCP, CPU KV caches only) or nixl (vLLM's NixlConnector)",
    )
    gpus: str = Field(
        "", description="GPUs the engines use, e.g. '0' or '0,1' (default: every GPU found)"
    )
    nixl_port: int = Field(
        up_gpu.DEFAULT_NIXL_PORT,
        ge=1,
        description="nixl: NIXL side-channel port of prefill-0; every worker takes the next "
        "(prefill workers first, then decode workers)",
    )
    redis_url: str = Field(
        "", description="Redis for discovery and the prefix index (empty: a private redis-server)"
    )
    prefill_engine_args: str = Field(
        "", description="vLLM engine arguments of prefill workers (--prefill-engine-args='--x 1')"
    )
    decode_engine_args: str = Field("", description="vLLM engine arguments of decode workers")
    kv_tier: up_tier.TierKind = Field(
        "off",
        description="second KV tier (LMCache) of every worker (docs/kv-tier.md): off; cpu or "
        "disk (each worker its own); redis, fs or lm (shared by all workers)",
    )
    kv_tier_url: str = Field(
        "",
        description="where the tier lives: redis://host:port/db (redis without it: a private "
        "redis-server with --kv-tier-redis-gib), a directory (fs; disk: one subdirectory per "
        "worker), lm://host:port",
    )
    kv_tier_cpu_gib: float = Field(
        1.0, gt=0, description="GiB of CPU memory each worker's LMCache keeps as its first level"
    )
    kv_tier_redis_gib: float = Field(
        2.0,
        gt=0,
        description="maxmemory of the private tier redis-server (least recently used chunks "
        "are evicted beyond it)",
    )
    cpu_lending: bool = Field(
        True,
        description="CPU, each engine on cores of its own: decode engines also compute on the "
        "prefill engines' cores while those have nothing to compute (docs/benchmarks.md)",
    )
    cpu_split: Literal["phases", "even"] = Field(
        "phases",
        description="CPU: how the cores are divided between the engines: phases (the prefill "
        "engines get the share that balances the two phases' costs for --split-workload, "
        "at least one core per engine; docs/benchmarks.md, 'Choosing the split') or even "
        "(as many cores per engine)",
    )
    split_workload: str = Field(
        "512:64", description="--cpu-split phases: a typical request's prompt:output tokens"
    )
    split_rates: str = Field(
        "",
        description="--cpu-split phases: this machine's `pdserve bench engine --json` report "
        "(empty: the rates measured on a CPU of its class, docs/benchmarks.md)",
    )
    internal_tls: bool = Field(
        True,
        description="mutual TLS between the gateway and the workers, with a private CA and a "
        "certificate per process made in <log-dir>/tls (or PDSERVE_TLS_DIR's, for all); "
        "--no-internal-tls: plain text, authenticated by the deployment secret only",
    )
    log_dir: str = Field(".pdserve/logs", description="one <process>.log per process")
    startup_timeout_s: float = Field(
        600.0, gt=0, description="give up if not all ready by then (a restart: only a warning)"
    )
    shutdown_grace_s: float = Field(20.0, ge=0, description="SIGTERM to SIGKILL, per stage")
    on_child_exit: Literal["restart", "stop-all"] = Field(
        "restart",
        description="a process that exits after it was ready: restart it after a backoff, "
        "or stop everything (one that fails before it was ever ready always stops everything)",
    )
    restart_backoff_s: float = Field(
        1.0, gt=0, description="wait before a restart; doubles with each restart in a row"
    )
    restart_backoff_max_s: float = Field(30.0, gt=0, description="longest wait before a restart")
    restart_reset_s: float = Field(
        60.0, ge=0, description="ready this long: the next restart waits --restart-backoff-s again"
    )

    def more_models(self) -> list[tuple[str, str]]:
        """(name, directory) of each of ``extra_models``."""
        return shared.named_paths(self.extra_models, "extra_models", "dir")

    def workers(self) -> tuple[int, int]:
        """Prefill and decode workers of every model."""
        more = len(self.more_models())
        return self.prefill + (more if self.prefill else 0), self.decode + more

    @model_validator(mode="after")
    def _extra_models_named(self) -> UpSettings:
        self.more_models()  # each entry is name=dir
        return self

    @model_validator(mode="after")
    def _backoff_in_order(self) -> UpSettings:
        if self.restart_backoff_max_s < self.restart_backoff_s:
            raise ValueError("restart_backoff_max_s must be >= restart_backoff_s")
        return self

    @model_validator(mode="after")
    def _split_works(self) -> UpSettings:
        topology.parse_workload(self.split_workload)
        if self.cpu_split == "phases":
            topology.load_rates(self.split_rates, native_bf16=False)
        return self

    @model_validator(mode="after")
    def _kv_tier_works(self) -> UpSettings:
        problem = up_tier.settings_problem(self.kv_tier, self.kv_tier_url, self.redis_url)
        if problem:
            raise ValueError(problem)
        return self
