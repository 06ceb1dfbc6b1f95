"""Where the engines of ``pdserve up`` run: one GPU each (``CUDA_VISIBLE_DEVICES``, shared
round-robin when there are more engines than GPUs, with a memory share each) or, on a machine
without one, their own CPU cores (``--cpu-cores``; two engines on one core halve each other's
speed, see notes/vllm-cpu.md)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from pdserve.cluster import gpu as up_gpu


@dataclass(frozen=True)
class Placement:
    """Where one vLLM engine runs: CPU cores (``--cpu-cores``) or a GPU (``env``); on a GPU
    shared with other engines, its share of the GPU's memory."""

    cpu_cores: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    gpu: str | None = None
    memory_share: float | None = None  # --gpu-memory-utilization (None: vLLM's default)
    lending_table: str = ""  # --cpu-lending: the engine takes part in core lending
    borrow_cores: str = ""  # --cpu-borrow: other engines' cores it may borrow


def format_cores(cores: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the form of VLLM_CPU_OMP_THREADS_BIND)."""
    runs: list[list[int]] = []
    for core in sorted(cores):
        if runs and core == runs[-1][-1] + 1:
            runs[-1].append(core)
        else:
            runs.append([core])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def parse_cores(text: str) -> list[int]:
    """``"0-2,5"`` -> ``[0, 1, 2, 5]`` (the inverse of ``format_cores``); ValueError when
    ``text`` is not such a list."""
    cores: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"not a list of CPU cores: {text!r} (e.g. '0' or '0-2,5')")
        cores += range(int(first), int(last or first) + 1)
    return sorted(set(cores))


def assign_cpu_cores(engines: int, cores: Sequence[int]) -> list[str]:
    """One ``--cpu-cores`` value per engine: ``cores`` split into contiguous shares, or, with
    more engines than cores, "nobind" for all: two engines pinned to one core starve each
    other (a prefill engine holding blocks for a pull spins on its core, and a decode engine
    pinned there made no progress until the lease ran out), so the OS schedules them."""
    ordered = sorted(cores)
    if not engines:
        return []
    if engines > len(ordered):
        return ["nobind"] * engines
    share, extra = divmod(len(ordered), engines)
    values, start = [], 0
    for i in range(engines):
        size = share + (1 if i < extra else 0)
        values.append(format_cores(ordered[start : start + size]))
        start += size
    return values


def lendable_cores(placements: Sequence[Placement], prefill: int) -> str:
    """The cores of the prefill engines (the first ``prefill`` of ``placements``, decode
    engines after them) that decode engines may borrow while those have nothing to compute
    (pdserve.worker.core_lending); "" where lending does not apply: an engine without cores
    of its own (a GPU, or more engines than cores), or no engine of one of the roles."""
    pinned = all(p.cpu_cores not in (None, "nobind") for p in placements)
    if not pinned or not 0 < prefill < len(placements):
        return ""
    return format_cores(
        sorted({c for p in placements[:prefill] for c in parse_cores(p.cpu_cores or "")})
    )


def lend_cores(placements: Sequence[Placement], prefill: int, table: str) -> list[Placement]:
    """``placements`` with core lending through ``table`` where it applies
    (``lendable_cores``): prefill engines lend, decode engines borrow."""
    borrow = lendable_cores(placements, prefill)
    if not borrow:
        return list(placements)
    return [replace(p, lending_table=table) for p in placements[:prefill]] + [
        replace(p, lending_table=table, borrow_cores=borrow) for p in placements[prefill:]
    ]


def assign_role_cores(
    prefill: int, decode: int, cores: Sequence[int], to_prefill: int
) -> list[str]:
    """``assign_cpu_cores`` for ``prefill`` prefill engines then ``decode`` decode engines,
    the first ``to_prefill`` of ``cores`` shared by the prefill engines and the rest by the
    decode engines (``pdserve.placement.topology.prefill_cores``); as ``assign_cpu_cores``
    when that leaves an engine without a core of its own."""
    ordered = sorted(cores)
    if not prefill <= to_prefill <= len(ordered) - decode:
        return assign_cpu_cores(prefill + decode, ordered)
    return assign_cpu_cores(prefill, ordered[:to_prefill]) + assign_cpu_cores(
        decode, ordered[to_prefill:]
    )


def place_engines(
    engines: int,
    gpus: Sequence[str],
    cores: Sequence[int],
    prefill: int = 0,
    to_prefill: int | None = None,
) -> tuple[list[Placement], str | None]:
    """A placement per engine (GPUs round-robin if any, else CPU cores) and a warning if
    shared. On CPU cores, with ``to_prefill``: the first ``prefill`` engines share that many
    cores and the others the rest (``assign_role_cores``); without, every engine gets as many."""
    if gpus:
        chosen = [gpus[i % len(gpus)] for i in range(engines)]
        placements = [
            Placement(env={"CUDA_VISIBLE_DEVICES": gpu}, gpu=gpu, memory_share=share)
            for gpu, share in zip(chosen, up_gpu.memory_shares(chosen), strict=True)
        ]
        shared_what = f"{len(gpus)} GPU(s)" if engines > len(gpus) else None
    else:
        placements = [
            # Unpinned engines (more engines than cores) get one OpenMP thread each, as a
            # pinned engine has: vLLM's kernels then compute bit-identically to it (with more
            # threads, a prompt's last token computed alone rounds differently).
            Placement(cpu_cores=c, env={"OMP_NUM_THREADS": "1"} if c == "nobind" else {})
            for c in (
                assign_cpu_cores(engines, cores)
                if to_prefill is None
                else assign_role_cores(prefill, engines - prefill, cores, to_prefill)
            )
        ]
        shared_what = f"{len(cores)} CPU core(s)" if engines > len(cores) else None
    warning = f"warning: {engines} engines share {shared_what}" if shared_what else None
    return placements, warning


def parse_gpu_list(text: str) -> list[str]:
    """GPU indices from ``nvidia-smi -L`` output (``GPU 0: NVIDIA H100 (UUID: ...)``)."""
    return re.findall(r"^GPU (\d+):", text, flags=re.MULTILINE)


def detect_gpus() -> list[str]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        done = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return parse_gpu_list(done.stdout) if done.returncode == 0 else []


def gpus_to_use(listed: str) -> list[str]:
    """The GPUs named in ``listed`` (comma-separated indices, as ``--gpus`` takes them), or
    every GPU ``nvidia-smi`` shows when it names none."""
    return [g.strip() for g in listed.split(",") if g.strip()] or detect_gpus()


def usable_cores() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))
