"""Request ids: the client's ``x-request-id`` is echoed and logged, never used inside.

The fake decode worker here behaves like an engine in the two ways that matter: a request id
that is already running is refused, and ``Abort(id)`` ends the running request of that id.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx

from pdserve.bench.fake_worker import FakeDecode
from tests.helpers import gateway_cluster, served_name

CLIENT_ID = "same-id-for-both"


class EngineLikeDecode(FakeDecode):
    """Streams slowly; ids are unique among running requests; Abort ends the one named."""

    def __init__(self) -> None:
        super().__init__()
        self.pieces = [(100 + i, f" w{i}") for i in range(40)]
        self.running: dict[str, asyncio.Event] = {}

    async def Decode(self, request, context):  # type: ignore[no-untyped-def]
        if request.request_id in self.running:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, "request id already running")
        aborted = self.running[request.request_id] = asyncio.Event()
        try:
            async for chunk in super().Decode(request, context):
                if aborted.is_set():
                    await context.abort(grpc.StatusCode.CANCELLED, "aborted")
                yield chunk
        finally:
            del self.running[request.request_id]

    async def Abort(self, request, context):  # type: ignore[no-untyped-def]
        if request.request_id in self.running:
            self.running[request.request_id].set()
        return await super().Abort(request, context)


async def test_same_client_request_id_twice_one_disconnects_the_other_completes() -> None:
    decode = EngineLikeDecode()
    decode.delay_s = 0.02
    body = {"model": served_name(), "prompt": "x", "stream": True, "max_tokens": 40}
    headers = {"x-request-id": CLIENT_ID}
    async with (
        gateway_cluster(decode=decode) as c,
        httpx.AsyncClient(base_url=c.base_url, timeout=30) as http,
        http.stream("POST", "/v1/completions", json=body, headers=headers) as first,
    ):
        assert first.status_code == 200
        assert first.headers["x-request-id"] == CLIENT_ID
        first_lines = first.aiter_lines()
        await anext(first_lines)  # the first request is running on the decode worker
        async with http.stream("POST", "/v1/completions", json=body, headers=headers) as second:
            assert second.status_code == 200
            assert second.headers["x-request-id"] == CLIENT_ID
            second_lines = second.aiter_lines()
            second_events = [await anext(second_lines)]  # both run at once now
            assert len(decode.running) == 2
            # The first client goes away: its request is aborted on the workers...
            await first.aclose()
            await asyncio.wait_for(decode.seen.aborted.wait(), 10)
            # ...and the second still gets every token and a normal end.
            second_events += [line async for line in second_lines if line]
    assert second_events[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in second_events[:-1]]
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == "".join(
        t for _, t in decode.pieces
    )
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    first_id, second_id = (r.request_id for r in decode.seen.requests)
    assert first_id != second_id and CLIENT_ID not in (first_id, second_id)
    assert decode.seen.aborts == [first_id]
