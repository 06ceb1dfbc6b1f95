"""Every KV byte of a pull is authenticated: a byte flipped on the wire fails the pull."""

from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path

import pytest

from kv_transfer import bench
from tests.integration.test_kv_security import Agents, next_message, write_secret

# Bytes of the producer -> consumer stream before the byte that is flipped: past the
# handshake and the answer's header (a few hundred bytes), inside the blocks (2 x 122,880).
FLIP_AT = 10_000


class FlipProxy:
    """A TCP proxy to ``port`` that flips one byte of the first connection's answer stream
    (``cut``: that connection is closed there instead, in the middle of the blocks)."""

    def __init__(self, port: int, cut: bool = False) -> None:
        self.port_to = port
        self.cut = cut
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.flipped = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self.listener.accept()
                server = socket.create_connection(("127.0.0.1", self.port_to))
                threading.Thread(
                    target=self._pump, args=(client, server, False), daemon=True
                ).start()
                threading.Thread(
                    target=self._pump, args=(server, client, True), daemon=True
                ).start()

    def _pump(self, src: socket.socket, dst: socket.socket, answers: bool) -> None:
        seen = 0
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if answers and not self.flipped.is_set() and seen <= FLIP_AT < seen + len(data):
                    self.flipped.set()
                    if self.cut:
                        dst.sendall(data[: FLIP_AT - seen])
                        break
                    chunk = bytearray(data)
                    chunk[FLIP_AT - seen] ^= 0x01
                    data = bytes(chunk)
                    self.flipped.set()
                seen += len(data)
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()


@pytest.mark.parametrize("with_secret", [True, False])
def test_a_flipped_byte_fails_the_pull_and_a_clean_path_is_exact(
    tmp_path: Path, with_secret: bool
) -> None:
    secret_file = write_secret(tmp_path / "secret")
    agents = Agents(secret_file) if with_secret else _open_agents()
    proxy = FlipProxy(agents.producer.port)
    try:
        agents.serve("r1", [1, 2])
        agents.pull("r1", [1, 2], [3, 4], port=proxy.port)
        done = next_message(agents.consumer)
        assert proxy.flipped.is_set()
        assert not done["ok"] and "do not match the MAC" in done["error"], done
        # No acknowledgement: the prefill side ends the job as failed, unpinning its blocks.
        assert next_message(agents.producer)["reason"] == "error"
        agents.serve("r2", [1, 2])
        agents.pull("r2", [1, 2], [5, 6])  # straight to the producer
        assert next_message(agents.consumer)["ok"]
        src = bench.blocks_digest(agents.p_mem, agents.p_layout, [1, 2])
        assert bench.blocks_digest(agents.c_mem, agents.c_layout, [5, 6]) == src
    finally:
        proxy.close()
        agents.close()


def _open_agents() -> Agents:
    """Agents without a deployment secret: the MAC still catches corruption."""
    agents = Agents.__new__(Agents)
    agents.secret = None
    agents.p_fd, agents.p_mem, agents.p_layout = bench.make_region(bench.Geometry(4, 4096), 8, 1)
    agents.c_fd, agents.c_mem, agents.c_layout = bench.make_region(bench.Geometry(4, 4096), 8, 2)
    agents.producer = bench.start_agent("producer", agents.p_fd, agents.p_layout)
    agents.consumer = bench.start_agent("consumer", agents.c_fd, agents.c_layout)
    return agents
