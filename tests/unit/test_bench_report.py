"""pdserve bench serve's statistics (pdserve.bench.report) on hand-made vLLM results."""

from __future__ import annotations

import math

import pytest

from pdserve.bench.report import Slo, percentile, ratios, slo_from, summarize, table


def result(ttfts: list[float], itls: list[list[float]], errors: list[str] | None = None) -> dict:
    n = len(ttfts)
    return {
        "duration": 10.0, "completed": n - sum(1 for e in errors or [] if e),
        "failed": sum(1 for e in errors or [] if e), "request_throughput": n / 10.0,
        "output_throughput": 3.0, "ttfts": ttfts, "itls": itls,
        "latencies": [t + sum(i) for t, i in zip(ttfts, itls, strict=True)],
        "start_times": [float(k) for k in range(n)], "errors": errors or [""] * n,
    }  # fmt: skip


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5
    assert percentile([0, 10], 90) == pytest.approx(9.0)
    assert math.isnan(percentile([], 50))


def test_summary_ignores_failed_requests_and_counts_goodput_against_the_slo() -> None:
    raw = result(
        [0.1, 0.2, 5.0, 0.1],
        [[0.01, 0.01], [0.02, 0.2], [0.01], [9.0]],
        errors=["", "", "", "boom"],
    )
    row = summarize(raw, Slo(ttft_s=1.0, tpot_s=0.05))
    assert row["failed"] == 1 and row["completed"] == 3
    assert row["ttft_p50_ms"] == pytest.approx(200.0)  # 0.1, 0.2, 5.0 (the failed one out)
    assert row["itl_p99_ms"] < 9000  # the failed request's 9 s gap is not counted
    # request 0 meets both; 1 has TPOT 110 ms; 2 has TTFT 5 s: one good request in 10 s
    assert row["goodput_requests_per_s"] == pytest.approx(0.1)


def test_default_slo_is_the_baselines_p90_and_ratios_say_who_is_better() -> None:
    base = result([1.0] * 10, [[0.1, 0.1]] * 10)
    ours = result([0.5] * 10, [[0.05, 0.05]] * 10)
    slo = slo_from(base)
    assert slo == Slo(ttft_s=pytest.approx(1.0), tpot_s=pytest.approx(0.1))
    rows = [
        {"workload": "w", "system": "pdserve", **summarize(ours, slo)},
        {"workload": "w", "system": "vllm", **summarize(base, slo)},
    ]
    (r,) = ratios(rows, "pdserve", "vllm")
    assert r["throughput"] == pytest.approx(1.0)
    assert r["ttft_p99_better"] == pytest.approx(2.0)
    assert r["itl_p99_better"] == pytest.approx(2.0)
    assert "| w | pdserve |" in table(rows)


def test_throughput_is_requests_in_flight_over_mean_e2e() -> None:
    # Same requests, one system finishes them in half the time: twice the requests in flight
    # on average, E2E the same, so its throughput gain is all "in flight".
    slow = result([1.0] * 4, [[1.0, 1.0]] * 4)  # E2E 3 s each, 10 s run
    fast = {**result([1.0] * 4, [[1.0, 1.0]] * 4), "duration": 5.0, "request_throughput": 0.8}
    rows = [
        {"workload": "w", "system": "pdserve", **summarize(fast, None)},
        {"workload": "w", "system": "vllm", **summarize(slow, None)},
    ]
    assert rows[1]["e2e_mean_ms"] == pytest.approx(3000.0)
    assert rows[1]["in_flight_mean"] == pytest.approx(1.2)  # 4 x 3 s in 10 s
    for row in rows:
        assert row["requests_per_s"] == pytest.approx(
            row["in_flight_mean"] * 1000.0 / row["e2e_mean_ms"]
        )
    (r,) = ratios(rows, "pdserve", "vllm")
    assert r["throughput"] == pytest.approx(2.0)
    assert r["in_flight"] == pytest.approx(2.0) and r["e2e_mean_better"] == pytest.approx(1.0)
    assert r["throughput"] == pytest.approx(r["in_flight"] * r["e2e_mean_better"])


def test_several_rounds_give_every_rounds_rows_and_the_median_ratios() -> None:
    import argparse

    from pdserve.bench.report import build, plotted, times_text

    def round_of(speed: float) -> tuple[dict, dict]:
        base = result([1.0] * 10, [[0.1, 0.1]] * 10)
        ours = result([1.0] * 10, [[0.1 / speed, 0.1 / speed]] * 10)
        return {"random": {"pdserve": ours, "vllm": base}}, {"random": {}}

    args = argparse.Namespace(slo_ttft_ms=0, slo_tpot_ms=0)
    rounds = [round_of(speed) for speed in (1.0, 4.0, 2.0)]
    report = build(rounds, {"cpu": "test"}, args)
    assert [(r["round"], r["system"]) for r in report["rows"]] == [
        (1, "pdserve"), (1, "vllm"), (2, "pdserve"), (2, "vllm"), (3, "pdserve"), (3, "vllm"),
    ]  # fmt: skip
    (random,) = report["ratios"]
    assert random["per_round"]["itl_p99_better"] == pytest.approx([1.0, 4.0, 2.0])
    assert random["itl_p99_better"] == pytest.approx(2.0)  # the median, not the mean
    assert times_text(random)("itl_p99_better") == "x2.00 (rounds 1.00, 4.00, 2.00)"
    assert "| random r2 | pdserve |" in table(report["rows"])
    assert sorted(plotted(rounds)["random"]) == [
        "pdserve r1", "pdserve r2", "pdserve r3", "vllm r1", "vllm r2", "vllm r3",
    ]  # fmt: skip
    one = build(rounds[:1], {}, args)
    assert "round" not in one["rows"][0] and "per_round" not in one["ratios"][0]
    assert times_text(one["ratios"][0])("throughput") == "x1.00"
