"""GatewaySettings: env and CLI spellings of worker lists, validation, defaults."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from gateway.config import GatewaySettings
from pdserve.settings import cli_args, from_args


def test_worker_lists_from_env_are_comma_separated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_GATEWAY_DECODE_WORKERS", "10.0.0.1:50200, 10.0.0.2:50201")
    monkeypatch.setenv("PDSERVE_GATEWAY_PREFILL_WORKERS", "")
    monkeypatch.setenv("PDSERVE_GATEWAY_PREFILL_FAILURE_POLICY", "fail")
    settings = GatewaySettings()
    assert settings.decode_workers == ["10.0.0.1:50200", "10.0.0.2:50201"]
    assert settings.prefill_workers == []
    assert settings.prefill_failure_policy == "fail"


def test_worker_lists_from_cli_override_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_GATEWAY_DECODE_WORKERS", "envhost:1")
    parser = argparse.ArgumentParser()
    cli_args(parser, GatewaySettings)
    args = parser.parse_args(
        ["--decode-workers", "a:1,b:2", "--decode-workers", "c:3", "--http-port", "0"]
    )
    settings = from_args(GatewaySettings, args)
    assert settings.decode_workers == ["a:1", "b:2", "c:3"]
    assert settings.http_port == 0
    assert settings.grpc_port == 50051 and settings.http_host == "127.0.0.1"


@pytest.mark.parametrize(
    "bad",
    [
        {"decode_workers": ["no-port"]},
        {"prefill_failure_policy": "retry"},
        {"request_timeout_s": 0},
    ],
)
def test_invalid_settings_are_refused(bad: dict) -> None:
    with pytest.raises(ValidationError):
        GatewaySettings(**bad)


def test_settings_are_frozen_and_name_defaults_to_dir() -> None:
    settings = GatewaySettings(model="/models/SmolLM2-135M-Instruct/")
    with pytest.raises(ValidationError):
        settings.http_port = 1  # type: ignore[misc]
    assert settings.model_dir() == "/models/SmolLM2-135M-Instruct/"
    assert settings.model_name(settings.model_dir()) == "SmolLM2-135M-Instruct"
    assert GatewaySettings(served_model_name="x").model_name("/a/b") == "x"


def test_an_unknown_picker_is_refused_before_anything_starts(capsys) -> None:
    """The settings do not import the routing plugins: ``pdserve gateway`` checks the name
    against the registry the plugins add themselves to, before it binds anything."""
    import gateway.__main__ as gateway_main
    from gateway.routing import plugins, registry

    parser = argparse.ArgumentParser()
    gateway_main.add_arguments(parser)
    assert gateway_main.run(parser.parse_args(["--picker", "nope"])) == 2
    assert "unknown picker 'nope'; known: auto, prefix, round_robin" in capsys.readouterr().err
    assert set(plugins.BUILT_IN) == set(registry.PICKERS) == {"prefix", "round_robin"}
    with pytest.raises(ValueError, match="unknown picker"):
        registry.make_picker("nope", None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="taken"):
        registry.register("prefix")(lambda context: None)  # type: ignore[arg-type,return-value]
