"""pdserve bench engine: which bare engines run, and which of their rates the split uses."""

from __future__ import annotations

import pytest

from pdserve.bench.engine import _engines, _medians, _ratios, decode_figures
from pdserve.placement.topology import rates_from_report


def test_the_bare_engine_runs_once_per_worker_role_listed() -> None:
    assert _engines("vllm,prefill,decode") == ["vllm_prefill", "vllm_decode", "prefill", "decode"]
    assert _engines("decode,vllm") == ["decode", "vllm_decode"]
    assert _engines("vllm") == ["vllm_prefill"]  # no worker listed: the prefill role's arguments


def test_an_unknown_engine_is_refused_by_name() -> None:
    with pytest.raises(SystemExit, match="'monolith'"):
        _engines("vllm,monolith")


def test_the_split_takes_each_rate_from_its_own_role() -> None:
    results = {
        "vllm_prefill": {"prefill_tokens_per_s": 240.0, "decode_tokens_per_s": 60.0},
        "vllm_decode": {"prefill_tokens_per_s": 230.0, "decode_tokens_per_s": 55.0},
    }
    rates = rates_from_report({"cores": "0-1", "results": results}, "run")
    assert (rates.prefill_tokens_per_s, rates.decode_tokens_per_s) == (120.0, 55.0)
    del results["vllm_decode"]
    rates = rates_from_report({"cores": "0", "results": results}, "run")
    assert (rates.prefill_tokens_per_s, rates.decode_tokens_per_s) == (240.0, 60.0)
    with pytest.raises(ValueError, match="not a pdserve bench engine"):
        rates_from_report({"cores": "0", "results": {}}, "run")


def test_each_worker_is_compared_with_the_bare_engine_of_its_role() -> None:
    results = {
        "vllm_prefill": {"prefill_tokens_per_s": 200.0, "decode_tokens_per_s": 50.0},
        "vllm_decode": {"prefill_tokens_per_s": 250.0, "decode_tokens_per_s": 40.0},
        "prefill": {"prefill_tokens_per_s": 180.0},
        "decode": {"prefill_tokens_per_s": 200.0, "decode_tokens_per_s": 44.0},
    }
    assert _ratios(results) == pytest.approx(
        {"prefill_prefill": 0.9, "decode_prefill": 0.8, "decode_decode": 1.1}
    )
    # Gaps are not rates: a worker's ITL gets no "speed" ratio beside its tokens/s.
    results["decode"]["decode_itl_p99_ms"] = 30.0
    results["vllm_decode"]["decode_itl_p99_ms"] = 25.0
    assert "decode_decode_itl_p99_ms" not in _ratios(results)


def test_decode_figures_count_only_the_time_every_request_streamed() -> None:
    # Two requests: the second starts 1 s late; from then on both get a token every 10 ms,
    # and the first has one 50 ms gap. Its earlier tokens count neither in the rate nor the gaps.
    first = [(t / 1000, 1) for t in (0, 500, 1000, 1010, 1020, 1070, 1080, 1090)]
    second = [(t / 1000, 1) for t in (1000, 1010, 1020, 1030, 1040, 1050, 1060, 1070)]
    figures = decode_figures([first, second])
    assert figures["decode_tokens_per_s"] == pytest.approx(12 / 0.090)
    assert figures["decode_itl_p50_ms"] == pytest.approx(10.0)
    assert 10.0 < figures["decode_itl_p99_ms"] <= 50.0
    assert figures["decode_itl_p99_ms"] == pytest.approx(50.0, rel=0.2)


def test_rounds_report_the_median_of_each_figure() -> None:
    rows = [{"a": 1.0, "b": 9.0}, {"a": 3.0, "b": 7.0}, {"a": 2.0, "b": 8.0}]
    assert _medians(rows) == {"a": 2.0, "b": 8.0}
    assert _medians([]) == {}
