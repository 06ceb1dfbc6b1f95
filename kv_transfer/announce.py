"""The prefill engine's scheduler tells its transfer processes about finished prompts at once.

vLLM hands a step's connector metadata to the worker process only with the next engine step,
and on a busy prefill worker that step is the next prompt's prefill: seconds later. A decode
worker pulling meanwhile waited for the job, and under load the wait ran out. So the
scheduler half announces each finished prompt's blocks straight to the agent of every TP rank
(``kv_port + rank``) over its authenticated KV port, from a thread of its own: the engine's
loop only puts the message in a queue. The announcement through the next step still follows;
the agent registers whichever arrives first (``Producer._register``). Each announcement is
signed with the engine's own key (``kv_transfer.registry``): the agent registers jobs over its
KV port only from its own engine, not from any other holder of the deployment secret.
"""

from __future__ import annotations

import logging
import queue
import socket
from typing import Any

from kv_transfer.auth import connect
from kv_transfer.errors import KVTransferError
from kv_transfer.registry import serve_mac
from kv_transfer.wire import send_frame
from pdserve.runtime.supervise import start_thread

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 2.0


class Announcer:
    def __init__(
        self, host: str, ports: list[int], secret: bytes | None, owner: tuple[str, str]
    ) -> None:
        self.host = host
        self.epoch, self.owner_key = owner
        self.ports = ports
        self.secret = secret
        self.conns: dict[int, socket.socket] = {}
        self.queue: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        # A crash loses at most the message in hand (the next engine step registers it):
        # restarted (pdserve.runtime.supervise).
        self.thread = start_thread(self._run, "kv-announce")

    def announce(self, req: str, seq: int, blocks: list[int], digest: str, key: str = "") -> None:
        """Never blocks: the message is sent by the announcer's thread."""
        signature = serve_mac(self.owner_key, self.epoch, req, seq, blocks, digest, key)
        message = {"op": "serve", "req": req, "seq": seq, "epoch": self.epoch,
                   "blocks": blocks, "digest": digest, "key": key, "mac": signature}  # fmt: skip
        self.queue.put(message)

    def close(self) -> None:
        self.queue.put(None)

    def _run(self) -> None:
        while (message := self.queue.get()) is not None:
            for port in self.ports:
                self._send(port, message)
        for conn in self.conns.values():
            conn.close()

    def _send(self, port: int, message: dict[str, Any]) -> None:
        """One try on the kept connection, one on a new one; else the step path registers
        the job (later, but it does)."""
        for attempt in range(2):
            conn = self.conns.get(port)
            try:
                if conn is None:
                    conn = connect(self.host, port, self.secret, CONNECT_TIMEOUT_S)
                    self.conns[port] = conn
                send_frame(conn, message)
                return
            except (OSError, KVTransferError) as exc:
                self.conns.pop(port, None)
                if conn is not None:
                    conn.close()
                if attempt:
                    log.warning(
                        "could not announce %s to the KV agent on port %d (%s); it is "
                        "registered with the next engine step instead",
                        message["req"],
                        port,
                        exc,
                    )
