"""The gateway's one settings object: env ``PDSERVE_GATEWAY_*`` overridden by CLI flags."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode

from gateway.slo import Slo
from pdserve.settings import GATEWAY_GRPC_PORT, GATEWAY_HTTP_PORT, base_config, named_paths

WorkerList = Annotated[list[str], NoDecode]


def _split_addresses(value: Any) -> Any:
    """Accept "h:p,h:p" (env, CLI) as well as a list; drop blanks."""
    if isinstance(value, str):
        value = value.split(",")
    if isinstance(value, list | tuple):
        return [str(v).strip() for v in value if str(v).strip()]
    return value


class GatewaySettings(BaseSettings):
    model_config = base_config("PDSERVE_GATEWAY_")

    http_host: str = Field(
        default="127.0.0.1", description="address the HTTP and gRPC servers bind"
    )
    http_port: int = Field(
        default=GATEWAY_HTTP_PORT, ge=0, le=65535, description="OpenAI HTTP API port (0: any free)"
    )
    grpc_port: int = Field(
        default=GATEWAY_GRPC_PORT, ge=0, le=65535, description="public gRPC API port (0: any free)"
    )
    model: str = Field(default="", description="local model dir for the tokenizer (empty: default)")
    served_model_name: str = Field(
        default="", description="model name clients use (empty: dir name)"
    )
    extra_models: WorkerList = Field(
        default=[],
        description="more base models behind this gateway, name=dir,name=dir (dir: the "
        "model's directory, for its tokenizer and vLLM's front end); their workers are "
        "discovered in the Redis registry by the model name they serve",
    )
    prefill_workers: WorkerList = Field(
        default=[], description="prefill workers, host:port,host:port"
    )
    decode_workers: WorkerList = Field(
        default=[], description="decode workers, host:port,host:port"
    )
    request_timeout_s: float = Field(
        default=600.0, gt=0, description="deadline of a whole decode stream"
    )
    prefill_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="least deadline of one Prefill call; it grows with the prompt tokens queued "
        "on the worker ahead of it (see prefill_deadline_slack)",
    )
    prefill_deadline_slack: float = Field(
        default=4.0,
        ge=1,
        description="a Prefill call's deadline is this many times the time the worker is "
        "measured to need for its queue plus the prompt (at least prefill_timeout_s)",
    )
    control_timeout_s: float = Field(
        default=3.0, gt=0, description="deadline of GetCapabilities and Abort calls"
    )
    health_interval_s: float = Field(
        default=5.0, gt=0, description="how often worker capabilities are refreshed"
    )
    prefill_failure_policy: Literal["local", "fail"] = Field(
        default="local",
        description="prefill worker failing: 'local' lets the decode worker compute the prompt, "
        "'fail' answers 503",
    )
    prefill_retries: int = Field(
        default=1,
        ge=0,
        description="a failed Prefill is tried again on this many other prefill workers "
        "(with backoff) before prefill_failure_policy applies",
    )
    decode_retries: int = Field(
        default=1,
        ge=0,
        description="a decode worker failing before the first token: the request is tried "
        "again on this many other decode workers, with the same (still leased) KV hand-off",
    )
    max_migrations: int = Field(
        default=2,
        ge=0,
        description="a decode worker failing or hanging mid-stream: the request continues on "
        "another decode worker (prompt + tokens so far re-prefilled) at most this many times",
    )
    inter_token_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="a decode stream that sends no token for this long after its first is "
        "hung: it migrates, or ends with 504 when it cannot",
    )
    retry_backoff_s: float = Field(
        default=0.2,
        ge=0,
        description="wait before the first retry of a failed call; doubles per retry",
    )
    eject_s: float = Field(
        default=5.0,
        gt=0,
        description="a worker that failed a request is skipped at least this long (doubling "
        "while it keeps failing, at most 60 s), then probed back in by its health check",
    )
    stall_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="a worker whose engine has requests but takes no step for this long is "
        "hung: ejected until its engine moves again",
    )
    default_max_tokens: int = Field(
        default=0,
        ge=0,
        description="max_tokens of a gRPC request that has none when the generation config "
        "gives none (0: up to the context length; OpenAI requests follow vLLM's rules)",
    )
    generation_config: str = Field(
        default="auto",
        description="sampling defaults for what a request leaves unset, as vLLM's flag: auto "
        "(the model's generation_config.json), vllm (none) or a directory holding one",
    )
    chat_template: str = Field(
        default="",
        description="the chat template for chats (as vLLM's flag: a file, or the template "
        "itself; empty: the model's own)",
    )
    tool_call_parser: str = Field(
        default="",
        description="vLLM's tool-call parser of chat output, e.g. hermes (as vLLM's flag; "
        "empty: none, and tool_choice other than none is a 400)",
    )
    enable_auto_tool_choice: bool = Field(
        default=False,
        description="as vLLM's flag: tool_choice auto (the default with tools) lets the model "
        "decide; needs tool_call_parser",
    )
    enable_tokenizer_info_endpoint: bool = Field(
        default=False,
        description="as vLLM's flag: serve GET /tokenizer_info (it may expose the chat template "
        "and the tokenizer's configuration)",
    )
    allow_runtime_lora_updating: bool = Field(
        default=False,
        description="as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: serve POST /v1/load_lora_adapter "
        "and /v1/unload_lora_adapter, which load an adapter on every worker (anyone with an API "
        "key may then load files of the workers' machines)",
    )
    reasoning_parser: str = Field(
        default="",
        description="vLLM's reasoning parser of chat output, e.g. qwen3 (as vLLM's flag; "
        "empty: none)",
    )
    picker: str = Field(
        default="auto",
        description="routing picker (gateway.routing.registry); auto: prefix with a redis_url, "
        "else round_robin",
    )
    redis_url: str = Field(
        default="",
        description="Redis: discover workers from its registry and route on its prefix index",
    )
    redis_prefix: str = Field(default="pdserve", description="key prefix of pdserve in Redis")
    discovery_interval_s: float = Field(
        default=2.0, gt=0, description="how often the worker registry is read"
    )
    load_share_interval_s: float = Field(
        default=0.1,
        ge=0,
        description="with a redis_url: how often this gateway publishes its requests in flight "
        "per worker to Redis and reads the other gateways', so that gateway replicas route on "
        "each other's load (0: off, each gateway counts only its own)",
    )
    hash_seed: int = Field(
        default=42, ge=0, le=4294967295, description="block-hash seed; must equal the workers'"
    )
    disagg_min_uncached_tokens: int = Field(
        default=0,
        ge=0,
        description="conditional disaggregation: a prompt whose part not cached on the decode "
        "worker is at most this many tokens is computed there (0: always use a prefill worker; "
        "e.g. 256 saves the transfer for short prompts)",
    )
    disagg_policy: Literal["static", "adaptive"] = Field(
        default="static",
        description="where a prompt is computed (gateway.routing.split): static, on a prefill "
        "worker unless disagg_min_uncached_tokens says otherwise; adaptive, also on the decode "
        "worker when that is predicted to give the first token sooner without pushing the "
        "streams it decodes past the TPOT objective (slo_tpot_ms)",
    )
    prefix_weight: float = Field(
        default=2.0, ge=0, description="routing score weight of the cached share of the prompt"
    )
    load_weight: float = Field(
        default=1.0, ge=0, description="routing score weight of a worker's load"
    )
    kv_usage_weight: float = Field(
        default=0.5, ge=0, description="routing score weight of a worker's KV cache usage (0..1)"
    )
    lora_residency_weight: float = Field(
        default=0.5,
        ge=0,
        description="routing score weight of a LoRA request's adapter being resident in a "
        "worker's engine (its LoRA cache, --max-cpu-loras): elsewhere it is loaded first",
    )
    tier_hit_weight: float = Field(
        default=0.8,
        ge=0,
        le=1,
        description="routing score weight of a prompt token a worker would retrieve from its "
        "shared KV tier (LMCache) rather than find in its own cache (weight 1); retrieving "
        "costs less than computing but more than a local hit",
    )
    tier_index_max_blocks: int = Field(
        default=100_000,
        ge=1,
        description="prefix-index entries one shared KV tier may have (about 360 bytes of "
        "Redis each); beyond it the tier's entries are dropped and relearned, since the index "
        "does not see the tier's own evictions",
    )
    trust_request_chat_template: bool = Field(
        default=False,
        description="render a chat with the request's own chat_template (vLLM's flag of the "
        "same name); without it such a request is a 400, as vLLM's",
    )
    slo_ttft_ms: float = Field(
        default=0,
        ge=0,
        description="objective for the time to first token, in ms (0: none); a request's "
        "x-pdserve-slo-ttft-ms header sets its own; met or missed: pdserve_gateway_slo_requests",
    )
    slo_tpot_ms: float = Field(
        default=0,
        ge=0,
        description="objective for the time per output token after the first, in ms (0: "
        "none); a request's x-pdserve-slo-tpot-ms header sets its own",
    )
    routing_headers: bool = Field(
        default=True,
        description="say where a request went (x-pdserve-*-worker headers, gRPC trailers)",
    )

    api_keys: WorkerList = Field(
        default=[],
        description="API keys clients must send (Authorization: Bearer KEY), comma-separated; "
        "empty with no api_keys_file: no authentication",
    )
    api_keys_file: str = Field(
        default="", description="file with one API key per line (blank lines and # ignored)"
    )
    max_concurrent_requests: int = Field(
        default=0,
        ge=0,
        description="generations in progress at most (each of n choices counts); more are "
        "answered 429 / RESOURCE_EXHAUSTED (0: no limit)",
    )
    max_queue_per_worker: int = Field(
        default=64,
        ge=0,
        description="admission control: when every healthy decode worker (or every prefill "
        "worker) has this many requests in flight or queued in its engine, new requests are "
        "answered 429 / RESOURCE_EXHAUSTED with Retry-After instead of piling on (0: no limit)",
    )
    retry_after_s: int = Field(
        default=1, ge=0, description="Retry-After (seconds) sent with 429 answers"
    )
    prompt_threads: int = Field(
        default=4,
        ge=0,
        description="threads that render chat templates, tokenize and hash prompts off the "
        "event loop (0: on the event loop)",
    )

    @field_validator("prefill_workers", "decode_workers", "api_keys", "extra_models", mode="before")
    @classmethod
    def _addresses(cls, value: Any) -> Any:
        return _split_addresses(value)

    @field_validator("prefill_workers", "decode_workers")
    @classmethod
    def _host_port(cls, value: list[str]) -> list[str]:
        for address in value:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"worker address {address!r} is not host:port")
        return value

    @field_validator("extra_models")
    @classmethod
    def _name_dir(cls, value: list[str]) -> list[str]:
        named_paths(value, "extra_models", "dir")
        return value

    @model_validator(mode="after")
    def _extra_models_found(self) -> GatewaySettings:
        if self.extra_models and not self.redis_url:
            raise ValueError(
                "extra_models needs redis_url: the other models' workers are discovered in "
                "the registry"
            )
        return self

    def served_models(self) -> list[tuple[str, str]]:
        """(name, directory) of every base model, the first (``model``) first; a name given
        twice is an error."""
        primary = self.model_dir()
        models = [(self.model_name(primary), primary)]
        models += named_paths(self.extra_models, "extra_models", "dir")
        names = [name for name, _ in models]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"the model name {name!r} is served twice")
        return models

    @property
    def slo(self) -> Slo:
        """The gateway's objectives (a request's headers may set its own)."""
        return Slo.from_ms(self.slo_ttft_ms, self.slo_tpot_ms)

    def picker_name(self) -> str:
        if self.picker != "auto":
            return self.picker
        return "prefix" if self.redis_url else "round_robin"

    def model_dir(self) -> str:
        """The tokenizer's directory: ``model``, or the default model when empty."""
        if self.model:
            return self.model
        from pdserve.model import resolve_model  # lazy: written separately, imports more

        return resolve_model(None)

    def vllm_args(self, model_name: str) -> list[str]:
        """vLLM's front-end flags of these settings (``gateway.render``)."""
        from gateway.render import vllm_args

        return vllm_args(
            served_model_name=model_name,
            generation_config=self.generation_config,
            chat_template=self.chat_template,
            tool_call_parser=self.tool_call_parser,
            enable_auto_tool_choice=self.enable_auto_tool_choice,
            reasoning_parser=self.reasoning_parser,
            trust_request_chat_template=self.trust_request_chat_template,
        )

    def model_name(self, model_dir: str) -> str:
        return self.served_model_name or Path(model_dir.rstrip("/")).name
