"""``pdserve.placement.machine``: CPU model and ISA features from /proc/cpuinfo or lscpu text."""

from __future__ import annotations

from pdserve.placement.machine import _from_lscpu, _from_proc, cpu_info, describe

PROC = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu
"""

LSCPU = """Architecture:   x86_64
Model name:     AMD EPYC
Flags:          fpu sse2 avx avx2
"""


def test_proc_cpuinfo_first_processor() -> None:
    model, flags = _from_proc(PROC)
    assert model == "Intel(R) Xeon(R) Platinum 8480+"
    assert {"avx2", "avx512f", "avx512_bf16", "amx_tile"} <= flags


def test_lscpu() -> None:
    model, flags = _from_lscpu(LSCPU)
    assert model == "AMD EPYC"
    assert "avx2" in flags and "avx512f" not in flags


def test_cpu_info_shape_and_description() -> None:
    info = cpu_info()
    assert set(info["isa"]) == {"avx2", "avx512f", "avx512_bf16", "amx"}
    assert all(isinstance(v, bool) for v in info["isa"].values())
    assert info["cpus"] >= 1 and info["model_name"]
    line = describe(info)
    assert line.startswith(info["model_name"])


def test_describe_lists_missing_features() -> None:
    isa = {"avx2": True, "avx512f": False, "avx512_bf16": False, "amx": False}
    info = {"model_name": "X", "cpus": 4, "machine": "x86_64", "isa": isa}
    assert describe(info) == "X, 4 CPUs, x86_64: avx2, no avx512f avx512_bf16 amx"
