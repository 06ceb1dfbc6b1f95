"""One logging set-up for every pdserve process: timestamped lines with the service name."""

from __future__ import annotations

import logging as _logging
import os


def setup(service: str, level: str | None = None) -> None:
    level_name = (level or os.environ.get("PDSERVE_LOG_LEVEL") or "INFO").upper()
    _logging.basicConfig(
        level=level_name,
        format=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
