"""Bounds on what a peer of the KV port can make the transfer process do: one deadline per
frame or handshake, malformed frames refused cleanly, the handshake gate, the client's retry
of a cut-off handshake and the consumer's per-peer connection cap."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from kv_transfer.auth import HandshakeGate, connect, server_handshake
from kv_transfer.consumer import PeerConnections
from kv_transfer.errors import KVTransferError
from kv_transfer.wire import (
    MAX_DEPTH,
    ConnectionClosed,
    MalformedFrame,
    decode_frame,
    peer_closed,
    recv_frame,
    send_frame,
)

SECRET = b"0123456789abcdef0123456789abcdef"


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    left, right = socket.socketpair()
    yield left, right
    left.close()
    right.close()


def test_a_frame_sent_a_byte_at_a_time_ends_at_its_deadline(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """Each byte comes well within a per-read timeout; the frame's deadline still ends it."""
    left, right = pair
    stop = threading.Event()

    def trickle() -> None:
        for byte in struct.pack("!I", 100) + b"x" * 100:
            if stop.wait(0.05):
                return
            left.send(bytes([byte]))

    threading.Thread(target=trickle, daemon=True).start()
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            recv_frame(right, 1024, deadline=started + 0.5)
    finally:
        stop.set()
    # Not before its deadline; how long after is the machine's business (the whole trickle
    # takes over 5 s, and a frame it completed would raise nothing).
    assert time.monotonic() - started >= 0.5


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 1024,  # deeper than the parser's recursion limit
        b"[" * 100_000,
        b'{"a":' * 900 + b"1" + b"}" * 900,
        b'{"a":' * (MAX_DEPTH + 1) + b"1" + b"}" * (MAX_DEPTH + 1),  # valid JSON, too deep
        b'{"op":"' + bytes([0xFF, 0xFE]) + b'"}',  # not UTF-8
        b'{"n": NaN}',
        b'{"n": Infinity}',
        b"[1, 2]",
        b'"text"',
        b"",
        b"{",
    ],
)
def test_malformed_frames_are_refused_as_such_never_with_a_parser_error(body: bytes) -> None:
    with pytest.raises(MalformedFrame):
        decode_frame(body)


def test_brackets_in_strings_and_nesting_up_to_the_bound_are_fine() -> None:
    assert decode_frame(b'{"req": "' + b"[{" * 500 + b'"}') == {"req": "[{" * 500}
    nested = b'{"a":' * (MAX_DEPTH - 1) + b"[1]" + b"}" * (MAX_DEPTH - 1)
    assert decode_frame(nested)["a"]


def test_a_nested_frame_over_the_socket_is_a_malformed_frame(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    left, right = pair
    left.sendall(struct.pack("!I", 1024) + b"[" * 1024)
    with pytest.raises(MalformedFrame, match="nests deeper"):
        recv_frame(right, 1024)
    assert issubclass(MalformedFrame, ConnectionError) and issubclass(MalformedFrame, ValueError)


def test_send_frame_on_a_connection_the_peer_closed_raises_without_writing(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    left, right = pair
    assert not peer_closed(left)
    right.sendall(b"data")  # readable but open
    assert not peer_closed(left)
    assert left.recv(4) == b"data"
    right.close()
    assert peer_closed(left)
    with pytest.raises(ConnectionClosed):
        send_frame(left, {"op": "serve"})


def test_the_gate_cuts_off_the_oldest_of_a_full_address_first_then_of_all() -> None:
    gate = HandshakeGate(total=4, per_address=2)
    pairs = [socket.socketpair() for _ in range(6)]
    try:
        a1 = gate.enter(pairs[0][0], "a")
        a2 = gate.enter(pairs[1][0], "a")
        a3 = gate.enter(pairs[2][0], "a")  # address "a" is full: a1 goes
        assert a1.cut and not a2.cut and gate.count("a") == 2
        assert pairs[0][1].recv(1) == b""  # the cut connection's peer sees it closed
        b1 = gate.enter(pairs[3][0], "b")
        b2 = gate.enter(pairs[4][0], "c")  # four in all now
        assert gate.count() == 4
        gate.enter(pairs[5][0], "d")  # all are full: the oldest of all (a2) goes
        assert a2.cut and not (a3.cut or b1.cut or b2.cut)
        with pytest.raises(ConnectionClosed):
            gate.admit(a2)  # proven too late: it was cut off
        gate.admit(b1)
        gate.leave(b1)  # idempotent
        gate.leave(a2)
        assert gate.count() == 3 and gate.cut_off == 2
    finally:
        for left, right in pairs:
            left.close()
            right.close()


def serve_handshakes(listener: socket.socket, cut_first: int) -> None:
    """Close the first ``cut_first`` connections at once (as a full server does), then
    authenticate each further one."""
    n = 0
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        n += 1
        with conn:
            if n > cut_first:
                server_handshake(conn, SECRET, time.monotonic() + 5)
                conn.recv(1)


def test_connect_tries_again_when_the_server_cuts_off_its_handshake() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        threading.Thread(target=serve_handshakes, args=(listener, 3), daemon=True).start()
        with connect("127.0.0.1", port, SECRET, 5.0) as conn:
            assert conn.gettimeout() == 5.0


def test_connect_gives_up_within_its_timeout_when_every_handshake_is_cut_off() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        threading.Thread(target=serve_handshakes, args=(listener, 10**9), daemon=True).start()
        started = time.monotonic()
        with pytest.raises(ConnectionClosed, match="closed every connection"):
            connect("127.0.0.1", port, SECRET, 0.5)
        # Without its timeout it would try forever; the bound leaves a busy machine 20 times
        # the timeout.
        assert time.monotonic() - started < 10.0


def test_the_consumer_holds_at_most_its_cap_of_connections_to_one_peer() -> None:
    others: list[socket.socket] = []

    def open_one(peer: tuple[str, int]) -> socket.socket:
        ours, theirs = socket.socketpair()
        others.append(theirs)
        return ours

    conns = PeerConnections(2, open_one)
    peer = ("p", 1)
    try:
        first, reused = conns.take(peer, 1.0)
        second, _ = conns.take(peer, 1.0)
        assert not reused and conns.count(peer) == 2
        with pytest.raises(KVTransferError, match="stayed busy"):
            conns.take(peer, 0.2)
        assert conns.take(("q", 1), 0.2)[1] is False  # another peer is not affected
        threading.Timer(0.2, conns.give, args=(peer, first)).start()
        third, reused = conns.take(peer, 5.0)  # waits for the one given back
        assert third is first and reused
        # A kept connection the peer closed is dropped, not handed out.
        conns.give(peer, third)
        others[0].close()
        fourth, reused = conns.take(peer, 1.0)
        assert not reused and fourth is not first and conns.count(peer) == 2
        conns.drop(peer, fourth)
        conns.drop(peer, second)
        assert conns.count(peer) == 0
    finally:
        conns.close()
        for sock in others:
            sock.close()
