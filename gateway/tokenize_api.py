"""``/tokenize`` and ``/detokenize`` (vLLM's shapes): the gateway's own tokenizer, so the ids
are exactly those a generation request would send to the workers."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.errors import InvalidRequest
from gateway.interfaces import ChatOptions
from gateway.openai_models import ChatMessage, FunctionTool
from gateway.service import GenerationService, Prompt


class TokenizeRequest(BaseModel):
    """Either ``prompt`` (completions text) or ``messages`` (a chat, rendered with vLLM's chat
    fields of its tokenize request, as a chat completion renders it)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[FunctionTool] | None = None
    return_token_strs: bool = False
    add_special_tokens: bool | None = None  # vLLM's default: true for a prompt, false for a chat
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int] = Field(max_length=1_000_000)


async def tokenize(service: GenerationService, body: TokenizeRequest) -> dict[str, Any]:
    service.check_model(body.model or "")
    ids, strs = await service.offload.run(_tokenize, service, body)  # off the event loop
    return {
        "count": len(ids),
        "max_model_len": service.pool.max_model_len(),
        "tokens": ids,
        "token_strs": strs,
    }


def _tokenize(
    service: GenerationService, body: TokenizeRequest
) -> tuple[list[int], list[str] | None]:
    if body.messages is not None:
        messages = tuple(m.for_template(i) for i, m in enumerate(body.messages))
        tools = tuple(t.model_dump(exclude_none=True) for t in body.tools) if body.tools else None
        options = ChatOptions(
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            add_special_tokens=bool(body.add_special_tokens),
            template_kwargs=body.chat_template_kwargs,
            template=body.chat_template,
        )
        ids = service.tokenize(Prompt(messages=messages, tools=tools, chat=options))
    else:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = service.tokenizer.encode_text(body.prompt or "", special)
    strs = [service.tokenizer.token_text(t) for t in ids] if body.return_token_strs else None
    return ids, strs


async def detokenize(service: GenerationService, body: DetokenizeRequest) -> dict[str, Any]:
    service.check_model(body.model or "")
    vocab = service.tokenizer.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(f"token id {bad[0]} is out of vocabulary", param="tokens")
    return {"prompt": await service.offload.run(service.tokenizer.decode, body.tokens)}
