"""``pdserve decode``: a decode worker (vLLM engine in the kv_consumer role)."""

import sys

from decode_service.config import DecodeSettings
from pdserve.worker.command import WorkerCommand

command = WorkerCommand(
    DecodeSettings, "decode_service.server:DecodeServicer", "decode_service.service:DecodeService"
)
add_arguments = command.add_arguments
run = command.run

if __name__ == "__main__":
    sys.exit(command.main("pdserve decode"))
