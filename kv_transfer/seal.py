"""What ties a KV hand-off to its prompt and its producer.

The prefill worker's connector adds to the hand-off (``kv_transfer_params``) the digest of the
prompt token ids it computed, its engine id, a random epoch (new on every start) and the job's
number in that start (``SEQ``), and an HMAC over those and every field the decode worker acts
on (request id, host, port, blocks, token count), made with the deployment secret. The decode
worker's pull names the epoch and the number, and the prefill worker's transfer process
checks both: a hand-off of an earlier start, or of a job that has ended, fails at once. The
decode worker refuses a hand-off whose digest differs from the digest of its own prompt, or
whose seal it cannot verify: its engine then never caches blocks computed for another prompt
under this prompt's block hashes, and a caller of the decode API cannot point it at a made-up
producer or request.

Without a deployment secret the digest is still checked (it catches mix-ups, not forgeries).
"""

from __future__ import annotations

import array
import hashlib
import json
from collections.abc import Sequence
from typing import Any

from kv_transfer.auth import mac, same
from kv_transfer.errors import PromptMismatch

DIGEST = "pdserve_prompt_digest"
EPOCH = "pdserve_epoch"
SEQ = "pdserve_seq"
SEAL = "pdserve_seal"
TP_SIZE = "remote_tp_size"
NIXL_FIELDS = ("tp_size", "dcp_size", "pp_size", "transfer_mode")


def prompt_digest(token_ids: Sequence[int]) -> str:
    """SHA-256 of the prompt token ids (as little-endian uint32), hex."""
    return hashlib.sha256(array.array("I", token_ids).tobytes()).hexdigest()


def _signed_text(params: dict[str, Any]) -> str:
    """The sealed fields in one canonical form (the same after the proto round trip)."""
    blocks = params.get("remote_block_ids") or []
    if blocks and isinstance(blocks[0], list | tuple):
        blocks = [[int(b) for b in group] for group in blocks]
    else:
        blocks = [int(b) for b in blocks]
    fields = [
        str(params.get("remote_engine_id") or ""),
        str(params.get("remote_request_id") or ""),
        str(params.get("remote_host") or ""),
        int(params.get("remote_port") or 0),
        blocks,
        int(params.get("remote_num_tokens") or 0),
        int(params.get(TP_SIZE) or 1),
        str(params.get(DIGEST) or ""),
        str(params.get(EPOCH) or ""),
    ]
    if params.get(SEQ) is not None:  # our connector's job number (NIXL hand-offs have none)
        fields.append(int(params[SEQ]))
    # vLLM's NixlConnector's own fields that a decode engine acts on (the producer's parallel
    # layout: nixl/pull_scheduler.py:286-291); absent from our connector's hand-offs, whose
    # signed text is then unchanged.
    nixl = {key: params[key] for key in NIXL_FIELDS if params.get(key) is not None}
    if nixl:
        fields.append(nixl)
    return json.dumps(fields, separators=(",", ":"), sort_keys=True)


def seal(params: dict[str, Any], secret: bytes | None) -> dict[str, Any]:
    """``params`` with the seal added (unchanged when there is no secret)."""
    if secret is None:
        return params
    return {**params, SEAL: mac(secret, "kv-handoff", _signed_text(params))}


def is_genuine(params: dict[str, Any], secret: bytes | None) -> bool:
    """True when the hand-off was sealed by a holder of ``secret`` (always, without one)."""
    if secret is None:
        return True
    return same(params.get(SEAL), mac(secret, "kv-handoff", _signed_text(params)))


def verify(params: dict[str, Any], token_ids: Sequence[int], secret: bytes | None) -> None:
    """Raise ``PromptMismatch`` unless the hand-off is genuine and for exactly this prompt."""
    if not is_genuine(params, secret):
        raise PromptMismatch(
            "the KV hand-off is not signed with this deployment's secret (forged, altered, or "
            "made by a prefill worker of another deployment); refusing it"
        )
    digest = params.get(DIGEST)
    if not digest:
        raise PromptMismatch("the KV hand-off does not say which prompt it holds; refusing it")
    if int(params.get("remote_num_tokens") or 0) not in (0, len(token_ids)):
        raise PromptMismatch(
            f"the KV hand-off holds a prompt of {params.get('remote_num_tokens')} tokens, "
            f"this request's has {len(token_ids)}; refusing it"
        )
    if digest != prompt_digest(token_ids):
        raise PromptMismatch(
            "the KV hand-off holds the KV cache of another prompt than this request's "
            "(prompt digests differ); refusing it"
        )
