"""`pdserve gateway` as a process: serves, then stops cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import sys

import httpx

from pdserve.fake_worker import FakeDecode, start_worker
from tests.helpers import free_port, model_dir, served_name


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


async def test_gateway_process_serves_and_stops_on_sigterm() -> None:
    decode = FakeDecode()
    server = await start_worker(decode)
    http_port, grpc_port = free_port(), free_port()
    args = ["--model", model_dir(), "--decode-workers", f"127.0.0.1:{server.port}"]
    args += ["--http-port", str(http_port), "--grpc-port", str(grpc_port)]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdserve", "gateway", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{http_port}"
        await _wait_healthy(url, proc, timeout_s=60)
        async with httpx.AsyncClient(base_url=url) as http:
            body = {"model": served_name(), "prompt": "Hi", "max_tokens": 2}
            response = await http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        proc.send_signal(signal.SIGTERM)
        output, _ = await asyncio.wait_for(proc.communicate(), 20)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await server.stop(0)
    assert proc.returncode == 0, output.decode()
    assert b"gateway stopped" in output
    assert b"Traceback" not in output
    assert len(decode.seen.requests) == 1
