"""Settings of a prefill worker (env prefix ``PDSERVE_PREFILL_``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pdserve.settings import PREFILL_GRPC_PORT, base_config
from pdserve.worker.config import WorkerSettings


class PrefillSettings(WorkerSettings):
    model_config = base_config("PDSERVE_PREFILL_")

    port: int = Field(PREFILL_GRPC_PORT, description="gRPC port")

    @property
    def role(self) -> Literal["prefill", "decode"]:
        return "prefill"
