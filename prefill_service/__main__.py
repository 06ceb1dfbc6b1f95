"""``pdserve prefill``: a prefill worker (vLLM engine in the kv_producer role)."""

import sys

from pdserve.worker.command import WorkerCommand
from prefill_service.config import PrefillSettings

command = WorkerCommand(
    PrefillSettings,
    "prefill_service.server:PrefillServicer",
    "prefill_service.service:PrefillService",
)
add_arguments = command.add_arguments
run = command.run

if __name__ == "__main__":
    sys.exit(command.main("pdserve prefill"))
