"""A request the KV tier looked up and that ends before its first step gives back its pins.

LMCache's lookup pins the chunks it finds in the worker's CPU buffer until the request's
first step. A real engine with our tier connector (tests/e2e/tier_pins.py, its own process):
a long request takes all but one KV block, a request whose four chunks are in the tier is
looked up and waits for blocks, and is aborted (its client went away). Without the fix its
four pins stayed until LMCache's pin monitor forced them free 300 s later, with its lookup
state on the scheduler side for good.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.cases import DTYPE
from tests.helpers import model_dir

pytestmark = pytest.mark.own_cluster

DRIVER = Path(__file__).with_name("tier_pins.py")


def test_an_aborted_request_that_never_ran_unpins_its_lookup(tmp_path: Path) -> None:
    out = tmp_path / "pins.json"
    argv = [sys.executable, str(DRIVER), model_dir(), str(out), DTYPE]
    subprocess.run(argv, check=True, timeout=900, cwd=Path(__file__).parents[2])
    report = json.loads(out.read_text())
    assert report["stored_tokens"] == 512, report
    # The scene as meant: the request waited for blocks holding its lookup's four pins.
    waiting = [r for r in report["waiting"] if r.startswith("waiting")]
    assert len(waiting) == 1, report
    assert report["pins_while_waiting"] == {waiting[0]: 4}, report
    # After the abort and one more request's steps: nothing pinned, nothing remembered.
    assert report["pins_after"] == {}, report
    assert report["lookup_state_after"] is False, report
    assert report["load_spec_after"] is False, report
