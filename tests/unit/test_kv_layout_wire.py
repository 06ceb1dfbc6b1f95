"""Block layout, wire framing and compatibility checks of the KV transport."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from kv_transfer import compat
from kv_transfer.errors import IncompatibleWorkers
from kv_transfer.layout import LayerSpan, Layout, _runs
from kv_transfer.wire import Pending, recv_frame, recv_views, send_frame, send_views


def test_runs_merge_consecutive_ids_in_order() -> None:
    assert list(_runs([3, 4, 5, 9, 1, 2])) == [(3, 3), (9, 1), (1, 2)]
    assert list(_runs([])) == []


def two_layer_layout(stride: int) -> Layout:
    return Layout((4096,), (LayerSpan(0, 0, stride, 8), LayerSpan(0, 2048, stride, 8)), 16)


def test_views_are_layer_major_and_merge_runs_when_blocks_are_contiguous() -> None:
    memory = memoryview(bytearray(range(256)) * 16)
    views = list(two_layer_layout(stride=8).views([memory], [2, 3, 7]))
    assert [len(v) for v in views] == [16, 8, 16, 8]
    assert bytes(views[0]) == bytes(memory[16:32])
    assert bytes(views[2]) == bytes(memory[2048 + 16 : 2048 + 32])


def test_views_of_strided_blocks_are_one_per_block() -> None:
    memory = memoryview(bytearray(4096))
    views = list(two_layer_layout(stride=32).views([memory], [2, 3]))
    assert [len(v) for v in views] == [8, 8, 8, 8]
    assert two_layer_layout(32).bytes_per_block == 16


def test_block_ids_are_range_checked() -> None:
    with pytest.raises(ValueError, match="out of range"):
        two_layer_layout(8).check_blocks([0, 16])


def test_layout_round_trips_through_json() -> None:
    layout = two_layer_layout(8)
    assert Layout.from_json(layout.to_json()) == layout


def test_pending_drops_a_prefix_across_views() -> None:
    pending = Pending([memoryview(b"abc"), memoryview(b""), memoryview(b"de"), memoryview(b"fgh")])
    pending.drop(4)
    assert [bytes(v) for v in pending.next()] == [b"e", b"fgh"]
    pending.drop(4)
    assert not pending and pending.next() == []


def test_scatter_gather_send_and_receive_move_every_byte() -> None:
    left, right = socket.socketpair()
    payload = [memoryview(bytes([i % 251]) * (200_000 + i)) for i in range(40)]
    targets = [memoryview(bytearray(len(v))) for v in payload]
    sender = threading.Thread(target=send_views, args=(left, payload))
    sender.start()
    assert recv_views(right, targets) == sum(len(v) for v in payload)
    sender.join()
    assert all(bytes(a) == bytes(b) for a, b in zip(payload, targets, strict=True))
    send_frame(left, {"op": "ack", "n": [1, 2]})
    assert recv_frame(right) == {"op": "ack", "n": [1, 2]}
    left.close()
    right.close()


def test_compat_check_names_every_differing_key_and_ignores_local_ones() -> None:
    ours = {"model": "a", "dtype": "bfloat16", "block_size": "128", "num_blocks": "10"}
    theirs = {"model": "a", "dtype": "float16", "block_size": "64", "num_blocks": "99"}
    with pytest.raises(IncompatibleWorkers) as info:
        compat.check(ours, theirs, who="decode worker")
    message = str(info.value)
    assert "dtype: ours=bfloat16 decode worker=float16" in message
    assert "block_size: ours=128 decode worker=64" in message
    assert "num_blocks" not in message
    compat.check(ours, {**ours, "num_blocks": "1"})
    assert compat.mismatches(ours, {}) != {}


def test_weights_identity_tells_fine_tuned_weights_of_the_same_shape_apart(tmp_path: Path) -> None:
    from kv_transfer.compat import layer_bytes, weights_identity

    base = tmp_path / "base"
    tuned = tmp_path / "tuned"
    for root, fill in ((base, 1), (tuned, 2)):
        root.mkdir()
        (root / "config.json").write_text('{"hidden_size": 8}')
        (root / "model.safetensors").write_bytes(bytes([fill]) * 3_000_000)
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in base.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    assert weights_identity(str(base)) == weights_identity(str(copy))  # copies agree
    assert weights_identity(str(base)) != weights_identity(str(tuned))
    assert weights_identity("org/model", "abc") != weights_identity("org/model", "def")
    assert layer_bytes([4096] * 30) == "30x4096"
    assert layer_bytes([4096, 8192]) != layer_bytes([8192, 4096])
