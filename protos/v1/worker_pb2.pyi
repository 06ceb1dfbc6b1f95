from protos.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]
ROLE_UNSPECIFIED: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class KvTransferParams(_message.Message):
    __slots__ = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "remote_block_ids", "remote_num_tokens", "remote_prefill_cached_tokens", "extra_json")
    REMOTE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_HOST_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PORT_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PREFILL_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_JSON_FIELD_NUMBER: _ClassVar[int]
    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    remote_block_ids: _containers.RepeatedScalarFieldContainer[int]
    remote_num_tokens: int
    remote_prefill_cached_tokens: int
    extra_json: str
    def __init__(self, remote_engine_id: _Optional[str] = ..., remote_request_id: _Optional[str] = ..., remote_host: _Optional[str] = ..., remote_port: _Optional[int] = ..., remote_block_ids: _Optional[_Iterable[int]] = ..., remote_num_tokens: _Optional[int] = ..., remote_prefill_cached_tokens: _Optional[int] = ..., extra_json: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "kv_transfer_params", "first_token_id", "prompt_tokens", "cached_tokens", "engine")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kv_transfer_params: KvTransferParams
    first_token_id: int
    prompt_tokens: int
    cached_tokens: int
    engine: _common_pb2.EngineTimes
    def __init__(self, request_id: _Optional[str] = ..., kv_transfer_params: _Optional[_Union[KvTransferParams, _Mapping]] = ..., first_token_id: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., engine: _Optional[_Union[_common_pb2.EngineTimes, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "kv_transfer_params")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    kv_transfer_params: KvTransferParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., kv_transfer_params: _Optional[_Union[KvTransferParams, _Mapping]] = ...) -> None: ...

class DecodeChunk(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "finish_reason", "usage", "transfer", "stop_reason", "prompt_logprobs", "engine", "stop_token_id")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finish_reason: str
    usage: _common_pb2.Usage
    transfer: _common_pb2.TransferStats
    stop_reason: str
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    engine: _common_pb2.EngineTimes
    stop_token_id: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., transfer: _Optional[_Union[_common_pb2.TransferStats, _Mapping]] = ..., stop_reason: _Optional[str] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., engine: _Optional[_Union[_common_pb2.EngineTimes, _Mapping]] = ..., stop_token_id: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "kv_transfer_params")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kv_transfer_params: KvTransferParams
    def __init__(self, request_id: _Optional[str] = ..., kv_transfer_params: _Optional[_Union[KvTransferParams, _Mapping]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class CapabilitiesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Capabilities(_message.Message):
    __slots__ = ("worker_id", "role", "model", "served_model_name", "block_size", "max_model_len", "kv_capacity_tokens", "num_kv_blocks", "dtype", "kv_connector", "kv_compat", "version", "load", "index_keys", "kv_tier", "kv_tier_chunk_tokens", "lora_adapters", "resident_lora_adapters")
    class KvCompatEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_CONNECTOR_FIELD_NUMBER: _ClassVar[int]
    KV_COMPAT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    INDEX_KEYS_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: Role
    model: str
    served_model_name: str
    block_size: int
    max_model_len: int
    kv_capacity_tokens: int
    num_kv_blocks: int
    dtype: str
    kv_connector: str
    kv_compat: _containers.ScalarMap[str, str]
    version: str
    load: WorkerLoad
    index_keys: PrefixIndexKeys
    kv_tier: str
    kv_tier_chunk_tokens: int
    lora_adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapter]
    resident_lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., model: _Optional[str] = ..., served_model_name: _Optional[str] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., dtype: _Optional[str] = ..., kv_connector: _Optional[str] = ..., kv_compat: _Optional[_Mapping[str, str]] = ..., version: _Optional[str] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., index_keys: _Optional[_Union[PrefixIndexKeys, _Mapping]] = ..., kv_tier: _Optional[str] = ..., kv_tier_chunk_tokens: _Optional[int] = ..., lora_adapters: _Optional[_Iterable[_Union[LoraAdapter, _Mapping]]] = ..., resident_lora_adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class LoraAdapterRequest(_message.Message):
    __slots__ = ("name", "path", "load_inplace")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    LOAD_INPLACE_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    load_inplace: bool
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., load_inplace: _Optional[bool] = ...) -> None: ...

class LoraAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("name", "path", "rank")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    rank: int
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...

class PrefixIndexKeys(_message.Message):
    __slots__ = ("hash_seed", "redis_prefix")
    HASH_SEED_FIELD_NUMBER: _ClassVar[int]
    REDIS_PREFIX_FIELD_NUMBER: _ClassVar[int]
    hash_seed: int
    redis_prefix: str
    def __init__(self, hash_seed: _Optional[int] = ..., redis_prefix: _Optional[str] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("running", "waiting", "kv_usage", "in_flight", "pinned_blocks", "leases", "engine_steps", "kv_transfers", "kv_bytes", "kv_transfer_seconds", "kv_transfer_failures", "kv_leases_expired", "cpu_lent_steps", "cpu_lend_wait_seconds", "cpu_lend_reclaims", "lora_requests", "lora_loads")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STEPS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    KV_LEASES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    CPU_LENT_STEPS_FIELD_NUMBER: _ClassVar[int]
    CPU_LEND_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CPU_LEND_RECLAIMS_FIELD_NUMBER: _ClassVar[int]
    LORA_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    LORA_LOADS_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    kv_usage: float
    in_flight: int
    pinned_blocks: int
    leases: int
    engine_steps: int
    kv_transfers: int
    kv_bytes: int
    kv_transfer_seconds: float
    kv_transfer_failures: int
    kv_leases_expired: int
    cpu_lent_steps: int
    cpu_lend_wait_seconds: float
    cpu_lend_reclaims: int
    lora_requests: int
    lora_loads: int
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_usage: _Optional[float] = ..., in_flight: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., leases: _Optional[int] = ..., engine_steps: _Optional[int] = ..., kv_transfers: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., kv_transfer_seconds: _Optional[float] = ..., kv_transfer_failures: _Optional[int] = ..., kv_leases_expired: _Optional[int] = ..., cpu_lent_steps: _Optional[int] = ..., cpu_lend_wait_seconds: _Optional[float] = ..., cpu_lend_reclaims: _Optional[int] = ..., lora_requests: _Optional[int] = ..., lora_loads: _Optional[int] = ...) -> None: ...
