"""Runs a Supervisor over children described by JSON (argv[1]); test_supervisor.py starts it as a
separate process so that it can be signalled like ``pdserve up``.

JSON: {"log_dir": str, "grace_s": float, "startup_timeout_s": float,
       "on_child_exit": "restart" | "stop-all", "backoff": [initial_s, max_s, reset_after_s],
       "children": [{"name": str, "argv": [str], "url": str | null, "stage": int,
                     "after": [str]}]}
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from pdserve.cluster.backoff import Backoff
from pdserve.cluster.ready import http_ok
from pdserve.cluster.supervisor import ChildExitPolicy, ChildSpec, Supervisor, SupervisorOptions

READY_LINE = "DRIVER: ALL READY"


def main() -> int:
    config = json.loads(sys.argv[1])
    specs = [
        ChildSpec(
            name=c["name"],
            argv=tuple(c["argv"]),
            ready_check=http_ok(c["url"]) if c.get("url") else None,
            stop_stage=c.get("stage", 0),
            after=tuple(c.get("after", ())),
        )
        for c in config["children"]
    ]
    options = SupervisorOptions(
        log_dir=Path(config["log_dir"]),
        startup_timeout_s=config["startup_timeout_s"],
        grace_s=config["grace_s"],
        status_interval_s=0.5,
        poll_interval_s=0.1,
        probe_timeout_s=1.0,
        on_child_exit=ChildExitPolicy(config["on_child_exit"]),
        backoff=Backoff(*config["backoff"]),
    )
    supervisor = Supervisor(specs, options, on_ready=lambda: print(READY_LINE, flush=True))
    return asyncio.run(supervisor.run())


if __name__ == "__main__":
    sys.exit(main())
