"""The allocator a CPU engine's processes start with (LD_PRELOAD)."""

from __future__ import annotations

import os
from pathlib import Path

from pdserve.worker.engine import cpu_preload, find_tcmalloc, preload_tcmalloc

TC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def test_tcmalloc_is_preloaded_first_when_nothing_is() -> None:
    preload, why, ok = cpu_preload("", TC)
    assert (preload, ok) == (TC, True)
    assert why == f"LD_PRELOAD {TC}: tcmalloc, as vLLM asks for on the CPU"


def test_tcmalloc_goes_before_what_is_preloaded_already() -> None:
    preload, _, ok = cpu_preload("/opt/libgomp.so.1", TC)
    assert (preload, ok) == (f"{TC}:/opt/libgomp.so.1", True)


def test_an_allocator_the_user_preloaded_stands() -> None:
    for given in ("/x/libjemalloc.so.2", f"/y/libgomp.so:{TC}"):
        preload, why, ok = cpu_preload(given, TC)
        assert (preload, ok) == (given, True)
        assert given in why


def test_without_tcmalloc_the_preload_is_unchanged_and_says_what_to_install() -> None:
    preload, why, ok = cpu_preload("/opt/libgomp.so.1", "")
    assert (preload, ok) == ("/opt/libgomp.so.1", False)
    assert "libtcmalloc-minimal4" in why


def test_find_tcmalloc_prefers_the_minimal_library_and_its_versioned_name(tmp_path: Path) -> None:
    empty, lib = tmp_path / "empty", tmp_path / "lib"
    empty.mkdir()
    lib.mkdir()
    for name in ("libtcmalloc.so.4", "libtcmalloc_minimal.so.4.5.10", "libtcmalloc_minimal.so.4",
                 "libtcmalloc_minimal_debug.so.4", "libtcmalloc_minimal.so"):  # fmt: skip
        (lib / name).write_bytes(b"")
    assert find_tcmalloc((str(empty), str(lib))) == str(lib / "libtcmalloc_minimal.so.4")
    assert find_tcmalloc((str(empty),)) == ""


def test_the_install_provides_tcmalloc() -> None:
    """`make install` installs libtcmalloc-minimal4 when it is missing, so every engine here
    runs on it."""
    found = find_tcmalloc()
    assert found and os.path.exists(found)


def test_preload_tcmalloc_sets_the_environment_it_is_given() -> None:
    env = {"LD_PRELOAD": "/opt/libgomp.so.1"}
    why, ok = preload_tcmalloc(env)
    assert ok and env["LD_PRELOAD"] == f"{find_tcmalloc()}:/opt/libgomp.so.1"
    assert find_tcmalloc() in why
    kept = {"LD_PRELOAD": "/x/libjemalloc.so.2"}
    assert preload_tcmalloc(kept)[1] and kept == {"LD_PRELOAD": "/x/libjemalloc.so.2"}
