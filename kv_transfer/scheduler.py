"""The connector's scheduler half, inside vLLM's EngineCore process.

``ProducerScheduler`` (prefill worker) pins a finished prompt's blocks and tells the decode
side where to pull them from, in vLLM's ``kv_transfer_params`` contract. ``ConsumerScheduler``
(decode worker) asks vLLM to wait for the blocks that its local prefix cache lacks, has the
worker pull exactly those, and records what the engine computed itself, so every finished
request reports its transfer statistics (returned as ``kv_transfer_params["pdserve"]``).

Both halves account for the KV blocks they hold outside vLLM's normal life of a request
(``lifecycle``, reported with every engine step's statistics): the producer the blocks pinned
for decode workers, the consumer the blocks allocated for pulls and the hand-offs it has not
pulled yet. A decode request aborted before its pull started leaves the prefill worker's job
pinned: the gateway may hand the same hand-off on to another decode worker (a retry before the
first token), and releases it itself when the request really ends: its ``Abort`` to the
prefill worker unpins the job by its key (``prefill_service``).
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from typing import Any

from vllm.v1.request import RequestStatus

from kv_transfer import seal
from kv_transfer.announce import Announcer
from kv_transfer.client import RELEASE_KEY
from kv_transfer.errors import PromptMismatch
from kv_transfer.metadata import PullJob, ReleaseJob, StepMetadata, TransferReport

log = logging.getLogger(__name__)

PINNABLE = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


def new_owner() -> tuple[str, str]:
    """(epoch, announcement key) for one start of a prefill engine."""
    return secrets.token_hex(8), secrets.token_hex(16)


@dataclass
class Endpoint:
    engine_id: str
    host: str
    port: int


class ProducerScheduler:
    def __init__(
        self,
        endpoint: Endpoint,
        secret: bytes | None = None,
        tp_size: int = 1,
        announcer: Announcer | None = None,
        owner: tuple[str, str] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.announcer = announcer
        self.secret = secret
        self.tp_size = tp_size
        # New on every start: a restart is another producer. The epoch goes into hand-offs;
        # the key only to this engine's own transfer processes (kv_transfer.registry).
        self.epoch, self.owner_key = owner or new_owner()
        self.next_seq = 0  # jobs of this start are numbered 1, 2, ... (both announcements)
        self.to_serve: dict[str, list[int]] = {}
        self.seqs: dict[str, int] = {}
        self.digests: dict[str, str] = {}
        self.keys: dict[str, str] = {}
        self.pinned: dict[str, int] = {}  # request id -> blocks pinned until sent or released

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_decode"):
            return False, None
        if request.status not in PINNABLE or not block_ids:
            return False, None  # aborted or failed: nothing for a decode worker to pull
        digest = seal.prompt_digest(request.prompt_token_ids)
        key = str(params.get(RELEASE_KEY) or "")
        self.to_serve[request.request_id] = list(block_ids)
        self.digests[request.request_id] = digest
        self.keys[request.request_id] = key
        self.pinned[request.request_id] = len(block_ids)
        self.next_seq += 1
        seq = self.seqs[request.request_id] = self.next_seq
        if self.announcer is not None:  # registered now, not one engine step later
            self.announcer.announce(request.request_id, seq, list(block_ids), digest, key)
        handoff = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(block_ids),
            "remote_engine_id": self.endpoint.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": self.endpoint.host,
            "remote_port": self.endpoint.port,
            "remote_num_tokens": request.num_prompt_tokens,
            seal.TP_SIZE: self.tp_size,
            seal.DIGEST: digest,
            seal.EPOCH: self.epoch,
            seal.SEQ: seq,
        }
        return True, seal.seal(handoff, self.secret)

    def build_meta(self, scheduler_output: Any) -> StepMetadata:
        meta = StepMetadata(
            serve=self.to_serve,
            serve_digests=self.digests,
            serve_keys=self.keys,
            serve_seqs=self.seqs,
            owner=(self.epoch, self.owner_key),
        )
        self.to_serve, self.digests, self.keys, self.seqs = {}, {}, {}, {}
        return meta

    def update_connector_output(self, output: Any) -> None:
        """vLLM frees the blocks of every request reported as finished sending."""
        for req_id in output.finished_sending or ():
            self.pinned.pop(req_id, None)

    def lifecycle(self) -> dict[str, int]:
        """Blocks pinned for decode workers and the jobs (leases) that pin them."""
        return {"pinned_blocks": sum(self.pinned.values()), "leases": len(self.pinned)}


@dataclass
class RequestStats:
    prompt_tokens: int
    prompt_computed: int = 0
    local_cached_tokens: int = 0
    received_tokens: int = 0
    received_blocks: int = 0
    received_bytes: int = 0
    transfer_seconds: float = 0.0
    transfer_started_unix: float = 0.0
    transfer_error: str = ""

    def as_params(self) -> dict[str, Any]:
        return dict(self.__dict__)


class ConsumerScheduler:
    def __init__(self, block_size: int, secret: bytes | None = None) -> None:
        self.block_size = block_size
        self.secret = secret
        self.to_pull: list[PullJob] = []
        self.to_release: list[ReleaseJob] = []
        self.stats: dict[str, RequestStats] = {}
        # Hand-offs not acted on yet (request queued) and blocks allocated for running pulls:
        # vLLM frees a pull's blocks only when the worker reports it received (or failed).
        self.expecting: set[str] = set()
        self.pulling: dict[str, int] = {}

    def on_new_request(self, request: Any) -> None:
        self.stats[request.request_id] = RequestStats(prompt_tokens=request.num_prompt_tokens)
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill") and params.get("remote_block_ids"):
            self.expecting.add(request.request_id)

    def lifecycle(self) -> dict[str, int]:
        """Blocks allocated for pulls in progress; hand-offs held (queued or being pulled)."""
        leases = len(self.expecting | self.pulling.keys())
        return {"pinned_blocks": sum(self.pulling.values()), "leases": leases}

    def get_num_new_matched_tokens(self, request: Any, num_computed: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if not (params.get("do_remote_prefill") and params.get("remote_block_ids")):
            return 0, False
        count = request.num_prompt_tokens - num_computed
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            return
        self.expecting.discard(request.request_id)
        params["do_remote_prefill"] = False  # exactly one transfer per request
        try:
            seal.verify(params, request.prompt_token_ids, self.secret)
        except PromptMismatch as exc:
            # Fail this request without contacting anyone: nothing is pulled, so nothing
            # foreign is cached (vLLM caches a failed load's blocks never).
            log.warning("request %s: %s", request.request_id, exc)
            local = blocks.get_unhashed_block_ids() if num_external > 0 else []
            if local:
                self.to_pull.append(PullJob(request.request_id, "", 0, "", [], local, str(exc)))
                self.pulling[request.request_id] = len(local)
            return
        port = int(params["remote_port"])
        if num_external <= 0:
            self.to_release.append(
                ReleaseJob(params["remote_host"], port, params["remote_request_id"])
            )
            return
        local = blocks.get_unhashed_block_ids()
        cached = sum(1 for b in blocks.blocks[0] if b.block_hash is not None)
        offered = [int(b) for b in params["remote_block_ids"]]
        remote = offered[cached : cached + len(local)]
        error = ""
        if len(remote) != len(local):
            # Never raise here: it would take the whole engine down. Fail this request only.
            error = (
                f"decode needs {len(local)} blocks after {cached} cached ones, "
                f"prefill offers {len(offered)}"
            )
        self.to_pull.append(
            PullJob(
                request.request_id,
                params["remote_host"],
                port,
                str(params["remote_request_id"]),
                remote,
                local,
                error,
                digest=str(params.get(seal.DIGEST, "")),
                epoch=str(params.get(seal.EPOCH) or ""),
                seq=_seq(params.get(seal.SEQ)),
            )
        )
        self.pulling[request.request_id] = len(local)
        stats = self.stats.get(request.request_id)
        if stats is not None:
            stats.local_cached_tokens = request.num_prompt_tokens - num_external
            stats.received_tokens = num_external

    def build_meta(self, scheduler_output: Any) -> StepMetadata:
        self._count_computed(scheduler_output)
        meta = StepMetadata(pull=self.to_pull, release=self.to_release)
        self.to_pull, self.to_release = [], []
        return meta

    def _count_computed(self, out: Any) -> None:
        """Prompt tokens the engine schedules this step, from the scheduler's own decisions."""
        scheduled = out.num_scheduled_tokens
        pairs = [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs]
        cached = out.scheduled_cached_reqs
        pairs += list(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
        for req_id, done in pairs:
            stats = self.stats.get(req_id)
            if stats is not None and req_id in scheduled:
                end = min(done + scheduled[req_id], stats.prompt_tokens)
                stats.prompt_computed += max(0, end - done)

    def update_connector_output(self, output: Any) -> None:
        for req_id in output.finished_recving or ():
            self.pulling.pop(req_id, None)  # vLLM frees or keeps them for the request now
        report = output.kv_connector_worker_meta
        if not isinstance(report, TransferReport):
            return
        for req_id, result in report.results.items():
            stats = self.stats.get(req_id)
            if stats is None:
                continue
            stats.received_bytes = int(result.get("bytes", 0))
            stats.received_blocks = int(result.get("blocks", 0))
            stats.transfer_seconds = float(result.get("seconds", 0.0))
            stats.transfer_started_unix = float(result.get("started", 0.0))
            if not result.get("ok"):
                stats.received_tokens = 0
                stats.transfer_error = str(result.get("error", "KV transfer failed"))

    def request_finished(self, request: Any) -> tuple[bool, dict | None]:
        # Finished (aborted) while queued: the hand-off is not this engine's to release (see
        # the module doc); the lease keeps it only if the gateway is gone as well.
        self.expecting.discard(request.request_id)
        stats = self.stats.pop(request.request_id, None)
        return False, ({"pdserve": stats.as_params()} if stats else None)


def _seq(value: Any) -> int | None:
    """The job number of a (verified) hand-off; None for one that has none."""
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None
