"""The arithmetic of ``pdserve bench fleet`` (``pdserve.bench.fleet_report``) and the fake
workers' caches (``pdserve.bench.fleet_workers.Cache``), on hand-built inputs."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from pdserve.bench import fleet_report as report
from pdserve.bench.fleet_client import Turn
from pdserve.bench.fleet_workers import Cache

METRICS = """# HELP pdserve_gateway_route_seconds x
# TYPE pdserve_gateway_route_seconds histogram
pdserve_gateway_route_seconds_bucket{le="0.001"} 10.0
pdserve_gateway_route_seconds_bucket{le="0.002"} 90.0
pdserve_gateway_route_seconds_bucket{le="0.005"} 100.0
pdserve_gateway_route_seconds_bucket{le="+Inf"} 100.0
pdserve_gateway_route_seconds_count 100.0
pdserve_gateway_other_seconds_bucket{le="0.001"} 7.0
"""


def test_histogram_parsing_and_quantiles_interpolate_inside_the_bucket() -> None:
    buckets = report.parse_histogram(METRICS, "pdserve_gateway_route_seconds")
    assert buckets == [(0.001, 10.0), (0.002, 90.0), (0.005, 100.0), (math.inf, 100.0)]
    # rank 50 of 100 lies in (1 ms, 2 ms], 40 of its 80: half way
    assert report.histogram_quantile(buckets, 0.5) == pytest.approx(0.0015)
    # rank 99: 9 of the 10 in (2 ms, 5 ms]
    assert report.histogram_quantile(buckets, 0.99) == pytest.approx(0.002 + 0.003 * 0.9)
    # rank 5 in the first bucket, from 0
    assert report.histogram_quantile(buckets, 0.05) == pytest.approx(0.0005)


def test_quantiles_of_a_run_are_of_the_buckets_difference() -> None:
    before = [(0.001, 100.0), (0.002, 100.0), (math.inf, 100.0)]
    after = [(0.001, 100.0), (0.002, 200.0), (math.inf, 200.0)]
    run = report.bucket_delta(after, before)
    assert run == [(0.001, 0.0), (0.002, 100.0), (math.inf, 100.0)]
    assert report.histogram_quantile(run, 0.5) == pytest.approx(0.0015)
    both = report.add_buckets([run, before])
    assert both == [(0.001, 100.0), (0.002, 200.0), (math.inf, 200.0)]


def test_quantiles_beyond_the_last_bound_and_of_nothing() -> None:
    beyond = [(0.1, 1.0), (math.inf, 10.0)]
    assert report.histogram_quantile(beyond, 0.99) == 0.1  # at least the highest bound
    assert report.histogram_quantile([(0.1, 0.0), (math.inf, 0.0)], 0.5) is None
    assert report.histogram_quantile([], 0.5) is None


def test_spread_is_the_busiest_worker_over_the_fair_share() -> None:
    workers = ["a", "b", "c", "d"]
    assert report.spread(Counter(a=2, b=2, c=2, d=2), workers) == 1.0
    # 8 in all, fair share 2; "a" got 5; a worker that got nothing still counts in the share
    assert report.spread(Counter(a=5, b=2, c=1), workers) == 2.5
    assert report.spread(Counter(), workers) is None


def _turn(c: int, t: int, prefill: str, prompt: int = 100, cached: int = 0,
          ok: bool = True, gateway: int = 0) -> Turn:  # fmt: skip
    return Turn(c, t, gateway, ok=ok, prefill=prefill, decode="d" + prefill,
                prompt_tokens=prompt, cached_tokens=cached)  # fmt: skip


def test_holder_share_counts_later_turns_on_the_previous_turns_worker() -> None:
    turns = [
        _turn(0, 0, "p0", prompt=100),
        _turn(0, 1, "p0", prompt=140, cached=96),  # same worker, cached every full block
        _turn(0, 2, "p1", prompt=180, cached=0),  # moved: not the holder
        _turn(1, 0, "p1", prompt=50),
        _turn(1, 1, "p1", prompt=90, cached=32),  # same worker, but its cache lost a block
        _turn(2, 0, "p0", ok=False),
        _turn(2, 1, "p0"),  # after a failed turn: not counted
    ]
    pairs = report.later_turns(turns)
    assert [(p.conversation, t.turn) for p, t in pairs] == [(0, 1), (0, 2), (1, 1)]
    assert report.holder_share(pairs) == pytest.approx(2 / 3)
    # hits: (0, 1) holds 96 >= 100 // 16 * 16; (1, 1) 32 < 48
    assert report.hit_share(pairs, 16) == pytest.approx(1 / 3)
    assert report.holder_share([]) is None
    assert report.new_requests(turns, "prefill") == Counter(p0=1, p1=1)


def test_redis_counters() -> None:
    stats = {"cmdstat_sadd": {"calls": 10, "usec": 5}, "cmdstat_info": {"calls": 3},
             "cmdstat_evalsha": {"calls": 2}, "errorstat_ERR": {"count": 1}}  # fmt: skip
    calls = report.command_calls(stats)
    assert calls == {"sadd": 10, "evalsha": 2}  # the benchmark's own INFO left out
    assert report.calls_delta({"sadd": 15, "evalsha": 2}, calls) == {"sadd": 5}
    assert report.cpu_seconds({"used_cpu_sys": "1.5", "used_cpu_user": 2}) == 3.5


def test_table_has_a_row_per_fleet_size() -> None:
    point = {"workers": 16, "index_pairs": 1000, "gateways": [{"requests": 5}],
             "total": {"requests": 10, "failed": 0, "route_p99_ms": 1.234}}  # fmt: skip
    text = report.table([point])
    assert "| 16 | 1,000 | 10 | 0 |" in text and "| 1.23 |" in text
    assert "| 16 | 0 | 5 |" in report.gateway_table([point])


def test_the_cache_evicts_its_least_recently_used_blocks() -> None:
    cache = Cache(capacity=3)
    assert cache.store([1, 2, 3]) == ([1, 2, 3], [])
    assert cache.held([1, 2, 9]) == 2
    cache.store([1])  # used again: 2 is now the oldest
    assert cache.store([4, 5]) == ([4, 5], [2, 3])
    assert list(cache.blocks) == [1, 4, 5]
    # a block stored and evicted in the same step is neither written nor removed
    small = Cache(capacity=1)
    assert small.store([7, 8]) == ([8], [])


def test_a_p99_beyond_the_last_bucket_is_shown_as_such() -> None:
    buckets = [(0.05, 90.0), (0.1, 95.0), (math.inf, 100.0)]
    assert report.beyond(buckets) == 5.0
    stats = {"requests": 100, "route_over_100ms": 5.0, "route_p99_ms": 100.0}
    point = {"workers": 256, "gateways": [stats], "total": stats}
    assert "| > 100 |" in report.table([point]) and "| > 100 |" in report.gateway_table([point])
    stats["route_over_100ms"] = 0.0
    assert "| 100.00 |" in report.table([point])
