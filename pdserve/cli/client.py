"""Typed async client of the gateway's public gRPC API (``pdserve.v1.Generation``).

    async with GatewayClient("127.0.0.1:50051", api_key=...) as client:
        async for piece in client.generate(text="Hello", max_tokens=16, temperature=0):
            print(piece.text, end="")

Every call has a deadline; failures raise ``GatewayCallError`` (the gRPC status name and the
gateway's message), never grpc's own exception types. Closing or cancelling a ``generate``
iterator cancels the RPC, which makes the gateway abort the request on its workers.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdserve.rpc.client import CLIENT_OPTIONS, REQUEST_ID_METADATA
from protos.v1 import common_pb2, generate_pb2, generate_pb2_grpc


class GatewayCallError(Exception):
    """A call to the gateway failed: ``code`` is the gRPC status name, e.g. "UNAVAILABLE"."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Piece:
    """One streamed message: new tokens and text; ``finish_reason`` and ``usage`` on the last."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[common_pb2.TokenLogprob, ...] = ()
    finish_reason: str = ""
    usage: common_pb2.Usage | None = None
    raw: generate_pb2.GenerateResponse = field(default_factory=generate_pb2.GenerateResponse)


def sampling(**fields: Any) -> common_pb2.SamplingParams:
    """``SamplingParams`` from keyword arguments (None values left unset)."""
    params = common_pb2.SamplingParams()
    for name, value in fields.items():
        if value is None:
            continue
        if isinstance(value, list | tuple):
            getattr(params, name).extend(value)
        else:
            setattr(params, name, value)
    return params


class GatewayClient:
    def __init__(
        self, target: str, *, api_key: str | None = None, timeout_s: float = 600.0
    ) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self._api_key = api_key
        self._channel = grpc.aio.insecure_channel(target, options=CLIENT_OPTIONS)
        self._stub = generate_pb2_grpc.GenerationStub(self._channel)

    async def __aenter__(self) -> GatewayClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    def _metadata(self, request_id: str | None) -> tuple[tuple[str, str], ...]:
        metadata = []
        if self._api_key:
            metadata.append(("authorization", f"Bearer {self._api_key}"))
        if request_id:
            metadata.append((REQUEST_ID_METADATA, request_id))
        return tuple(metadata)

    async def generate(
        self,
        *,
        text: str | None = None,
        token_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, str]] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        model: str = "",
        params: common_pb2.SamplingParams | None = None,
        request_id: str | None = None,
        timeout_s: float | None = None,
        **sampling_fields: Any,
    ) -> AsyncIterator[Piece]:
        """Stream one generation. Give exactly one of ``text``, ``token_ids``, ``messages``;
        sampling as ``params`` or keyword fields (``max_tokens=16, temperature=0``)."""
        request = generate_pb2.GenerateRequest(
            model=model, params=params or sampling(**sampling_fields)
        )
        if messages is not None:
            request.chat.messages.extend(
                generate_pb2.ChatMessage(role=m["role"], content=m.get("content", ""))
                for m in messages
            )
            if tools:
                request.tools_json = json.dumps(list(tools))
        elif token_ids is not None:
            request.token_ids.ids.extend(token_ids)
        elif text is not None:
            request.text = text
        call = self._stub.Generate(
            request, timeout=timeout_s or self.timeout_s, metadata=self._metadata(request_id)
        )
        try:
            async for message in call:
                yield Piece(
                    tuple(message.token_ids),
                    message.text,
                    tuple(message.logprobs),
                    message.finish_reason,
                    message.usage if message.finish_reason else None,
                    message,
                )
        except grpc.aio.AioRpcError as err:
            raise GatewayCallError(err.code().name, err.details() or "") from err
        finally:
            call.cancel()  # no-op when finished; tells the gateway we are gone otherwise

    async def complete(self, **kwargs: Any) -> tuple[str, Piece]:
        """The whole text of one generation and its last message."""
        parts: list[str] = []
        last: Piece | None = None
        async for piece in self.generate(**kwargs):
            parts.append(piece.text)
            last = piece
        if last is None:
            raise GatewayCallError("UNKNOWN", "the stream ended without a message")
        return "".join(parts), last

    async def tokenize(
        self, *, text: str | None = None, messages: Sequence[Mapping[str, str]] | None = None
    ) -> list[int]:
        request = generate_pb2.TokenizeRequest()
        if messages is not None:
            request.chat.messages.extend(
                generate_pb2.ChatMessage(role=m["role"], content=m.get("content", ""))
                for m in messages
            )
        else:
            request.text = text or ""
        try:
            reply = await self._stub.Tokenize(
                request, timeout=self.timeout_s, metadata=self._metadata(None)
            )
        except grpc.aio.AioRpcError as err:
            raise GatewayCallError(err.code().name, err.details() or "") from err
        return list(reply.token_ids)

    async def list_models(self) -> list[generate_pb2.Model]:
        try:
            reply = await self._stub.ListModels(
                generate_pb2.ListModelsRequest(),
                timeout=min(self.timeout_s, 30.0),
                metadata=self._metadata(None),
            )
        except grpc.aio.AioRpcError as err:
            raise GatewayCallError(err.code().name, err.details() or "") from err
        return list(reply.models)
