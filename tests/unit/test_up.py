"""pdserve up: settings, engine placement, the children's command lines, the ready banner."""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from pdserve import settings as shared
from pdserve.cli.main import build_parser
from pdserve.cluster.backoff import Backoff
from pdserve.cluster.supervisor import ChildExitPolicy
from pdserve.cluster.up import (
    UpSettings,
    add_arguments,
    build_specs,
    cluster_ports,
    engine_placements,
    lending_table,
    ready_banner,
    redis_spec,
    run,
    served_model_name,
    shared_ports,
    split_line,
    supervisor_options,
)
from pdserve.placement.engines import (
    Placement,
    assign_cpu_cores,
    format_cores,
    gpus_to_use,
    lendable_cores,
    parse_cores,
    parse_gpu_list,
    place_engines,
)

PY = (sys.executable, "-m", "pdserve")


def parse(*argv: str) -> UpSettings:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return shared.from_args(UpSettings, parser.parse_args(argv))


def test_format_cores() -> None:
    assert format_cores([0]) == "0"
    assert format_cores([3, 0, 1, 2, 5, 7, 8]) == "0-3,5,7-8"


def test_parse_cores_is_the_inverse_of_format_cores() -> None:
    assert parse_cores("0-3,5,7-8") == [0, 1, 2, 3, 5, 7, 8]
    assert parse_cores(" 1 , 0") == [0, 1]
    for bad in ("", "a", "1-", "-1", "0-x", "nobind"):
        with pytest.raises(ValueError, match="not a list of CPU cores"):
            parse_cores(bad)


@pytest.mark.parametrize(
    ("cores", "prefill", "expected"),
    [
        (["0", "1"], 1, "0"),  # the 2-core machine: decode borrows the prefill core
        (["0", "1", "2", "3"], 1, "0"),
        (["0-1", "2", "3"], 2, "0-2"),  # every prefill engine's cores
        (["0", "1"], 0, ""),  # no prefill engine: nothing to lend
        (["0", "1"], 2, ""),  # no decode engine: nobody to borrow
        (["nobind"] * 3, 1, ""),  # engines sharing cores: no cores of their own
        ([None, None], 1, ""),  # GPUs
    ],
)
def test_lendable_cores(cores: list[str | None], prefill: int, expected: str) -> None:
    assert lendable_cores([Placement(cpu_cores=c) for c in cores], prefill) == expected


def test_decode_workers_borrow_the_prefill_cores_through_the_table(tmp_path: Path) -> None:
    s = parse("--decode", "2", "--log-dir", str(tmp_path))
    table = lending_table(s, [], [0, 1, 2], tmp_path)
    assert table == str(tmp_path / "cpu-lending") and Path(table).stat().st_size > 0
    specs, _ = build_specs(s, gpus=[], cores=[0, 1, 2], lending_table=table)
    prefill, decode0, decode1, _ = specs
    assert prefill.argv[-4:] == ("--cpu-cores", "0", "--cpu-lending", table)
    assert decode0.argv[-6:] == ("--cpu-cores", "1", "--cpu-lending", table, "--cpu-borrow", "0")
    assert decode1.argv[-6:] == ("--cpu-cores", "2", "--cpu-lending", table, "--cpu-borrow", "0")


def _rates(tmp_path: Path, prefill: float, decode: float) -> str:
    path = tmp_path / "engine.json"
    results = {"prefill_tokens_per_s": prefill, "decode_tokens_per_s": decode}
    path.write_text(json.dumps({"cores": "0", "results": {"vllm_prefill": results}}))
    return str(path)


def test_the_cores_are_split_by_the_phases_costs(tmp_path: Path) -> None:
    """docs/benchmarks.md, "Choosing the split": pdserve up gives the prefill engines the
    share of the cores that balances the phases (here 9 of 16), not half of them."""
    rates = _rates(tmp_path, prefill=279.0, decode=48.0)
    s = parse("--split-rates", rates, "--log-dir", str(tmp_path))
    table = lending_table(s, [], list(range(16)), tmp_path)
    specs, _ = build_specs(s, gpus=[], cores=list(range(16)), lending_table=table)
    prefill, decode, _ = specs
    assert prefill.argv[-4:] == ("--cpu-cores", "0-8", "--cpu-lending", table)
    assert decode.argv[-6:] == (
        "--cpu-cores",
        "9-15",
        "--cpu-lending",
        table,
        "--cpu-borrow",
        "0-8",
    )
    assert split_line(s, [], list(range(16))).startswith(
        "pdserve up: cores 0-8 for the prefill engines, 9-15 for the decode engines"
    )
    # Decode that costs more per request takes the larger share; each role's engines share it.
    s = parse("--split-rates", _rates(tmp_path, 2000.0, 8.0), "--prefill", "2", "--decode", "2")
    cores = [p.cpu_cores for p in engine_placements(s, [], list(range(16)))[0]]
    assert cores == ["0", "1", "2-8", "9-15"]
    # --cpu-split even: as many cores per engine.
    even = parse("--split-rates", rates, "--cpu-split", "even")
    assert [p.cpu_cores for p in engine_placements(even, [], list(range(16)))[0]] == ["0-7", "8-15"]
    assert split_line(even, [], list(range(16))) == ""
    # Two cores, or more engines than cores: as before.
    assert [p.cpu_cores for p in engine_placements(s, [], [0, 1, 2, 3])[0]] == ["0", "1", "2", "3"]
    assert [p.cpu_cores for p in engine_placements(s, [], [0, 1])[0]] == ["nobind"] * 4
    assert split_line(s, [], [0, 1]) == ""


def test_a_bad_split_setting_is_refused() -> None:
    with pytest.raises(ValidationError, match="not a workload"):
        parse("--split-workload", "512")
    with pytest.raises(ValidationError, match="cannot read the engine rates"):
        parse("--split-rates", "/nonexistent/engine.json")
    # --cpu-split even does not read the report.
    assert parse("--cpu-split", "even", "--split-rates", "/nonexistent/engine.json")


def test_no_lending_table_when_it_is_off_or_does_not_apply(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert lending_table(parse("--no-cpu-lending"), [], [0, 1], tmp_path) == ""
    assert "core lending off (--no-cpu-lending)" in capsys.readouterr().out
    assert lending_table(parse("--prefill", "2"), [], [0, 1], tmp_path) == ""  # shared cores
    assert "core lending off (it needs prefill and decode workers" in capsys.readouterr().out
    assert lending_table(parse(), ["0"], [0, 1], tmp_path) == ""  # GPUs
    assert not (tmp_path / "cpu-lending").exists()


@pytest.mark.parametrize(
    ("engines", "cores", "expected"),
    [
        (2, [0, 1], ["0", "1"]),  # the 2-core machine: one core per engine
        (1, [0, 1], ["0-1"]),
        (2, [0, 1, 2, 3], ["0-1", "2-3"]),
        (3, list(range(7)), ["0-2", "3-4", "5-6"]),
        (2, [2, 4, 6, 8], ["2,4", "6,8"]),  # affinity with holes
        (3, [0, 1], ["nobind"] * 3),  # more engines than cores: none pinned (they starve)
        (5, [4], ["nobind"] * 5),
    ],
)
def test_assign_cpu_cores(engines: int, cores: list[int], expected: list[str]) -> None:
    assert assign_cpu_cores(engines, cores) == expected


def test_place_engines_warns_only_when_sharing() -> None:
    placements, warning = place_engines(2, [], [0, 1])
    assert [p.cpu_cores for p in placements] == ["0", "1"] and warning is None
    assert all(not p.env for p in placements)
    _, warning = place_engines(3, [], [0, 1])
    assert warning == "warning: 3 engines share 2 CPU core(s)"


def test_unpinned_engines_get_one_thread_each() -> None:
    placements, warning = place_engines(3, [], [0, 1])
    assert [(p.cpu_cores, dict(p.env)) for p in placements] == [
        ("nobind", {"OMP_NUM_THREADS": "1"})
    ] * 3
    assert warning is not None


def test_place_engines_on_gpus_uses_cuda_visible_devices_and_no_cores() -> None:
    placements, warning = place_engines(3, ["0", "1"], [0, 1, 2, 3])
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in placements] == ["0", "1", "0"]
    assert all(p.cpu_cores is None for p in placements)
    assert warning == "warning: 3 engines share 2 GPU(s)"


def test_parse_gpu_list_ignores_mig_lines() -> None:
    text = (
        "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1234)\n"
        "  MIG 1g.10gb     Device  0: (UUID: MIG-5678)\n"
        "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-9abc)\n"
    )
    assert parse_gpu_list(text) == ["0", "1"]
    assert parse_gpu_list("No devices were found\n") == []


def test_gpus_named_win_over_detected_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pdserve.placement.engines.detect_gpus", lambda: ["0", "1"])
    assert gpus_to_use("2, 3") == ["2", "3"]
    assert gpus_to_use("") == ["0", "1"], "none named: every GPU nvidia-smi shows"
    assert gpus_to_use(" , ") == ["0", "1"], "a list naming none names none"


def test_default_command_lines_on_two_cpu_cores() -> None:
    specs, warning = build_specs(parse(), gpus=[], cores=[0, 1])
    assert warning is None
    assert [s.name for s in specs] == ["prefill-0", "decode-0", "gateway"]
    prefill, decode, gateway = specs
    assert prefill.argv == (
        *PY, "prefill", "--worker-id", "prefill-0", "--port", "50100", "--kv-port", "15100",
        "--cpu-cores", "0",
    )  # fmt: skip
    assert decode.argv == (
        *PY, "decode", "--worker-id", "decode-0", "--port", "50200", "--cpu-cores", "1",
    )  # fmt: skip
    assert gateway.argv == (
        *PY, "gateway", "--http-host", "127.0.0.1", "--http-port", "8000", "--grpc-port", "50051",
        "--prefill-workers=127.0.0.1:50100", "--decode-workers=127.0.0.1:50200",
    )  # fmt: skip
    assert gateway.stop_stage < prefill.stop_stage == decode.stop_stage, "gateway stops first"
    assert all(s.ready_check is not None for s in specs)


def test_command_lines_with_model_engine_args_and_more_workers() -> None:
    s = parse(
        "--prefill", "2", "--decode", "2", "--model", "models/tiny",
        "--prefill-engine-args=--enforce-eager", "--decode-engine-args", "--max-model-len 512",
        "--http-port", "8100", "--grpc-port", "50061", "--generation-config", "vllm",
    )  # fmt: skip
    specs, warning = build_specs(s, gpus=[], cores=[0, 1])
    assert warning == "warning: 4 engines share 2 CPU core(s)"
    by_name = {spec.name: spec.argv for spec in specs}
    assert by_name["prefill-1"][3:] == (
        "prefill", "--worker-id", "prefill-1", "--port", "50101", "--kv-port", "15101",
        "--model", "models/tiny", "--cpu-cores", "nobind", "--engine-args=--enforce-eager",
    )  # fmt: skip
    assert by_name["decode-1"][3:] == (
        "decode", "--worker-id", "decode-1", "--port", "50201", "--model", "models/tiny",
        "--cpu-cores", "nobind", "--engine-args=--max-model-len 512",
    )  # fmt: skip
    assert by_name["gateway"][3:] == (
        "gateway", "--http-host", "127.0.0.1", "--http-port", "8100", "--grpc-port", "50061",
        "--model", "models/tiny", "--generation-config", "vllm",
        "--prefill-workers=127.0.0.1:50100,127.0.0.1:50101",
        "--decode-workers=127.0.0.1:50200,127.0.0.1:50201",
    )  # fmt: skip


def test_every_worker_gets_the_redis_url() -> None:
    specs, _ = build_specs(parse("--redis-url", "redis://10.0.0.9:6379/0"), gpus=[], cores=[0, 1])
    for spec in specs[:2]:
        i = spec.argv.index("--redis-url")
        assert spec.argv[i + 1] == "redis://10.0.0.9:6379/0"


def test_no_prefill_workers_gives_the_gateway_an_empty_list() -> None:
    specs, _ = build_specs(parse("--prefill", "0"), gpus=["0"], cores=[0])
    assert [s.name for s in specs] == ["decode-0", "gateway"]
    assert "--prefill-workers=" in specs[-1].argv
    assert specs[0].env["CUDA_VISIBLE_DEVICES"] == "0"
    assert "--cpu-cores" not in specs[0].argv


def test_settings_from_env_and_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_UP_DECODE", "3")
    monkeypatch.setenv("PDSERVE_UP_PREFILL", "0")
    s = parse("--prefill", "2")
    assert (s.prefill, s.decode) == (2, 3), "flags override env"
    assert s.log_dir == ".pdserve/logs" and s.startup_timeout_s == 600 and s.shutdown_grace_s == 20
    with pytest.raises(ValidationError):
        parse("--decode", "0")
    with pytest.raises(ValidationError):
        parse("--prefill", "-1")


def test_restart_policy_is_the_default_and_maps_to_the_supervisor(tmp_path: Path) -> None:
    options = supervisor_options(parse(), tmp_path)
    assert options.on_child_exit is ChildExitPolicy.RESTART
    assert options.backoff == Backoff(initial_s=1.0, max_s=30.0, reset_after_s=60.0)
    s = parse("--on-child-exit", "stop-all", "--restart-backoff-s", "0.5",
              "--restart-backoff-max-s", "4", "--restart-reset-s", "10")  # fmt: skip
    options = supervisor_options(s, tmp_path)
    assert options.on_child_exit is ChildExitPolicy.STOP_ALL
    assert options.backoff == Backoff(initial_s=0.5, max_s=4.0, reset_after_s=10.0)
    assert (options.log_dir, options.grace_s) == (tmp_path, 20.0)


def test_restart_settings_are_validated() -> None:
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        parse("--on-child-exit", "ignore")
    with pytest.raises(ValidationError, match="restart_backoff_max_s"):
        parse("--restart-backoff-s", "10", "--restart-backoff-max-s", "5")
    with pytest.raises(ValidationError):
        parse("--restart-backoff-s", "0")


def test_private_redis_is_a_child_stopped_last(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    spec = redis_spec(6390)
    assert spec.argv[0] == "/usr/bin/redis-server"
    assert spec.name == "redis" and spec.ready_check is not None
    assert spec.argv[spec.argv.index("--port") + 1] == "6390"
    assert spec.argv[spec.argv.index("--bind") + 1] == "127.0.0.1"
    specs, _ = build_specs(parse(), gpus=[], cores=[0, 1])
    assert spec.stop_stage > max(s.stop_stage for s in specs), "workers withdraw from it first"


def test_run_without_redis_server_says_how_to_get_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    namespace = argparse.Namespace(log_dir=str(tmp_path), http_port=0, grpc_port=0,
                                   prefill_port=0, decode_port=0, kv_port=0)  # fmt: skip
    assert run(namespace) == 1
    assert "redis-server is not installed" in capsys.readouterr().err


def test_run_rejects_invalid_settings(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(argparse.Namespace(decode=0)) == 2
    assert "invalid settings" in capsys.readouterr().err


def test_run_refuses_ports_in_use(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert run(argparse.Namespace(http_port=port)) == 1
    err = capsys.readouterr().err  # other default ports may be busy too (a running cluster)
    assert f"port(s) {port}" in err and "in use" in err


def test_run_refuses_a_port_given_to_two_servers(capsys: pytest.CaptureFixture[str]) -> None:
    """Before anything starts: the second server could never bind it."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    # Two decode workers take 9130 and 9131; the KV port 9131 is the second one's.
    argv = ["--decode", "2", "--decode-port", "9130", "--kv-port", "9131", "--prefill-port",
            "9120", "--http-port", "9100", "--grpc-port", "9101"]  # fmt: skip
    assert run(parser.parse_args(argv)) == 2
    err = capsys.readouterr().err
    assert "port(s) 9131 given to more than one server" in err
    assert shared_ports(parse(*argv[:4])) == [], "the defaults never overlap"


def test_served_model_name() -> None:
    assert served_model_name("") == shared.DEFAULT_MODEL_NAME == "SmolLM2-135M-Instruct"
    assert served_model_name("/models/Qwen3-0.6B/") == "Qwen3-0.6B"
    assert served_model_name("/models/Qwen3-0.6B/", "qwen") == "qwen"


def test_a_served_model_name_reaches_the_gateway_and_every_worker() -> None:
    s = parse("--served-model-name", "colors", "--decode", "2")
    specs, _ = build_specs(s, gpus=[], cores=[0, 1])
    named = {
        spec.name for spec in specs
        if "--served-model-name" in spec.argv
        and spec.argv[spec.argv.index("--served-model-name") + 1] == "colors"
    }  # fmt: skip
    assert named == {"gateway", "prefill-0", "decode-0", "decode-1"}
    assert '"model": "colors"' in ready_banner(s, Path("logs"))


def test_lora_modules_reach_every_worker() -> None:
    specs, _ = build_specs(parse("--lora-modules", "a=/x/a,b=/x/b"), gpus=[], cores=[0, 1])
    given = {
        spec.name: spec.argv[spec.argv.index("--lora-modules") + 1]
        for spec in specs if "--lora-modules" in spec.argv
    }  # fmt: skip
    assert given == {"prefill-0": "a=/x/a,b=/x/b", "decode-0": "a=/x/a,b=/x/b"}


def test_extra_models_get_a_prefill_and_a_decode_worker_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    expected: list[dict[str, int] | None] = []
    monkeypatch.setattr(
        "pdserve.cluster.up.http_ok", lambda url, expect=None: expected.append(expect)
    )
    s = parse("--extra-models", "b=/m/b,c=/m/c", "--lora-modules", "a=/x/a")
    specs, _ = build_specs(s, gpus=[], cores=[0, 1])
    by_name = {spec.name: spec.argv for spec in specs}
    assert list(by_name) == [
        "prefill-0", "decode-0", "prefill-1", "decode-1", "prefill-2", "decode-2", "gateway",
    ]  # fmt: skip
    assert by_name["prefill-2"][3:] == (
        "prefill", "--worker-id", "prefill-2", "--port", "50102", "--kv-port", "15102",
        "--model", "/m/c", "--served-model-name", "c", "--cpu-cores", "0",
    )  # fmt: skip
    assert by_name["decode-1"][3:] == (
        "decode", "--worker-id", "decode-1", "--port", "50201",
        "--model", "/m/b", "--served-model-name", "b", "--cpu-cores", "1",
    )  # fmt: skip
    gateway = by_name["gateway"]
    assert gateway[gateway.index("--extra-models") + 1] == "b=/m/b,c=/m/c"
    assert "--prefill-workers=127.0.0.1:50100" in gateway, "the others are discovered"
    assert expected == [{"healthy_prefill_workers": 3, "healthy_decode_workers": 3}]
    assert {50102, 15102, 50202} <= {port for _, port in cluster_ports(s)}
    assert "3 prefill + 3 decode worker(s), models SmolLM2-135M-Instruct, b, c" in ready_banner(
        s, Path("logs")
    )
    with pytest.raises(ValueError, match="not name=dir"):
        parse("--extra-models", "b")


def test_ready_banner_has_a_runnable_curl_line() -> None:
    banner = ready_banner(parse(), Path("logs"))
    expected = (
        "curl -s http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' "
        """-d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": """
        """"Name three primary colors."}], "max_tokens": 32, "temperature": 0}'"""
    )
    assert expected in banner.splitlines()[5]
    assert 'OpenAI(base_url="http://127.0.0.1:8000/v1"' in banner
    assert 'model="SmolLM2-135M-Instruct"' in banner


def test_ready_banner_for_all_interfaces_points_clients_to_loopback() -> None:
    banner = ready_banner(parse("--host", "0.0.0.0", "--model", "m/Tiny"), Path("logs"))
    assert "http://127.0.0.1:8000/v1" in banner and '"model": "Tiny"' in banner


def test_command_lines_parse_with_the_real_subcommands() -> None:
    """The flags up passes are the ones the worker and gateway commands define."""
    from decode_service.config import DecodeSettings
    from gateway.config import GatewaySettings
    from prefill_service.config import PrefillSettings

    s = parse("--prefill", "0", "--model", "models/tiny", "--decode-engine-args=--enforce-eager")
    specs, _ = build_specs(s, gpus=[], cores=[0, 1])
    decode, gateway = specs
    args = build_parser("decode").parse_args(list(decode.argv[3:]))
    worker = shared.from_args(DecodeSettings, args)
    assert (worker.name, worker.port, worker.cpu_cores) == ("decode-0", 50200, "0-1")
    assert worker.engine_args == "--enforce-eager" and worker.model == "models/tiny"
    args = build_parser("gateway").parse_args(list(gateway.argv[3:]))
    settings = shared.from_args(GatewaySettings, args)
    assert settings.prefill_workers == [] and settings.decode_workers == ["127.0.0.1:50200"]
    assert (settings.http_host, settings.http_port, settings.grpc_port) == (
        "127.0.0.1",
        8000,
        50051,
    )

    specs, _ = build_specs(parse(), gpus=[], cores=[0, 1])
    args = build_parser("prefill").parse_args(list(specs[0].argv[3:]))
    prefill = shared.from_args(PrefillSettings, args)
    assert (prefill.name, prefill.port, prefill.kv_port) == ("prefill-0", 50100, 15100)
