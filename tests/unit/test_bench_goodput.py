"""``pdserve bench goodput``: goodput scored as vLLM's ``--goodput``, the derived SLO, the
settings it refuses, and what each system is started with (hand-made vLLM results, no
servers)."""

from __future__ import annotations

import argparse
import math
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from pdserve.bench import goodput as bench_goodput
from pdserve.bench import goodput_report as report
from pdserve.bench import systems as bench_systems
from pdserve.bench.report import Slo


def result(requests: list[tuple[float, float, int, str]], duration: float = 4.0) -> dict:
    """A saved ``vllm bench serve`` result of (TTFT s, E2E s, output tokens, error) requests;
    a failed request has 0 output tokens, as vLLM writes it."""
    n = len(requests)
    lens = [0 if err else tokens for _, _, tokens, err in requests]
    return {
        "duration": duration, "request_throughput": n / duration, "output_throughput": 1.0,
        "ttfts": [r[0] for r in requests], "latencies": [r[1] for r in requests],
        "output_lens": lens, "errors": [r[3] for r in requests],
        # one gap per token after the first, evenly spread
        "itls": [[(e2e - ttft) / (k - 1)] * (k - 1) if k > 1 else []
                 for (ttft, e2e, _, _), k in zip(requests, lens, strict=True)],
    }  # fmt: skip


SLO = Slo(ttft_s=0.5, tpot_s=0.25)


def test_a_request_exactly_at_both_objectives_is_good_and_one_just_over_is_not() -> None:
    # TPOT = (E2E - TTFT) / (tokens - 1) = (1.5 - 0.5) / 4 = 0.25: exactly at the objective
    assert report.good_requests(result([(0.5, 1.5, 5, "")]), SLO) == 1
    assert report.good_requests(result([(0.5001, 1.5001, 5, "")]), SLO) == 0  # TTFT over
    assert report.good_requests(result([(0.5, 1.5001, 5, "")]), SLO) == 0  # TPOT over


def test_tpot_is_vllms_per_request_figure_not_the_mean_gap_seen() -> None:
    # 5 tokens in two streamed chunks: one gap of 0.1 s seen, but (1.5 - 0.5) / 4 = 0.25 s
    raw = result([(0.5, 1.5, 5, "")])
    raw["itls"] = [[0.1]]
    assert report.request_tpot(raw, 0) == 0.25
    assert report.good_requests(raw, Slo(ttft_s=1.0, tpot_s=0.2)) == 0


def test_a_failed_request_is_never_good() -> None:
    raw = result([(0.1, 0.2, 5, "Internal Server Error"), (0.1, 0.2, 5, "")])
    assert report.good_requests(raw, SLO) == 1
    raw["errors"][0] = ""  # an empty reason phrase: the 0 output tokens still say it failed
    assert report.good_requests(raw, SLO) == 1
    assert report.summarize_run(raw, SLO, [1.0])["failed"] == 1


def test_a_one_token_answer_has_no_tpot_and_is_judged_by_its_ttft() -> None:
    raw = result([(0.4, 9.0, 1, ""), (0.6, 9.0, 1, "")])
    assert report.request_tpot(raw, 0) == 0.0
    assert report.good_requests(raw, SLO) == 1  # the second misses the TTFT objective


def test_goodput_is_good_requests_per_second_of_the_run_at_each_scale() -> None:
    raw = result([(0.5, 1.5, 5, ""), (0.9, 1.9, 5, ""), (0.2, 2.2, 5, "")], duration=4.0)
    assert report.goodput(raw, SLO) == 0.25  # the first only, in 4 s
    assert report.goodput(raw, SLO, scale=2.0) == 0.75  # TTFT 1.0, TPOT 0.5: all three
    assert report.goodput(raw, SLO, scale=0.5) == 0.0
    row = report.summarize_run(raw, SLO, [0.5, 1.0, 2.0])
    assert row["goodput"] == {"0.5": 0.0, "1": 0.25, "2": 0.75}
    assert row["failed"] == 0 and row["tpot_p50_ms"] == pytest.approx(250.0)


def test_goodput_matches_vllms_own_calculation() -> None:
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput
    from vllm.benchmarks.serve import calculate_metrics

    cases = [(0.5, 1.5, 5, ""), (0.5001, 1.0, 3, ""), (0.3, 9.0, 1, ""), (0.1, 0.2, 0, "boom"),
             (0.2, 1.4, 4, ""), (0.4, 0.5, 2, "")]  # fmt: skip
    outputs = [
        RequestFuncOutput(success=not err, ttft=ttft, latency=e2e, output_tokens=k, error=err)
        for ttft, e2e, k, err in cases
    ]
    raw = result(cases, duration=3.0)
    for scale in (0.5, 1.0, 2.0):
        slo = {"ttft": SLO.ttft_s * scale * 1000, "tpot": SLO.tpot_s * scale * 1000}
        metrics, lens = calculate_metrics([], outputs, 3.0, None, [50.0], slo)
        assert lens == raw["output_lens"]
        assert report.goodput(raw, SLO, scale) == pytest.approx(metrics.request_goodput)


def test_the_slo_is_twice_the_prefill_and_one_and_a_half_decode_steps() -> None:
    alone = result([(0.1, 0.5, 5, ""), (0.2, 0.6, 5, ""), (0.3, 0.7, 5, ""), (9.0, 9.0, 5, "x")])
    # gaps of 0.1, 0.2 and 0.3 s (4 each); the failed request's 9 s ones are not counted
    batched = result([(0.4, 0.8, 5, ""), (0.4, 1.2, 5, ""), (0.4, 1.6, 5, ""), (0, 36, 5, "x")])
    batched["itls"][3] = [9.0] * 4
    slo, measured = bench_goodput.derive_slo(alone, batched)
    assert slo.ttft_s == pytest.approx(0.4)  # 2 x 0.2 (the failed request's 9 s is not one)
    assert slo.tpot_s == pytest.approx(0.3)  # 1.5 x 0.2
    assert measured == {
        "prefill_ms": pytest.approx(200),
        "decode_step_batch4_ms": pytest.approx(200),
    }
    with pytest.raises(RuntimeError, match="calibration"):
        bench_goodput.derive_slo(result([(1.0, 2.0, 5, "boom")]), batched)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_goodput.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--request-rates", "0.5,-1"], "--request-rates must all be above 0"),
        (["--request-rates", "0"], "--request-rates must all be above 0"),
        (["--request-rates", "inf"], "finite"),
        (["--request-rates", "fast"], "numbers separated by commas"),
        (["--request-rates", ","], "--request-rates is empty"),
        (["--slo-scales", "1,0"], "--slo-scales must all be above 0"),
        (["--burstiness", "0"], "--burstiness must be above 0"),
        (["--range-ratio", "1"], "--range-ratio must be in [0, 1)"),
        (["--rounds", "0"], "--rounds must be at least 1"),
        (["--num-prompts", "0"], "--num-prompts must be at least 1"),
        (["--concurrency", "-1"], "--concurrency must be 0"),
        (["--slo-ttft-ms", "-5", "--slo-tpot-ms", "50"], "must be >= 0"),
        (["--slo-ttft-ms", "500"], "give both"),
        (["--systems", "vllm,sglang"], "--systems must name"),
        (["--systems", "vllm,vllm"], "--systems must name"),
    ],
)
def test_bad_settings_are_refused_before_anything_starts(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench_goodput.run(_args(*argv)) == 2
    assert message in capsys.readouterr().err


def test_the_defaults_are_accepted() -> None:
    assert bench_goodput.settings_problem(_args()) == ""
    assert (
        bench_goodput.settings_problem(_args("--slo-ttft-ms", "800", "--slo-tpot-ms", "90")) == ""
    )


def test_the_client_sends_poisson_arrivals_with_no_cap_unless_one_is_asked_for(
    tmp_path: Path,
) -> None:
    from vllm.benchmarks.serve import add_cli_args

    args = argparse.Namespace(**{**vars(_args()), "request_rate": 0.35})
    [(_, extra)] = bench_systems.workload_runs("random", args, tmp_path)
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    client = parser.parse_args(["--model", "m", *extra])
    assert client.request_rate == 0.35 and client.burstiness == 1.0
    assert client.max_concurrency is None
    assert float(client.random_range_ratio) == 0.5
    args.concurrency = 3
    [(_, extra)] = bench_systems.workload_runs("random", args, tmp_path)
    assert parser.parse_args(["--model", "m", *extra]).max_concurrency == 3


def test_each_pdserve_gets_its_policy_and_the_slo_and_vllm_serve_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    started: list[tuple[str, dict[str, str] | None]] = []

    @contextmanager
    def server(kind: str, args: Any, model: str, name: str, out: Path, env: Any = None) -> Any:
        started.append((kind, env))
        yield "http://127.0.0.1:1"

    def run_workload(workload: str, label: str, url: str, args: Any, *rest: Any) -> dict:
        return {"random": result([(0.1, 0.5, 5, "")] * args.num_prompts)}

    monkeypatch.setattr(bench_systems, "server", server)
    monkeypatch.setattr(bench_systems, "run_workload", run_workload)
    monkeypatch.setattr(bench_systems, "gateway_counters", lambda url: {})
    args = _args("--request-rates", "0.2,0.4", "--num-prompts", "3")
    slo = Slo(ttft_s=0.8, tpot_s=0.09)
    for system in ("vllm", "pdserve-static", "pdserve"):
        runs = bench_goodput.run_system(system, 1, args, slo, "model", "name", tmp_path)
        assert [(r["system"], r["rate"], r["requests"]) for r in runs] == [
            (system, 0.2, 3), (system, 0.4, 3)]  # fmt: skip
    assert started[0] == ("vllm", None)
    for (kind, env), policy in zip(started[1:], ("static", "adaptive"), strict=True):
        assert kind == "pdserve"
        assert env == {"PDSERVE_GATEWAY_DISAGG_POLICY": policy,
                       "PDSERVE_GATEWAY_SLO_TTFT_MS": "800.000",
                       "PDSERVE_GATEWAY_SLO_TPOT_MS": "90.000"}  # fmt: skip


def test_pdserve_ups_environment_gains_the_extra_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(
        bench_systems, "pdserve_cluster", lambda a, o, env=None: seen.update(env=env)
    )
    monkeypatch.setenv("PDSERVE_BENCH_TEST_MARK", "kept")
    bench_systems.server("pdserve", argparse.Namespace(), "m", "n", Path("."), {"A": "1"})
    assert seen["env"]["A"] == "1" and seen["env"]["PDSERVE_BENCH_TEST_MARK"] == "kept"
    bench_systems.server("pdserve", argparse.Namespace(), "m", "n", Path("."))
    assert seen["env"] is None  # pdserve_cluster's default: this process's environment


def _run(system: str, round_no: int, goodput: float, failed: int = 0) -> dict[str, Any]:
    return {"system": system, "rate": 0.5, "round": round_no, "failed": failed,
            "requests_per_s": 0.5, "ttft_p50_ms": 100.0, "goodput": {"1": goodput}}  # fmt: skip


def test_rounds_give_medians_failures_summed_and_ratios_of_the_medians() -> None:
    runs = [_run("vllm", 1, 0.2), _run("vllm", 2, 0.4, failed=1), _run("vllm", 3, 0.3),
            _run("pdserve-static", 1, 0.0), _run("pdserve", 1, 0.6)]  # fmt: skip
    results = report.medians(runs)
    vllm = results["vllm"]["0.5"]
    assert vllm["goodput"]["1"] == pytest.approx(0.3) and vllm["failed"] == 1
    assert vllm["goodput_per_round"] == {"1": [0.2, 0.4, 0.3]}
    table = report.goodput_table(results, [0.5], [1.0])
    assert table.splitlines()[0].endswith("| pdserve/vllm | pdserve/pdserve-static |")
    assert table.splitlines()[2].endswith("| x2.00 | - |")  # 0.6 / 0.3; static's goodput is 0
    assert math.isnan(report.ratio(1.0, 0.0))


def test_the_policys_decisions_and_the_gateways_slo_counts_are_kept_per_run() -> None:
    lines = ['pdserve_gateway_split_decisions_total{reason="static",where="prefill_worker"} 6.0',
             'pdserve_gateway_slo_requests_total{objective="all",outcome="met"} 3.0']  # fmt: skip
    assert all(bench_systems.COUNTERS.match(line) for line in lines)
    assert not bench_systems.COUNTERS.match("pdserve_gateway_split_decisions_created 1.7e9")
