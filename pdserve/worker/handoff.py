"""vLLM's ``kv_transfer_params`` dict <-> the typed ``KvTransferParams`` message.

The prefill worker converts the dict its engine returned; the decode worker converts the
message back into a fresh dict for its engine (the connector mutates it, so it is never
shared). Fields the message does not name travel untouched in ``extra_json``.
"""

from __future__ import annotations

import json
from typing import Any

from protos.v1 import worker_pb2

_TYPED = (
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "remote_num_tokens",
    "remote_prefill_cached_tokens",
)
# Set by the workers themselves on each hop, never carried over.
_ROLE_FLAGS = ("do_remote_prefill", "do_remote_decode")


def to_message(params: dict[str, Any]) -> worker_pb2.KvTransferParams:
    message = worker_pb2.KvTransferParams()
    for key in _TYPED:
        if params.get(key) is not None:
            setattr(message, key, type(getattr(message, key))(params[key]))
    extra = {k: v for k, v in params.items() if k not in (*_TYPED, *_ROLE_FLAGS)}
    blocks = extra.pop("remote_block_ids", None) or []
    if blocks and isinstance(blocks[0], list | tuple):
        extra["remote_block_ids"] = [list(group) for group in blocks]  # one list per KV group
    else:
        message.remote_block_ids.extend(int(b) for b in blocks)
    if extra:
        message.extra_json = json.dumps(extra, separators=(",", ":"))
    return message


def to_params(message: worker_pb2.KvTransferParams) -> dict[str, Any]:
    """A new dict for the decode engine (``do_remote_prefill`` set)."""
    params: dict[str, Any] = {key: getattr(message, key) for key in _TYPED}
    params["remote_block_ids"] = list(message.remote_block_ids)
    if message.extra_json:
        params.update(json.loads(message.extra_json))
    params["do_remote_prefill"] = True
    params["do_remote_decode"] = False
    return params
