"""What machine a benchmark ran on: CPU model, core count and the ISA features that decide
engine settings (AVX2, AVX-512, AVX-512 BF16, AMX). Every benchmark result carries it.

    info = cpu_info()    # {"model_name": "AMD EPYC", "cpus": 2, "isa": {"avx2": True, ...}, ...}
    describe(info)       # "AMD EPYC, 2 CPUs, x86_64: avx2 avx512f avx512_bf16, no amx"

Read from ``/proc/cpuinfo`` (Linux), else from ``lscpu``; where neither answers, the model
is ``platform.processor()`` and every feature reads False.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

# Feature name in the result -> any of these kernel flags means present.
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "avx2": ("avx2",),
    "avx512f": ("avx512f",),
    "avx512_bf16": ("avx512_bf16",),
    "amx": ("amx_tile", "amx_bf16", "amx_int8"),
}


def _from_proc(text: str) -> tuple[str, set[str]]:
    """(model name, flags) of the first processor in ``/proc/cpuinfo`` text."""
    model, flags = "", set[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:  # Features: ARM
            flags = set(value.split())
    return model, flags


def _from_lscpu(text: str) -> tuple[str, set[str]]:
    model, flags = "", set[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Model name" and not model:
            model = value.strip()
        elif key.strip() == "Flags":
            flags = set(value.split())
    return model, flags


def _read() -> tuple[str, set[str], str]:
    try:
        model, flags = _from_proc(Path("/proc/cpuinfo").read_text())
        if model or flags:
            return model, flags, "/proc/cpuinfo"
    except OSError:
        pass
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=True)
        model, flags = _from_lscpu(out.stdout)
        if model or flags:
            return model, flags, "lscpu"
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor(), set(), "platform"


def cpu_info() -> dict[str, Any]:
    """The CPU as a JSON-ready dict.

    Keys: ``model_name`` (str), ``cpus`` (logical CPUs this process may use), ``machine``
    (e.g. "x86_64"), ``isa`` ({"avx2", "avx512f", "avx512_bf16", "amx"} -> bool; amx: any of
    amx_tile/amx_bf16/amx_int8), ``source`` (where the facts came from)."""
    model, flags, source = _read()
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 0
    return {
        "model_name": model or "unknown",
        "cpus": cpus,
        "machine": platform.machine(),
        "isa": {name: any(f in flags for f in names) for name, names in ISA_FLAGS.items()},
        "source": source,
    }


def describe(info: dict[str, Any]) -> str:
    """One line for a report, e.g. "AMD EPYC, 2 CPUs, x86_64: avx2 avx512f, no avx512_bf16 amx"."""
    isa = info["isa"]
    have = " ".join(name for name, present in isa.items() if present) or "none"
    lack = " ".join(name for name, present in isa.items() if not present)
    line = f"{info['model_name']}, {info['cpus']} CPUs, {info['machine']}: {have}"
    return f"{line}, no {lack}" if lack else line


def native_bf16(info: dict[str, Any] | None = None) -> bool:
    """True when bf16 matrix work has native kernels (AVX-512 BF16 or AMX): without them vLLM
    falls back to a slow torch path ("Failed to create oneDNN linear")."""
    isa = (info or cpu_info())["isa"]
    return bool(isa["avx512_bf16"] or isa["amx"])
