"""OpenAI requests rendered by vLLM's own front end: a chat or completion body becomes exactly
the token ids and sampling parameters ``vllm serve`` would hand its engine.

vLLM's ``ServingRender`` (the renderer behind ``vllm launch render``, built in the gateway's
process by ``gateway.vllm_front_end``) validates the body with vLLM's request models, applies
the chat template (tools, ``chat_template_kwargs``, ``continue_final_message``, documents, a
trusted request's own template), tokenizes, truncates (``truncate_prompt_tokens``), lets the
tool-call and reasoning parsers adjust the request (the structured output that forces a
"required" or named tool call), applies the model's ``generation_config`` defaults and vLLM's
``max_tokens`` rules. What remains here is pdserve's own: the fields that cannot work under
disaggregation or are not served yet are refused by name (``gateway.openai_fields``), vLLM's
context length follows the workers' (``max_model_len``), and vLLM's ``SamplingParams`` become
the worker contract's message (``gateway.vllm_params``).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from gateway.chat_parsing import ChatParsing, ParsedChat
from gateway.errors import (
    InvalidRequest,
    ModelNotFound,
    NotFound,
    PromptTooLong,
    validation_message,
)
from gateway.openai_fields import CHAT, COMPLETION, RESPONSES, STRUCTURED, refuse_unsupported
from gateway.vllm_front_end import front_end
from gateway.vllm_params import to_wire
from protos.v1 import common_pb2


@dataclass(frozen=True)
class Served:
    """What the workers serve now, which vLLM's rules follow: their context length (0: the
    model's) and their LoRA adapters, name -> path (vLLM's model check accepts those names)."""

    max_model_len: int = 0
    adapters: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Rendered:
    """One prompt as vLLM rendered it: its token ids and one choice's sampling parameters
    (``n`` is the gateway's: ``gateway.fanout``)."""

    token_ids: list[int]
    params: common_pb2.SamplingParams


def vllm_args(
    *,
    served_model_name: str,
    generation_config: str,
    chat_template: str = "",
    tool_call_parser: str = "",
    enable_auto_tool_choice: bool = False,
    reasoning_parser: str = "",
    trust_request_chat_template: bool = False,
) -> list[str]:
    """vLLM's front-end flags for the gateway's settings of the same names."""
    args = ["--served-model-name", served_model_name, "--generation-config", generation_config]
    if chat_template:
        args += ["--chat-template", chat_template]
    if tool_call_parser:
        args += ["--tool-call-parser", tool_call_parser]
    if enable_auto_tool_choice:
        args.append("--enable-auto-tool-choice")
    if reasoning_parser:
        args += ["--reasoning-parser", reasoning_parser]
    if trust_request_chat_template:
        args.append("--trust-request-chat-template")
    return args


class Renderer:
    """vLLM's ``ServingRender`` for one model (build it once: ``build``)."""

    def __init__(self, state: Any) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

        self.state = state
        self._serving = state.serving_render
        self.model_config = self._serving.model_config
        self._model_len = self.model_config.max_model_len  # the model's own
        self.tokenizer = state.online_renderer.renderer.get_tokenizer()
        # vLLM's tool-call / reasoning parsers of chat output for the flags (None: none)
        online = state.online_renderer
        self.parsing = (
            None
            if online.parser is None
            else ChatParsing(online.enable_auto_tools, self.tokenizer, online.parser)
        )
        self._chat_model = ChatCompletionRequest
        self._completion_model = CompletionRequest
        self._responses_model = ResponsesRequest

    @classmethod
    def build(cls, model_dir: str, args: Sequence[str]) -> Renderer:
        return cls(front_end(model_dir, args))

    async def chat(
        self, body: Mapping[str, Any], served: Served | None = None
    ) -> tuple[Any, Rendered]:
        """vLLM's ``ChatCompletionRequest`` of ``body`` and its rendering."""
        _refuse(body, CHAT)
        request = validate_body(self._chat_model, body)
        _check_choices(request.n)
        result = await self._render(self._serving.render_chat_request, request, served)
        return request, self._rendered(result)

    async def completion(
        self, body: Mapping[str, Any], served: Served | None = None
    ) -> tuple[Any, list[Rendered]]:
        """vLLM's ``CompletionRequest`` of ``body`` and the rendering of each of its prompts."""
        _refuse(body, COMPLETION)
        request = validate_body(self._completion_model, body)
        _check_completion(request)
        results = await self._render(self._serving.render_completion_request, request, served)
        return request, [self._rendered(r) for r in results]

    async def responses(
        self, body: Mapping[str, Any], served: Served | None = None
    ) -> tuple[Any, Any, Rendered]:
        """vLLM's ``ResponsesRequest`` of ``body`` (stateless: no ``previous_response_id``),
        vLLM's ``SamplingParams`` for it (its answer echoes them) and its rendering."""
        _refuse(body, RESPONSES)
        request = validate_body(self._responses_model, body)
        render = self._serving.render_responses_request
        result = await self._render(lambda r, _: render(r), request, served)
        return request, result.sampling_params, self._rendered(result)

    @property
    def default_sampling_params(self) -> dict[str, Any]:
        """The model's sampling defaults as vLLM reads them (``--generation-config``: its
        ``generation_config.json``; ``max_tokens`` from ``max_new_tokens``)."""
        defaults: dict[str, Any] = self._serving.default_sampling_params
        return defaults

    def parsed(self, chat: Any) -> ParsedChat | None:
        """vLLM's parsers of ``chat``'s choices (vLLM's rendered request); None: no parser."""
        return None if self.parsing is None else self.parsing.parsed(chat)

    async def tokenize(
        self, body: Mapping[str, Any], served: Served | None = None
    ) -> dict[str, Any]:
        """vLLM's ``/tokenize`` of ``body`` (a prompt or a chat, vLLM's fields)."""
        from pydantic import TypeAdapter
        from vllm.entrypoints.serve.tokenize.protocol import TokenizeRequest

        if not isinstance(body, Mapping):
            raise InvalidRequest("the request body must be a JSON object")
        request = validate_body(TypeAdapter(TokenizeRequest), body)
        serving = self.state.serving_tokenization
        result = await self._render(serving.create_tokenize, request, served)
        answer: dict[str, Any] = result.model_dump()
        return answer

    async def detokenize(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """vLLM's ``/detokenize`` of ``body`` (``tokens``); an id outside the vocabulary is a
        400 naming ``tokens``."""
        from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest

        if not isinstance(body, Mapping):
            raise InvalidRequest("the request body must be a JSON object")
        request = validate_body(DetokenizeRequest, body)
        vocab = len(self.tokenizer)
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is out of vocabulary", param="tokens")
        serving = self.state.serving_tokenization
        result = await self._render(serving.create_detokenize, request, None)
        answer: dict[str, Any] = result.model_dump()
        return answer

    async def _render(self, render: Any, request: Any, served: Served | None) -> Any:
        # vLLM's context length is the model's; the workers may serve a shorter one (their
        # --max-model-len, the smallest healthy decode worker's): vLLM's rules of max_tokens
        # and truncation take theirs. Every request of a moment asks for the same length.
        served = served or Served()
        self.model_config.max_model_len = served.max_model_len or self._model_len
        self._set_adapters(served.adapters)
        try:
            result = await render(request, None)
        except Exception as err:  # vLLM's own mapping decides: 4xx or a bug
            result = _error_response(err)
        if hasattr(result, "error"):  # vLLM's ErrorResponse
            raise vllm_error(result.error)
        return result

    def _set_adapters(self, adapters: Mapping[str, str]) -> None:
        """vLLM's model registry lists the workers' LoRA adapters (its model check, its
        ``/v1/models``), each under the id vLLM would give it."""
        registry = self.state.openai_serving_models.lora_requests
        if set(registry) == set(adapters) and all(
            registry[n].lora_path == p for n, p in adapters.items()
        ):
            return
        from vllm.lora.request import LoRARequest

        registry.clear()
        for i, (name, path) in enumerate(sorted(adapters.items()), start=1):
            registry[name] = LoRARequest(name, i, path)

    def _rendered(self, generate: Any) -> Rendered:
        """One of vLLM's token-in requests, checked as vLLM's engine front checks its
        sampling parameters (logprobs, logit bias, stop and allowed ids, structured output)
        before a worker sees it."""
        params = generate.sampling_params
        structured = self.state.vllm_config.structured_outputs_config
        try:
            params.verify(self.model_config, None, structured, self.tokenizer)
        except Exception as err:  # vLLM's own mapping decides: 4xx or a bug
            raise vllm_error(_error_response(err).error) from err
        return Rendered(list(generate.token_ids), to_wire(params, generate.cache_salt))


_SHARED: dict[tuple[str, tuple[str, ...]], Renderer] = {}
_SHARED_LOCK = threading.Lock()


def shared_renderer(model_dir: str, args: Sequence[str]) -> Renderer:
    """One ``Renderer`` per model and flags in a process (gateways that share a process, as
    in tests, share vLLM's front end: its import and model configuration cost seconds)."""
    key = (model_dir, tuple(args))
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = Renderer.build(model_dir, args)
        return _SHARED[key]


def _refuse(body: Mapping[str, Any], refused: Mapping[str, tuple[Any, str]]) -> None:
    if not isinstance(body, Mapping):
        raise InvalidRequest("the request body must be a JSON object")
    refuse_unsupported(body, refused)
    structured = body.get("structured_outputs")
    if isinstance(structured, Mapping):
        refuse_unsupported(structured, STRUCTURED, prefix="structured_outputs.")


def validate_body(model: Any, body: Mapping[str, Any]) -> Any:
    """``body`` (a JSON object) as vLLM's request model ``model``; what it refuses is vLLM's
    400."""
    validate = getattr(model, "model_validate", None) or model.validate_python
    try:
        return validate(dict(body))
    except ValidationError as err:
        message, param = _validation_message(err.errors())
        raise InvalidRequest(message, param=param) from err
    except Exception as err:  # vLLM's own mapping decides: 4xx or a bug
        raise vllm_error(_error_response(err).error) from err


def _validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """The message and field of vLLM's answer to a body its request model refuses (vLLM's
    validation handler: the field named by vLLM's own check, else the error's location
    without pydantic's internal markers)."""
    from vllm.entrypoints.serve.exception_handling.handlers.validation import (
        clean_loc_for_param,
    )
    from vllm.exceptions import VLLMValidationError

    message, param = validation_message(errors)
    for error in errors:
        cause = error.get("ctx", {}).get("error")
        if isinstance(cause, VLLMValidationError):
            return str(cause), cause.parameter
    if errors and errors[0].get("loc"):
        param = clean_loc_for_param(tuple(errors[0]["loc"]))
    return message, param


def _error_response(err: Exception) -> Any:
    """vLLM's ``ErrorResponse`` for an exception raised while rendering, as ``vllm serve``
    maps it; one it answers with a 5xx is not the request's fault and is raised again."""
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    response = create_error_response(err)
    if int(response.error.code) >= 500:
        raise err
    return response


MAX_CHOICES = 64  # prompts x n in one request


def _check_choices(total: int) -> None:
    """Before anything is rendered: a request's choices are the gateway's generations."""
    if total > MAX_CHOICES:
        raise InvalidRequest(
            f"at most {MAX_CHOICES} completions (prompts x n) per request", param="n"
        )


def _check_completion(request: Any) -> None:
    """What pdserve does not serve yet beyond vLLM's request model."""
    prompt = request.prompt
    many = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
    _check_choices((len(prompt) if many else 1) * request.n)
    if request.echo and request.return_token_ids:
        raise InvalidRequest(
            "return_token_ids with echo is not supported by pdserve yet", param="return_token_ids"
        )


def vllm_error(info: Any) -> InvalidRequest | NotFound:
    """vLLM's ``ErrorInfo`` as the gateway's error of the same status."""
    if int(info.code or 400) == 404:
        if info.param in (None, "model"):
            return ModelNotFound(info.message, param="model")
        return NotFound(info.message, param=info.param)
    if "context length" in info.message:
        return PromptTooLong(info.message, param=info.param)
    return InvalidRequest(info.message, param=info.param)
