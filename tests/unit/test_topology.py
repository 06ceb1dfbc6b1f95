"""The DistServe-style split of cores between prefill and decode (pdserve.placement.topology),
as pdserve up applies it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.placement.topology import (
    MEASURED,
    Rates,
    best_split,
    load_rates,
    parse_workload,
    prefill_cores,
)


def test_two_cores_are_always_one_and_one() -> None:
    split = best_split(2, 512, 64, prefill_tokens_per_s=500, decode_tokens_per_s=100)
    assert (split.prefill_cores, split.decode_engines) == (1, 1)
    # 500/512 = 0.98 req/s of prefill per core; 100/64 = 1.56 req/s per decode engine
    assert split.requests_per_s == pytest.approx(500 / 512)
    assert split.bound == "prefill"


def test_the_phases_get_cores_in_the_ratio_of_their_costs() -> None:
    # Long prompts, short answers: prefill needs most of the machine.
    long_in = best_split(16, 4096, 64, prefill_tokens_per_s=500, decode_tokens_per_s=100)
    assert long_in.prefill_cores > long_in.decode_engines
    # Short prompts, long answers: decode does.
    long_out = best_split(16, 128, 1024, prefill_tokens_per_s=500, decode_tokens_per_s=100)
    assert long_out.decode_engines > long_out.prefill_cores
    # No split of 16 cores serves more than the balanced one.
    mu_p, mu_d = 500 / 4096, 100 / 64
    assert all(
        min(p * mu_p, (16 - p) * mu_d) <= long_in.requests_per_s + 1e-12 for p in range(1, 16)
    )


def test_one_core_is_refused() -> None:
    with pytest.raises(ValueError, match="2 cores"):
        best_split(1, 512, 64, 500, 100)


RATES = Rates(prefill_tokens_per_s=279.0, decode_tokens_per_s=48.0, source="test")


def test_pdserve_up_gives_prefill_the_balanced_share_with_a_core_per_engine() -> None:
    # 512 in / 64 out: a prefill core serves 0.545 requests/s, a decode core 0.75: of 16
    # cores, 9 to prefill (4.9 requests/s against 5.25 of decode; 10 would leave decode 4.5).
    assert prefill_cores(16, 1, 1, (512, 64), RATES) == 9
    assert prefill_cores(2, 1, 1, (512, 64), RATES) == 1
    # Long prompts want prefill cores, but each decode engine keeps one of its own.
    assert prefill_cores(16, 1, 1, (4096, 64), RATES) == 14
    assert prefill_cores(16, 1, 4, (4096, 64), RATES) == 12
    # ... and each prefill engine too.
    assert prefill_cores(16, 6, 1, (64, 4096), RATES) == 6
    # Without engines of one role, the other has every core.
    assert prefill_cores(8, 0, 2, (512, 64), RATES) == 0
    assert prefill_cores(8, 2, 0, (512, 64), RATES) == 8
    with pytest.raises(ValueError, match="4 engines need"):
        prefill_cores(3, 2, 2, (512, 64), RATES)


def test_rates_come_from_a_bench_engine_report_per_core(tmp_path: Path) -> None:
    report = {
        "cores": "0-1",
        "results": {
            "vllm_prefill": {"prefill_tokens_per_s": 1236.0, "decode_tokens_per_s": 150.0},
            "vllm_decode": {"prefill_tokens_per_s": 1200.0, "decode_tokens_per_s": 153.0},
            "prefill": {"prefill_tokens_per_s": 1.0},
        },
    }
    path = tmp_path / "engine.json"
    path.write_text(json.dumps(report))
    rates = load_rates(str(path), native_bf16=False)
    assert (rates.prefill_tokens_per_s, rates.decode_tokens_per_s) == (618.0, 153.0)
    assert rates.source == str(path)
    # Without a report: the figures measured on a CPU of the same class.
    assert load_rates("", native_bf16=True) == MEASURED[True]
    assert (
        load_rates("", native_bf16=False).prefill_tokens_per_s < MEASURED[True].prefill_tokens_per_s
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "cannot read"), ("{", "cannot read"), ('{"results": {}}', "not a pdserve bench")],
)
def test_an_unusable_rates_file_is_a_clear_error(
    tmp_path: Path, content: str | None, message: str
) -> None:
    path = tmp_path / "engine.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_rates(str(path), native_bf16=False)


def test_workload() -> None:
    assert parse_workload("512:64") == (512, 64)
    for bad in ("512", "512:", "a:64", "0:64", "512:-1"):
        with pytest.raises(ValueError, match="not a workload"):
            parse_workload(bad)
