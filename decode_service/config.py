"""Settings of a decode worker (env prefix ``PDSERVE_DECODE_``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pdserve.settings import DECODE_GRPC_PORT, base_config
from pdserve.worker.config import WorkerSettings


class DecodeSettings(WorkerSettings):
    model_config = base_config("PDSERVE_DECODE_")

    port: int = Field(DECODE_GRPC_PORT, description="gRPC port")

    @property
    def role(self) -> Literal["prefill", "decode"]:
        return "decode"
