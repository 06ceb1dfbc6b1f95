"""The committed generated code must be what ``make protos`` produces from the .proto files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTOS = sorted((ROOT / "protos" / "v1").glob("*.proto"))


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    assert PROTOS, "no .proto files found"
    command = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        "-I",
        str(ROOT),
        f"--python_out={tmp_path}",
        f"--pyi_out={tmp_path}",
        f"--grpc_python_out={tmp_path}",
        *[str(p) for p in PROTOS],
    ]
    subprocess.run(command, check=True, cwd=ROOT)
    generated = sorted((tmp_path / "protos" / "v1").glob("*_pb2*.py*"))
    assert len(generated) == 3 * len(PROTOS)
    stale = [
        p.name
        for p in generated
        if not (ROOT / "protos" / "v1" / p.name).exists()
        or (ROOT / "protos" / "v1" / p.name).read_bytes() != p.read_bytes()
    ]
    assert not stale, f"generated code is stale, run `make protos`: {stale}"
