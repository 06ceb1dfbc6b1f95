"""``pdserve bench serve``'s workloads: the ``vllm bench serve`` arguments each one runs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from pdserve.bench import serve as bench_serve
from pdserve.bench import systems as bench_systems


def _args(*argv: str, **extra: Any) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    args = parser.parse_args(list(argv))
    for key, value in extra.items():
        setattr(args, key, value)
    return args


def _client_args(args: argparse.Namespace, tmp_path: Path) -> dict[str, str]:
    [(label, argv)] = bench_systems.workload_runs("random", args, tmp_path)
    assert label == "random"
    flags = [i for i, a in enumerate(argv) if a.startswith("--")]
    return {argv[i]: (argv[i + 1] if i + 1 not in flags and i + 1 < len(argv) else "")
            for i in flags}  # fmt: skip


def test_random_requests_are_all_alike_unless_a_range_is_asked_for(tmp_path: Path) -> None:
    fixed = _client_args(_args(), tmp_path)
    assert fixed["--random-input-len"] == "512"
    assert fixed["--random-output-len"] == "64"
    assert float(fixed["--random-range-ratio"]) == 0.0
    ranged = _client_args(_args("--range-ratio", "0.5"), tmp_path)
    assert float(ranged["--random-range-ratio"]) == 0.5


def test_vllms_client_takes_the_random_workloads_arguments(tmp_path: Path) -> None:
    from vllm.benchmarks import datasets

    [(_, argv)] = bench_systems.workload_runs("random", _args("--range-ratio", "0.25"), tmp_path)
    parser = argparse.ArgumentParser()
    datasets.add_dataset_parser(parser)
    known, _ = parser.parse_known_args(argv)
    assert known.dataset_name == "random"
    assert float(known.random_range_ratio) == 0.25
    assert known.random_input_len == 512


@pytest.mark.parametrize("ratio", [-0.1, 1.0, 1.5])
def test_a_range_outside_zero_to_one_is_refused_before_anything_starts(
    ratio: float, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench_serve.run(_args(range_ratio=ratio, workloads="random")) == 2
    assert "--range-ratio must be in [0, 1)" in capsys.readouterr().err
