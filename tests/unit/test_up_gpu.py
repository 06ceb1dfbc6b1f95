"""pdserve up on GPUs, checked without one: the generated worker command lines, environment,
engine arguments and vLLM KV connector configuration for 1P1D on one GPU and xPyD on several,
and the side-channel port of each worker.

The contract these follow is vLLM 0.32's NixlConnector (paths relative to
vllm/distributed/kv_transfer/kv_connector/v1/nixl/ unless they say otherwise):
- the scheduler binds its side channel at ``VLLM_NIXL_SIDE_CHANNEL_HOST``:
  ``VLLM_NIXL_SIDE_CHANNEL_PORT`` + data-parallel index (base_scheduler.py:76-80, 318-333,
  349-351; defaults "localhost" and 5600, vllm/envs.py:1734-1741), and hands that host and port
  to decode workers in every hand-off (pull_scheduler.py:284-285): so one port per worker on a
  host, and a host the others can reach;
- ``kv_role`` producer/consumer (kv_both is deprecated, connector.py:97-103), the engine id
  required (connector.py:94-95), ``kv_lease_duration`` read from the extra config
  (base_scheduler.py:82-86);
- an engine's memory budget is ``--gpu-memory-utilization`` x the whole GPU, and it fails when
  less than that is free at start (vllm/v1/worker/utils.py:724-775); it fails too when another
  process frees GPU memory while it profiles (vllm/v1/worker/gpu_worker.py:713-726).
"""

from __future__ import annotations

import argparse
import socket
from types import SimpleNamespace
from typing import Any

import pytest

from decode_service.config import DecodeSettings
from kv_transfer import compat
from pdserve import settings as shared
from pdserve.cli.main import build_parser
from pdserve.cluster import gpu as up_gpu
from pdserve.cluster.supervisor import ChildSpec
from pdserve.cluster.up import UpSettings, add_arguments, build_specs, busy_ports, run
from pdserve.worker import engine
from prefill_service.config import PrefillSettings


def parse(*argv: str) -> UpSettings:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return shared.from_args(UpSettings, parser.parse_args(argv))


def worker(spec: ChildSpec) -> Any:
    """The settings the worker builds from the command line ``pdserve up`` gives it."""
    role = spec.argv[3]
    cls = PrefillSettings if role == "prefill" else DecodeSettings
    return shared.from_args(cls, build_parser(role).parse_args(list(spec.argv[3:])))


def by_name(specs: list[ChildSpec]) -> dict[str, ChildSpec]:
    return {spec.name: spec for spec in specs}


def test_connector_follows_the_machine() -> None:
    assert up_gpu.connector_for("auto", ["0"]) == "nixl"
    assert up_gpu.connector_for("auto", []) == "pdserve"
    assert up_gpu.connector_for("nixl", []) == "nixl"  # NIXL runs on CPU KV caches too
    with pytest.raises(up_gpu.ConnectorError, match="CPU KV caches only"):
        up_gpu.connector_for("pdserve", ["0", "1"])


def test_one_prefill_and_one_decode_on_one_gpu() -> None:
    specs, warning = build_specs(parse(), gpus=["0"], cores=list(range(16)))
    assert warning == "warning: 2 engines share 1 GPU(s)"
    named = by_name(specs)
    prefill, decode = named["prefill-0"], named["decode-0"]
    # One GPU: both engines see it, each takes 0.9 / 2 of its memory, and the decode engine
    # starts once the prefill engine is ready (their memory profiling must not overlap).
    assert prefill.env["CUDA_VISIBLE_DEVICES"] == decode.env["CUDA_VISIBLE_DEVICES"] == "0"
    assert prefill.after == () and decode.after == ("prefill-0",)
    assert prefill.argv[3:] == (
        "prefill", "--worker-id", "prefill-0", "--port", "50100",
        "--kv-connector", "nixl", "--nixl-port", "5600",
        "--engine-args=--gpu-memory-utilization 0.45",
    )  # fmt: skip
    assert decode.argv[3:] == (
        "decode", "--worker-id", "decode-0", "--port", "50200",
        "--kv-connector", "nixl", "--nixl-port", "5601",
        "--engine-args=--gpu-memory-utilization 0.45",
    )  # fmt: skip
    assert not any(a.startswith("--cpu-cores") for s in specs for a in s.argv)
    # What the workers make of it: vLLM's side-channel variables, a port each, on loopback.
    p, d = worker(prefill), worker(decode)
    assert engine.nixl_env(p) == {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600",
    }
    assert engine.nixl_env(d)["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5601"


def test_the_workers_kv_transfer_config_is_vllms_nixl_connector() -> None:
    specs, _ = build_specs(parse(), gpus=["0"], cores=[0])
    named = by_name(specs)
    configs = {
        name: engine.kv_transfer_config(worker(named[name]), engine_id=name)
        for name in ("prefill-0", "decode-0")
    }
    for name, role in (("prefill-0", "kv_producer"), ("decode-0", "kv_consumer")):
        config = configs[name]
        assert config.kv_connector == "NixlConnector"
        assert config.kv_connector_module_path is None, "vLLM's own, from its registry"
        assert config.kv_role == role
        assert config.engine_id == name
        assert config.kv_load_failure_policy == "fail"
        assert config.get_from_extra_config("kv_lease_duration", None) == 30


def test_the_memory_share_reaches_vllms_engine_arguments() -> None:
    specs, _ = build_specs(parse(), gpus=["0"], cores=[0])
    args = engine.engine_args(worker(specs[0]), model="/models/some-model")
    assert args.gpu_memory_utilization == pytest.approx(0.45)


@pytest.mark.parametrize(
    ("gpus", "shares", "after"),
    [
        # 2P2D on four GPUs: one each, vLLM's default budget, all start at once.
        (["0", "1", "2", "3"], [None] * 4, [(), (), (), ()]),
        # 2P2D on two GPUs: engines go round-robin (prefill-0, prefill-1, decode-0, decode-1
        # on GPUs 0, 1, 0, 1), so each GPU holds one prefill and one decode engine.
        (["0", "1"], [0.45] * 4, [(), (), ("prefill-0",), ("prefill-1",)]),
    ],
)
def test_xpyd_on_several_gpus(
    gpus: list[str], shares: list[float | None], after: list[tuple[str, ...]]
) -> None:
    specs, _ = build_specs(parse("--prefill", "2", "--decode", "2"), gpus=gpus, cores=[0])
    workers = specs[:4]
    assert [s.name for s in workers] == ["prefill-0", "prefill-1", "decode-0", "decode-1"]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in workers] == [
        gpus[i % len(gpus)] for i in range(4)
    ]
    settings = [worker(s) for s in workers]
    assert [w.nixl_port for w in settings] == [5600, 5601, 5602, 5603]
    assert len({engine.nixl_env(w)["VLLM_NIXL_SIDE_CHANNEL_PORT"] for w in settings}) == 4
    expected = [f"--gpu-memory-utilization {x:g}" if x else "" for x in shares]
    assert [w.engine_args for w in settings] == expected
    assert [s.after for s in workers] == after


def test_three_engines_on_one_gpu_share_it_in_thirds() -> None:
    specs, _ = build_specs(parse("--decode", "2"), gpus=["0"], cores=[0])
    assert [worker(s).engine_args for s in specs[:3]] == ["--gpu-memory-utilization 0.3"] * 3
    assert [s.after for s in specs[:3]] == [(), ("prefill-0",), ("decode-0",)]
    assert up_gpu.memory_shares(["0"] * 7) == [0.12] * 7  # rounded down: never over 0.9


def test_the_users_memory_choice_wins() -> None:
    s = parse(
        "--prefill-engine-args=--gpu-memory-utilization=0.2 --max-model-len 4096",
        "--decode-engine-args", "--max-model-len 4096",
    )  # fmt: skip
    specs, _ = build_specs(s, gpus=["0"], cores=[0])
    assert worker(specs[0]).engine_args == "--gpu-memory-utilization=0.2 --max-model-len 4096"
    assert worker(specs[1]).engine_args == "--gpu-memory-utilization 0.45 --max-model-len 4096"


def test_nixl_port_base_and_cpu_clusters_unchanged() -> None:
    specs, _ = build_specs(
        parse("--nixl-port", "7000", "--decode", "2"), gpus=["0", "1"], cores=[0]
    )
    assert [worker(s).nixl_port for s in specs[:3]] == [7000, 7001, 7002]
    # Without a GPU nothing of this appears: the pdserve connector and its KV port.
    cpu, _ = build_specs(parse(), gpus=[], cores=[0, 1])
    assert "--kv-connector" not in cpu[0].argv and "--kv-port" in cpu[0].argv
    assert all(s.after == () for s in cpu)


def test_the_choice_is_printed_at_start_up() -> None:
    line = up_gpu.choice_line("nixl", ["0"], 5600, 2)
    assert line == (
        "pdserve up: 1 GPU(s) found (0): KV connector nixl (vLLM's NixlConnector, UCX), "
        "NIXL side channel on 127.0.0.1 ports 5600-5601"
    )
    assert up_gpu.choice_line("pdserve", [], 5600, 2) == (
        "pdserve up: no GPU found: KV connector pdserve (TCP between CPU KV caches)"
    )


def test_side_channel_ports_in_use_are_refused() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        s = parse("--nixl-port", str(port - 1))  # decode-0's side channel is taken
        assert port in busy_ports(s, "nixl")
        assert port not in busy_ports(s, "pdserve")


def test_run_refuses_the_pdserve_connector_on_gpus(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("pdserve.placement.engines.detect_gpus", lambda: ["0"])
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args(["--kv-connector", "pdserve"])) == 2
    assert "CPU KV caches only" in capsys.readouterr().err


def test_workers_refuse_a_connector_that_cannot_run() -> None:
    gpu_pdserve = PrefillSettings(kv_connector="pdserve")
    assert "use --kv-connector nixl" in str(engine.connector_problem(gpu_pdserve, True, True))
    assert engine.connector_problem(gpu_pdserve, False, False) is None
    nixl = DecodeSettings(kv_connector="nixl")
    assert "pip install nixl" in str(engine.connector_problem(nixl, True, False))
    assert engine.connector_problem(nixl, True, True) is None


def test_side_channel_host_is_the_advertised_address() -> None:
    """Bound by the worker and handed to decode workers as remote_host: an address others
    reach, never the 0.0.0.0 the gRPC server may bind."""
    pod = PrefillSettings(kv_connector="nixl", host="0.0.0.0", advertise_host="10.0.0.7")
    assert engine.nixl_env(pod)["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.7"
    own = PrefillSettings(kv_connector="nixl", host="0.0.0.0", nixl_host="192.168.1.5")
    assert engine.nixl_env(own)["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "192.168.1.5"
    assert engine.nixl_env(PrefillSettings()) == {}, "nothing of NIXL with pdserve's connector"


def test_gpus_given_are_used_instead_of_detected_ones(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("pdserve.placement.engines.detect_gpus", lambda: [])
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args(["--gpus", "2, 3", "--kv-connector", "pdserve"])) == 2
    assert "run on GPU(s) 2, 3" in capsys.readouterr().err


def test_the_kv_tier_on_gpus_is_lmcache_beneath_nixl(monkeypatch: pytest.MonkeyPatch) -> None:
    """--kv-tier on GPU workers: vLLM's MultiConnector over NIXL (first: hand-offs win) and
    vLLM's stock LMCacheConnectorV1; the layout NIXL requires is the only one required
    (multi_connector.py:624-654; LMCacheConnectorV1 requires none)."""
    monkeypatch.setattr("pdserve.worker.engine.has_gpu", lambda: True)
    s = parse("--kv-tier", "redis", "--redis-url", "redis://127.0.0.1:6379/0")
    specs, _ = build_specs(s, gpus=["0"], cores=[0])
    settings = worker(specs[0])
    config = engine.kv_transfer_config(settings, engine_id="prefill-0")
    assert config.kv_connector == "MultiConnector" and config.kv_role == "kv_producer"
    nixl, tier = config.kv_connector_extra_config["connectors"]
    assert nixl["kv_connector"] == "NixlConnector"
    assert nixl["kv_connector_extra_config"] == {"kv_lease_duration": 30}
    assert tier == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_producer"}
    view = SimpleNamespace(kv_transfer_config=config, model_config=SimpleNamespace(use_mla=False),
                           cache_config=SimpleNamespace(kv_cache_layout=None))  # fmt: skip
    assert compat.kv_cache_layout(view) == "LBHNC"
    assert compat.connector_identity(view).startswith("NixlConnector/")
