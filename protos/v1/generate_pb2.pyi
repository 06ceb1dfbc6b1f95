from protos.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls_json", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls_json: str
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls_json: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "text", "token_ids", "chat", "params", "tools_json", "tool_choice_json", "parallel_tool_calls", "include_reasoning", "chat_options")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_JSON_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_REASONING_FIELD_NUMBER: _ClassVar[int]
    CHAT_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    params: _common_pb2.SamplingParams
    tools_json: str
    tool_choice_json: str
    parallel_tool_calls: bool
    include_reasoning: bool
    chat_options: ChatTemplateOptions
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., tools_json: _Optional[str] = ..., tool_choice_json: _Optional[str] = ..., parallel_tool_calls: _Optional[bool] = ..., include_reasoning: _Optional[bool] = ..., chat_options: _Optional[_Union[ChatTemplateOptions, _Mapping]] = ...) -> None: ...

class ChatTemplateOptions(_message.Message):
    __slots__ = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs_json", "reasoning_effort", "chat_template")
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    REASONING_EFFORT_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    add_generation_prompt: bool
    continue_final_message: bool
    chat_template_kwargs_json: str
    reasoning_effort: str
    chat_template: str
    def __init__(self, add_generation_prompt: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ..., chat_template_kwargs_json: _Optional[str] = ..., reasoning_effort: _Optional[str] = ..., chat_template: _Optional[str] = ...) -> None: ...

class ToolCallDelta(_message.Message):
    __slots__ = ("index", "id", "name", "arguments")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    index: int
    id: str
    name: str
    arguments: str
    def __init__(self, index: _Optional[int] = ..., id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "usage", "prefill_worker", "decode_worker", "transfer", "logprobs", "stop_reason", "stop_token_id", "reasoning", "tool_calls")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    usage: _common_pb2.Usage
    prefill_worker: str
    decode_worker: str
    transfer: _common_pb2.TransferStats
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    stop_reason: str
    stop_token_id: int
    reasoning: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCallDelta]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ..., transfer: _Optional[_Union[_common_pb2.TransferStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., stop_reason: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., reasoning: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCallDelta, _Mapping]]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Model(_message.Message):
    __slots__ = ("id", "max_model_len")
    ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    id: str
    max_model_len: int
    def __init__(self, id: _Optional[str] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[Model]
    def __init__(self, models: _Optional[_Iterable[_Union[Model, _Mapping]]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("model", "text", "chat", "tools_json", "chat_options")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    CHAT_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    chat: ChatMessages
    tools_json: str
    chat_options: ChatTemplateOptions
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., tools_json: _Optional[str] = ..., chat_options: _Optional[_Union[ChatTemplateOptions, _Mapping]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "count", "max_model_len")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    count: int
    max_model_len: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., count: _Optional[int] = ..., max_model_len: _Optional[int] = ...) -> None: ...
