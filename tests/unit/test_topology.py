"""The DistServe-style split of cores between prefill and decode (pdserve.placement.topology)."""

from __future__ import annotations

import pytest

from pdserve.placement.topology import best_split


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
