"""The connector's worker half, inside vLLM's Worker process.

At registration it moves the KV cache storage into shared memory in place (torch swaps the
storage's data pointer, so every view vLLM holds follows), starts the transfer process with
that memory and a control socket, and from then on only forwards jobs and collects results:
no KV byte is copied in this process.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kv_transfer import integrity
from kv_transfer.agent_context import AgentConfig
from kv_transfer.compat import layer_bytes
from kv_transfer.errors import KVTransferError, UnsupportedKVCache
from kv_transfer.handle import AgentHandle
from kv_transfer.layout import LayerSpan, Layout
from kv_transfer.metadata import StepMetadata, TransferReport

log = logging.getLogger(__name__)


def share_kv_caches(kv_caches: dict[str, torch.Tensor]) -> tuple[Layout, list[int]]:
    """Put every KV storage into shared memory; returns the layout and one fd per region."""
    regions: dict[int, int] = {}  # storage identity -> region index
    fds: list[int] = []
    sizes: list[int] = []
    spans = []
    num_blocks = None
    for name, tensor in kv_caches.items():
        if tensor.device.type != "cpu":
            raise UnsupportedKVCache(
                f"KV cache of {name} is on {tensor.device}; PdserveConnector serves CPU KV "
                "caches; on GPUs use NixlConnector (--kv-connector nixl)"
            )
        if not tensor[0].is_contiguous():
            raise UnsupportedKVCache(f"a block of {name} is not contiguous in memory")
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key not in regions:
            fd, size = storage._share_fd_cpu_()  # in place: vLLM's views now point into shm
            regions[key] = len(fds)
            fds.append(os.dup(fd))
            sizes.append(int(size))
        num_blocks = tensor.shape[0] if num_blocks is None else min(num_blocks, tensor.shape[0])
        spans.append(
            LayerSpan(
                region=regions[key],
                offset=tensor.data_ptr() - storage.data_ptr(),
                block_stride=tensor.stride(0) * tensor.element_size(),
                block_bytes=tensor[0].numel() * tensor.element_size(),
            )
        )
    layout = Layout(region_sizes=tuple(sizes), layers=tuple(spans), num_blocks=num_blocks or 0)
    return layout, fds


@dataclass
class WorkerSide:
    """State of the worker half: the agent, and results waiting to be reported."""

    role: str
    agent_settings: dict[str, Any]
    compat: dict[str, str]
    agent: AgentHandle | None = None
    served: set[str] = field(default_factory=set)
    seen_finished: set[str] = field(default_factory=set)
    sent_waiting: set[str] = field(default_factory=set)
    pulling: set[str] = field(default_factory=set)
    report: TransferReport = field(default_factory=TransferReport)
    failed_now: list[dict[str, Any]] = field(default_factory=list)
    owner: tuple[str, str] = ("", "")  # the engine identity handed to the agent

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        started = time.perf_counter()
        layout, fds = share_kv_caches(kv_caches)
        config = AgentConfig(
            role=self.role,
            layout=layout,
            region_fds=tuple(fds),
            compat={
                **self.compat,
                "bytes_per_block": str(layout.bytes_per_block),
                "layer_bytes": layer_bytes([span.block_bytes for span in layout.layers]),
                "kv_mac": integrity.ALGORITHM,
            },
            **self.agent_settings,
        )
        self.agent = AgentHandle.start(config)
        log.info(
            "KV transfer process %d ready (%s, port %d): %d layers x %d blocks, %d B/block, "
            "set up in %.2f s",
            self.agent.process.pid,
            self.role,
            self.agent.port,
            len(layout.layers),
            layout.num_blocks,
            layout.bytes_per_block,
            time.perf_counter() - started,
        )

    def start_jobs(self, meta: StepMetadata) -> None:
        """Hand this step's jobs to the agent; never blocks (the channel queues them)."""
        assert self.agent is not None
        if meta.owner[1] and meta.owner != self.owner:
            # Before any job of this step: the agent accepts the engine's own announcements
            # over its KV port from now on (kv_transfer.registry).
            self.owner = meta.owner
            self.agent.channel.send({"op": "owner", "epoch": meta.owner[0], "key": meta.owner[1]})
        for req, blocks in meta.serve.items():
            self.served.add(req)
            self.agent.channel.send(
                {
                    "op": "serve",
                    "req": req,
                    "blocks": blocks,
                    "digest": meta.serve_digests.get(req, ""),
                    "key": meta.serve_keys.get(req, ""),
                    "seq": meta.serve_seqs.get(req),
                }
            )
        for job in meta.pull:
            if job.error:
                self.failed_now.append(
                    {"op": "done", "req": job.req_id, "ok": False, "error": job.error, "blocks": 0}
                )
                continue
            self.pulling.add(job.req_id)
            self.agent.channel.send(
                {
                    "op": "pull",
                    "req": job.req_id,
                    "host": job.host,
                    "port": job.port,
                    "remote_req": job.remote_req_id,
                    "remote_blocks": job.remote_blocks,
                    "local_blocks": job.local_blocks,
                    "digest": job.digest,
                    "epoch": job.epoch,
                    "seq": job.seq,
                }
            )
        for rel in meta.release:
            self.agent.channel.send(
                {
                    "op": "release",
                    "host": rel.host,
                    "port": rel.port,
                    "remote_req": rel.remote_req_id,
                }
            )

    def collect(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) to report this step."""
        assert self.agent is not None
        self.check_agent()
        # vLLM accepts a finished send only for ids it has passed here before.
        self.seen_finished |= finished_req_ids & self.served
        for req in finished_req_ids & self.pulling:
            self.agent.channel.send({"op": "cancel", "req": req})  # aborted while pulling
        recving, failed = set(), set()
        messages, self.failed_now = [*self.failed_now, *self.agent.channel.poll()], []
        for message in messages:
            req = str(message.get("req"))
            if message.get("op") == "finished":
                self.sent_waiting.add(req)
            elif message.get("op") == "done":
                self.pulling.discard(req)
                recving.add(req)
                if not message.get("ok"):
                    failed.add(req)
                self.report.results[req] = message
        sending = self.sent_waiting & self.seen_finished
        self.sent_waiting -= sending
        self.seen_finished -= sending
        self.served -= sending
        return sending, recving, failed

    def check_agent(self) -> None:
        """The transfer process must outlive the engine: without it no pull would ever end
        and no pinned block would ever be freed. Its death ends the engine (vLLM reports it
        dead, the worker exits and ``pdserve up`` restarts it) instead of leaving requests
        waiting forever."""
        assert self.agent is not None
        code = self.agent.process.poll()
        if code is not None:
            log.critical("the KV transfer process %d exited (code %s); stopping the engine",
                         self.agent.process.pid, code)  # fmt: skip
            raise KVTransferError(f"the KV transfer process exited with code {code}")

    def take_report(self) -> TransferReport | None:
        if not self.report.results:
            return None
        report, self.report = self.report, TransferReport()
        return report

    def shutdown(self) -> None:
        if self.agent is not None:
            self.agent.stop()
            self.agent = None
