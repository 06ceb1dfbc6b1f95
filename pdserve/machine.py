"""What CPU this is: model name and the instruction sets that decide engine defaults.

Read from ``/proc/cpuinfo`` (no torch or vLLM import), so ``pdserve up``, the workers and the
benchmarks all see the same answer and every benchmark result can name the machine.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path
from typing import Any

# The flags that change which kernels vLLM's CPU backend can use.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


@functools.cache
def _cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = platform.processor() or platform.machine(), frozenset[str]()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and value.strip():
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
    return model, flags


def cpu_model() -> str:
    return _cpuinfo()[0]


def cpu_flags() -> frozenset[str]:
    return _cpuinfo()[1]


def native_bf16() -> bool:
    """True when bf16 matrix work has native kernels (AVX-512 BF16 or AMX): without them vLLM
    falls back to a slow torch path ("Failed to create oneDNN linear")."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def describe() -> dict[str, Any]:
    """The machine, for every benchmark result: CPU model, usable cores, ISA flags."""
    flags = cpu_flags()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu_model": cpu_model(),
        "arch": platform.machine(),
        "cores": cores,
        "isa": [f for f in ISA_FLAGS if f in flags],
        "native_bf16": native_bf16(),
    }
