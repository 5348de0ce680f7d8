"""The scheduler reclaims a dead worker's claim when its lease ends, whoever set the lease."""

from __future__ import annotations

from typing import Any

import pytest

from jobtier.config import Settings
from jobtier.core.model import State
from jobtier.engine.queue import Queue
from jobtier.scheduler import LEASE_RESCAN_MS, NOW, Scheduler
from jobtier.store.calls import claim_call, parse_claim
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import task
from tests.fixtures.engine import Background, wait_for


@task(name="leased_briefly")
async def leased_briefly(ctx: JobContext, payload: Any) -> None:
    return None


async def test_a_claim_leased_shorter_than_the_schedulers_lease_is_reclaimed_soon(
    settings: Settings, background: Background, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker run with a 1 s lease claims a job and is never heard of again, beside a
    scheduler whose own lease is two minutes: the job is back in its queue within seconds of
    its lease's end, not when a lease of the scheduler's would have ended."""
    queue = await Queue.connect(settings.replace(lease_seconds=120), catalog=False)
    try:
        job = await queue.submit(leased_briefly, None)
        shard = queue.keys.shard_of(job.job_id)
        scheduler = Scheduler(queue.store, resolve=False)
        background.start(scheduler)
        # its first look at the shard's leases done (none then): its next is planned
        await wait_for(lambda: scheduler._next_lease[shard] > NOW)
        reply = await queue.scripts.call(*claim_call(shard, "gone", 1, 1_000))
        assert [j.id for j in parse_claim(shard, reply).jobs] == [job.job_id]

        async def queued_again() -> bool:
            return (await queue.status(job.job_id)).state is State.QUEUED

        # (the bound only stops a broken test: well under the scheduler's own 120 s lease)
        await wait_for(queued_again, timeout=LEASE_RESCAN_MS / 1000 + 30)
        # by this scheduler (its count moves once the reply is in, maybe after the read)
        await wait_for(lambda: scheduler.stats.requeued == 1)
        # the log names the job and the worker whose lease it was
        (line,) = [r.getMessage() for r in caplog.records if "event=leases_expired" in r.message]
        assert f"requeued=1 dead_lettered=0 jobs={job.job_id}@gone:" in line, line
    finally:
        await queue.close()
