"""Service-level objectives (``gateway.slo``): the gateway's settings and a request's own
headers (HTTP) or metadata (gRPC); each finished generation counted met or missed per
objective in ``pdserve_gateway_slo_requests``, from the gateway's own timings."""

from __future__ import annotations

import grpc
import httpx

from pdserve.bench.fake_worker import FakeDecode
from protos.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.helpers import counted, gateway_cluster, metrics_text

SLO = "pdserve_gateway_slo_requests"
BODY = {"prompt": "Count to three:", "max_tokens": 4}


def outcomes(metrics: str) -> dict[tuple[str, str], float]:
    return {
        (objective, outcome): counted(metrics, f"{SLO}_total", objective=objective, outcome=outcome)
        for objective in ("ttft", "tpot", "all")
        for outcome in ("met", "missed")
    }


async def test_each_objective_is_counted_met_or_missed_and_a_request_sets_its_own() -> None:
    # Tokens 50 ms apart: a 1 ms objective per output token is missed, 10 s is met.
    decode = FakeDecode(delay_s=0.05)
    async with (
        gateway_cluster(decode=decode, slo_ttft_ms=10_000, slo_tpot_ms=1) as c,
        httpx.AsyncClient(base_url=c.base_url) as http,
    ):
        assert (await http.post("/v1/completions", json=BODY)).status_code == 200
        first = outcomes(await metrics_text(c.base_url))
        assert first[("ttft", "met")] == 1 and first[("ttft", "missed")] == 0
        assert first[("tpot", "missed")] == 1 and first[("tpot", "met")] == 0
        assert first[("all", "missed")] == 1 and first[("all", "met")] == 0

        own = {"x-pdserve-slo-tpot-ms": "10000"}
        answer = await http.post("/v1/chat/completions", headers=own, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        })  # fmt: skip
        assert answer.status_code == 200, answer.text
        second = outcomes(await metrics_text(c.base_url))
        assert second[("tpot", "met")] == 1 and second[("all", "met")] == 1
        assert second[("ttft", "met")] == 2

        tight = {"x-pdserve-slo-ttft-ms": "0.001"}
        assert (await http.post("/v1/completions", headers=tight, json=BODY)).status_code == 200
        third = outcomes(await metrics_text(c.base_url))
        assert third[("ttft", "missed")] == 1 and third[("all", "missed")] == 2


async def test_a_bad_objective_is_a_400_naming_the_header_and_nothing_is_counted() -> None:
    async with gateway_cluster() as c, httpx.AsyncClient(base_url=c.base_url) as http:
        for value in ("abc", "0", "-5", "nan", "inf"):
            answer = await http.post(
                "/v1/completions", headers={"x-pdserve-slo-ttft-ms": value}, json=BODY
            )
            assert answer.status_code == 400, (value, answer.text)
            assert "x-pdserve-slo-ttft-ms" in answer.json()["error"]["message"]
        assert (await http.post("/v1/completions", json=BODY)).status_code == 200
        # No objective set by the gateway or the request: nothing counted.
        assert counted(await metrics_text(c.base_url), SLO) == 0


async def test_grpc_metadata_sets_a_requests_objectives() -> None:
    decode = FakeDecode(delay_s=0.05)
    async with gateway_cluster(decode=decode) as c:
        request = generate_pb2.GenerateRequest(
            text="Count to three:", params=common_pb2.SamplingParams(max_tokens=4)
        )
        async with grpc.aio.insecure_channel(c.grpc_target) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            metadata = (("x-pdserve-slo-tpot-ms", "1"),)
            _ = [r async for r in stub.Generate(request, metadata=metadata, timeout=10)]
            bad = (("x-pdserve-slo-tpot-ms", "soon"),)
            try:
                _ = [r async for r in stub.Generate(request, metadata=bad, timeout=10)]
                raise AssertionError("a bad objective was accepted")
            except grpc.aio.AioRpcError as err:
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "x-pdserve-slo-tpot-ms" in (err.details() or "")
        seen = outcomes(await metrics_text(c.base_url))
        assert seen[("tpot", "missed")] == 1 and seen[("all", "missed")] == 1
        assert seen[("ttft", "met")] + seen[("ttft", "missed")] == 0
