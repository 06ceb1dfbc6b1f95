"""Defaults shared by every service, and the one way settings objects are built.

Every service has one frozen settings object (a ``pydantic_settings.BaseSettings`` subclass)
read from its environment prefix and overridden by command-line flags; ``cli_args`` turns the
fields of such a class into ``--flag`` arguments so that env and CLI names always agree:
field ``http_port`` of a class with prefix ``PDSERVE_GATEWAY_`` is ``PDSERVE_GATEWAY_HTTP_PORT``
or ``--http-port``.
"""

from __future__ import annotations

import argparse
import json
import os
import types
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

from pydantic import Field
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings, SettingsConfigDict

# Ports (DESIGN.md "Ports and defaults"). Workers take base + index.
GATEWAY_HTTP_PORT = 8000
GATEWAY_GRPC_PORT = 50051
PREFILL_GRPC_PORT = 50100
DECODE_GRPC_PORT = 50200
PREFILL_KV_PORT = 15100
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    """Where prepared models live: ``$PDSERVE_CACHE_DIR`` or ``~/.cache/pdserve``."""
    root = os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve"
    return Path(root)


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def base_config(env_prefix: str) -> SettingsConfigDict:
    return SettingsConfigDict(
        env_prefix=env_prefix, frozen=True, extra="forbid", env_parse_none_str="none"
    )


class LogSettings(BaseSettings):
    """Logging of every pdserve process, from the environment only (read by
    ``pdserve.telemetry.log``):
    ``PDSERVE_LOG_LEVEL`` and ``PDSERVE_LOG_FORMAT``. A worker's own ``--log-level`` wins."""

    model_config = base_config("PDSERVE_LOG_")

    level: str = Field(default="INFO", description="log level (DEBUG, INFO, WARNING, ERROR)")
    format: Literal["text", "json"] = Field(
        default="text",
        description="text: one readable line per record; json: one JSON object per line",
    )


S = TypeVar("S", bound=BaseSettings)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def sets_flag(args: list[str], flag: str) -> bool:
    """Whether command-line ``args`` give ``flag`` (as ``--flag value`` or ``--flag=value``)."""
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _scalar_type(annotation: Any) -> Any:
    """The type argparse should convert a flag with; strips Optional."""
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return _scalar_type(args[0]) if len(args) == 1 else str
    return annotation


def cli_args(parser: argparse.ArgumentParser, cls: type[BaseSettings]) -> None:
    """Add one ``--flag`` per field of ``cls`` (default: unset, so env and defaults apply)."""
    for name, field in cls.model_fields.items():
        kind = _scalar_type(field.annotation)
        help_text = field.description or ""
        if field.default not in (None, PydanticUndefined) and not callable(field.default):
            help_text += f" (default: {field.default})"
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif get_origin(kind) is Literal:
            kwargs["choices"] = list(get_args(kind))
        elif get_origin(kind) is list:
            kwargs["type"] = str
            kwargs["action"] = "append"
        elif kind in (int, float, str):
            kwargs["type"] = kind
        else:
            kwargs["type"] = str
        parser.add_argument(_flag(name), **kwargs)


def from_args(cls: type[S], namespace: argparse.Namespace, **overrides: Any) -> S:
    """Build ``cls`` from env + defaults, overridden by the flags present in ``namespace``."""
    values = {k: v for k, v in vars(namespace).items() if k in cls.model_fields}
    for name, value in list(values.items()):
        annotation = _scalar_type(cls.model_fields[name].annotation)
        if get_origin(annotation) is list:
            values[name] = [item for v in value for item in _split_list(v)]
    values.update(overrides)
    return cls(**values)


def _split_list(value: str) -> list[str]:
    value = value.strip()
    if value.startswith("["):
        return [str(v) for v in json.loads(value)]
    return [v.strip() for v in value.split(",") if v.strip()]


def named_paths(
    entries: str | list[str], what: str, path_word: str = "path"
) -> list[tuple[str, str]]:
    """``name=path[,name=path...]`` (a string, or its entries as a list) as (name, path)
    pairs, blanks skipped; an entry without a name or a path is a ValueError naming ``what``
    (the setting) and ``path_word`` (what the path is)."""
    items = entries.split(",") if isinstance(entries, str) else entries
    pairs = []
    for item in filter(None, (part.strip() for part in items)):
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"{what}: {item!r} is not name={path_word}")
        pairs.append((name.strip(), path.strip()))
    return pairs
