"""vLLM's ``request_id`` body field names a request when no ``x-request-id`` header does: the
response's id is cmpl-/chatcmpl- and it, and the x-request-id header echoes it."""

from __future__ import annotations

import httpx

from tests.helpers import gateway_cluster

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}


async def test_the_body_names_the_request_unless_the_header_does() -> None:
    async with gateway_cluster() as c, httpx.AsyncClient(base_url=c.base_url) as http:
        chat = await http.post("/v1/chat/completions", json={**CHAT, "request_id": "job-7"})
        completion = await http.post("/v1/completions", json={**COMPLETION, "request_id": "j.8"})
        both = await http.post(
            "/v1/completions",
            json={**COMPLETION, "request_id": "body"},
            headers={"x-request-id": "header"},
        )
        neither = await http.post("/v1/completions", json=COMPLETION)
        bad = await http.post("/v1/completions", json={**COMPLETION, "request_id": "a b"})
    assert chat.json()["id"] == "chatcmpl-job-7" and chat.headers["x-request-id"] == "job-7"
    assert completion.json()["id"] == "cmpl-j.8" and completion.headers["x-request-id"] == "j.8"
    assert both.json()["id"] == "cmpl-header" and both.headers["x-request-id"] == "header"
    assert neither.json()["id"] == "cmpl-" + neither.headers["x-request-id"]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_id"
