"""A decode worker that fails before its first token hands the same KV hand-off on.

The gateway retries on another decode worker with the same hand-off (docs/reliability.md, row
KV_STAGED / DECODE_FAILED). The failed worker's engine aborts the request it had queued without
releasing the hand-off (``kv_transfer.scheduler``), and the gateway's ``Abort`` to it brings
none: the next decode worker pulls the blocks. When the request really ends, the gateway's
``Abort`` to the prefill worker unpins the job at once (by its key).

The gateway's side runs against scripted fake workers (which ``Abort`` goes where, bringing
what); the workers' side on real transfer processes: a producer agent holding a prefill
worker's job, the decode engine's connector scheduler, the decode and prefill services'
``abort`` and a consumer agent pulling the blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from kv_transfer import bench, seal
from kv_transfer.client import release, renew
from kv_transfer.scheduler import ConsumerScheduler
from pdserve.bench.fake_worker import FakeDecode
from tests.helpers import counted, gateway_cluster, metrics_text, served_name, wait_pinned
from tests.integration.test_gateway_recovery import expected, stream_text, text, two_of_each
from tests.integration.test_kv_security import Agents, next_message, write_secret

PROMPT = list(range(40))  # the decode request's prompt (its hand-off names its digest)
BLOCK_SIZE = 16


async def test_a_decode_retry_releases_nothing_it_hands_on() -> None:
    failing = FakeDecode(positional=True, fail_after=0)  # fails before its first token
    async with two_of_each(failing) as (c, _, healthy):
        out, finish, _ = await stream_text(c)
        await asyncio.wait_for(failing.seen.aborted.wait(), 10)
        metrics = await metrics_text(c.base_url)
    assert out == text(expected()) and finish == "length"
    (tried,), (retried,) = failing.seen.requests, healthy.seen.requests
    assert retried.kv_transfer_params == tried.kv_transfer_params  # handed on
    assert failing.seen.aborts == [tried.request_id]
    assert failing.seen.releases == [], "the retry's Abort brought the hand-off it hands on"
    assert c.prefill is not None and c.prefill.seen.aborts == []  # its key would unpin the job
    assert healthy.seen.aborts == []  # ended normally: its pull ended the job
    assert counted(metrics, 'pdserve_gateway_retries_total{kind="decode"}') == 1


async def test_a_decode_failure_that_ends_the_request_unpins_the_job_on_the_prefill_worker() -> (
    None
):
    """No other decode worker: the request ends, and the prefill worker's Abort unpins the job
    (by its key) that the failed decode worker's engine left pinned."""
    failing = FakeDecode(positional=True, fail_after=0)
    async with gateway_cluster(decode=failing) as c:
        body = {"model": served_name(), "prompt": [11, 12, 13], "max_tokens": 4}
        async with httpx.AsyncClient(base_url=c.base_url, timeout=60) as http:
            response = await http.post("/v1/completions", json=body)
        assert response.status_code == 503, response.text
        assert c.prefill is not None
        await asyncio.wait_for(c.prefill.seen.aborted.wait(), 10)
        await asyncio.wait_for(failing.seen.aborted.wait(), 10)
    (prefilled,), (tried,) = c.prefill.seen.requests, failing.seen.requests
    assert c.prefill.seen.aborts == [prefilled.request_id]
    assert failing.seen.aborts == [tried.request_id]


class Stand(Agents):
    """A prefill worker's transfer process (producer) holding jobs, and a decode worker's:
    its engine's connector scheduler, its decode service and its transfer process."""

    def __init__(self, secret_file: Path) -> None:
        super().__init__(secret_file, lease_s=600.0)  # only an explicit end frees a job here
        from decode_service.config import DecodeSettings
        from decode_service.service import DecodeService
        from prefill_service.config import PrefillSettings
        from prefill_service.service import PrefillService

        self.engine_aborts: list[str] = []
        self.service = DecodeService(None, DecodeSettings.model_validate({}), None)
        self.service.secret = self.secret  # the process-wide secret is read once
        self.service.engine = SimpleNamespace(abort=self._engine_abort)
        settings = PrefillSettings.model_validate(
            {"kv_port": self.producer.port, "host": "127.0.0.1"}
        )
        self.prefill = PrefillService(None, settings, None)
        self.prefill.secret = self.secret
        self.prefill.engine = SimpleNamespace(abort=self._prefill_engine_abort)
        self.scheduler = ConsumerScheduler(BLOCK_SIZE, self.secret)
        self.requests: dict[str, Any] = {}

    def handoff(self, job: str, blocks: list[int], key: str) -> dict[str, Any]:
        """The sealed hand-off of ``job``, pinned on the producer; ``key``: the prefill
        service's request id (what its ``abort`` releases by)."""
        self.producer.channel.send({"op": "serve", "req": job, "blocks": blocks, "key": key})
        wait_pinned(self.producer.port, job, self.secret)
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": blocks,
            "remote_engine_id": "prefill",
            "remote_request_id": job,
            "remote_host": "127.0.0.1",
            "remote_port": self.producer.port,
            "remote_num_tokens": len(PROMPT),
            seal.DIGEST: seal.prompt_digest(PROMPT),
        }
        return seal.seal(params, self.secret)

    def queue(self, rid: str, handoff: dict[str, Any]) -> None:
        """The decode engine has the request queued (its pull not started)."""
        request = SimpleNamespace(
            request_id=rid,
            num_prompt_tokens=len(PROMPT),
            prompt_token_ids=PROMPT,
            kv_transfer_params=dict(handoff),
            status=None,
        )
        self.requests[rid] = request
        self.scheduler.on_new_request(request)

    async def _engine_abort(self, rid: str) -> None:
        """vLLM aborting the request: its connector finishes it, and the releases it asks
        for go to the prefill worker's KV port (what the engine's transfer process sends)."""
        self.engine_aborts.append(rid)
        self.scheduler.request_finished(self.requests.pop(rid))
        meta = self.scheduler.build_meta(SimpleNamespace(
            num_scheduled_tokens={}, scheduled_new_reqs=[],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        ))  # fmt: skip
        for job in meta.release:
            await asyncio.to_thread(
                release, job.host, job.port, job.remote_req_id, secret=self.secret
            )

    async def _prefill_engine_abort(self, rid: str) -> None:
        self.engine_aborts.append(rid)  # the prompt finished long ago: nothing to stop

    def held(self, job: str) -> bool:
        return renew("127.0.0.1", self.producer.port, job, secret=self.secret)


@pytest.fixture
def stand(tmp_path: Path) -> Iterator[Stand]:
    s = Stand(write_secret(tmp_path / "secret"))
    yield s
    s.close()


async def test_a_handed_on_job_survives_the_first_decode_worker_and_is_pulled_by_the_next(
    stand: Stand,
) -> None:
    handoff = stand.handoff("p-1", [5, 1], key="pf-1")
    stand.queue("d-1", handoff)  # the first decode worker's engine has it queued
    # It fails before its first token; the gateway's Abort for the retry (no hand-off).
    assert await stand.service.abort("d-1", None)
    assert stand.engine_aborts == ["d-1"]
    assert stand.held("p-1"), "the first decode worker's abort released the handed-on job"
    assert stand.producer.channel.poll() == []  # no "finished": still pinned
    # The next decode worker pulls the same blocks.
    stand.pull("p-1", [5, 1], [2, 6])
    done = next_message(stand.consumer)
    assert done["op"] == "done" and done["ok"], done
    src = bench.blocks_digest(stand.p_mem, stand.p_layout, [5, 1])
    assert bench.blocks_digest(stand.c_mem, stand.c_layout, [2, 6]) == src
    ended = next_message(stand.producer)
    assert (ended["req"], ended["reason"]) == ("p-1", "sent")  # the pull freed it
    assert not stand.held("p-1")


async def test_a_request_that_really_ends_frees_the_job_at_once(stand: Stand) -> None:
    handoff = stand.handoff("p-2", [3], key="pf-2")
    stand.queue("d-2", handoff)
    # The request ends (client gone, or no decode worker left): the gateway aborts both calls.
    assert await stand.service.abort("d-2", None)
    assert await stand.prefill.abort("pf-2"), "the prefill worker held no job for its key"
    assert stand.engine_aborts == ["d-2", "pf-2"]
    ended = next_message(stand.producer)  # the lease is 600 s: only the release ends it
    assert (ended["req"], ended["reason"]) == ("p-2", "released")
    assert not stand.held("p-2")
