"""`pdserve gateway` as a process: serves, then stops cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
from typing import Any

import httpx

from pdserve.bench.fake_worker import FakeDecode, start_worker
from tests.helpers import model_dir, served_name

SERVING = re.compile(r"HTTP on \S+:(?P<http>\d+), gRPC on \S+:(?P<grpc>\d+)")


async def _wait_healthy(url: str, proc: asyncio.subprocess.Process, timeout_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with httpx.AsyncClient() as http:
        while asyncio.get_running_loop().time() < deadline:
            assert proc.returncode is None, "gateway exited during start-up"
            try:
                if (await http.get(url + "/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
    raise AssertionError("gateway did not become healthy")


async def _serving_line(proc: asyncio.subprocess.Process) -> dict[str, Any]:
    """Read the output up to the gateway's "serving" line; its HTTP and gRPC ports."""
    assert proc.stdout is not None
    before = b""
    while line := await proc.stdout.readline():
        before += line
        found = SERVING.search(line.decode(errors="replace"))
        if found:
            return {"http": int(found["http"]), "grpc": int(found["grpc"]), "before": before}
    raise AssertionError(f"the gateway exited before serving:\n{before.decode()}")


async def test_gateway_process_serves_and_stops_on_sigterm() -> None:
    decode = FakeDecode()
    server = await start_worker(decode)
    args = ["--model", model_dir(), "--decode-workers", f"127.0.0.1:{server.port}"]
    args += ["--http-port", "0", "--grpc-port", "0"]  # it binds and logs the real ports
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdserve", "gateway", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        head = await asyncio.wait_for(_serving_line(proc), 120)
        url = f"http://127.0.0.1:{head['http']}"
        await _wait_healthy(url, proc, timeout_s=60)
        async with httpx.AsyncClient(base_url=url) as http:
            body = {"model": served_name(), "prompt": "Hi", "max_tokens": 2}
            response = await http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        proc.send_signal(signal.SIGTERM)
        rest, _ = await asyncio.wait_for(proc.communicate(), 20)
        output = head["before"] + rest
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await server.stop(0)
    assert proc.returncode == 0, output.decode()
    assert b"gateway stopped" in output
    assert b"Traceback" not in output
    assert len(decode.seen.requests) == 1
