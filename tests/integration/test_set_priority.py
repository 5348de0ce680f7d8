"""Changing the priority of a job not started yet (real Redis): where it waits, the counts,
and what cannot change."""

from __future__ import annotations

import pytest

from jobtier.core.errors import InvalidRequest, JobNotFound, TransitionRefused
from jobtier.core.model import State
from jobtier.engine.queue import Queue
from jobtier.store.calls import complete_call


async def ready_ids(queue: Queue, job_id: str, priority: str, tenant: str = "default") -> list[str]:
    shard = queue.keys.shard_of(job_id)
    ids = await queue.redis.lrange(queue.keys.ready(shard, "default", priority, tenant), 0, -1)
    return [i.decode() if isinstance(i, bytes) else i for i in ids]


async def in_shard_of(queue: Queue, job_id: str, priority: str) -> str:
    """A job submitted at ``priority`` that lands in the shard of ``job_id``."""
    for _ in range(500):
        other = (await queue.submit("echo", None, priority=priority)).job_id
        if queue.keys.shard_of(other) == queue.keys.shard_of(job_id):
            return other
    raise AssertionError("no job landed in that shard")


async def test_a_ready_job_moves_to_the_back_of_its_new_priority(queue: Queue) -> None:
    mine = (await queue.submit("echo", 2)).job_id
    ahead = await in_shard_of(queue, mine, "high")  # waiting at high before it
    before = await queue.status(mine)
    changed = await queue.jobs.set_priority(mine, "high")
    assert changed.priority == "high" and changed.version == before.version + 1
    assert changed.state is State.QUEUED
    assert mine not in await ready_ids(queue, mine, "normal")
    # LPUSH new, RPOP oldest: a list's head is its newest, the back of the line
    assert await ready_ids(queue, mine, "high") == [mine, ahead]
    counts = (await queue.admin.stats())["shards"][queue.keys.shard_of(mine)]["queued"]
    assert (counts["normal"], counts["high"]) == (0, 2)
    again = await queue.jobs.set_priority(mine, "high")  # the priority it has: no change
    assert again.version == changed.version


async def test_a_scheduled_or_held_job_keeps_its_place_and_is_ready_at_the_new_priority(
    queue: Queue,
) -> None:
    later = (await queue.submit("echo", 1, delay=3600)).job_id
    assert (await queue.jobs.set_priority(later, "critical")).state is State.SCHEDULED
    assert (await queue.jobs.promote(later)).priority == "critical"
    assert later in await ready_ids(queue, later, "critical")

    first = (await queue.submit("echo", 1, concurrency_key="k")).job_id
    held = (await queue.submit("echo", 2, concurrency_key="k")).job_id
    assert (await queue.jobs.set_priority(held, "low")).priority == "low"
    assert (await queue.admin.stats())["total"]["held"] == 1  # still behind its key
    shard = queue.keys.shard_of(first)
    claimed = (await queue.scripts.claim(shard, "w", 10, 30_000)).jobs
    job = next(j for j in claimed if j.id == first)
    await queue.scripts.call(*complete_call(shard, "w", 60, [(job.id, job.lease_version, b"")]))
    assert held in await ready_ids(queue, held, "low")  # admitted, at its new priority


async def test_what_cannot_change(queue: Queue) -> None:
    job_id = (await queue.submit("echo", None, tenant="acme")).job_id
    with pytest.raises(InvalidRequest) as bad:
        await queue.jobs.set_priority(job_id, "urgent")
    assert bad.value.field == "priority"
    with pytest.raises(JobNotFound):
        await queue.jobs.set_priority(job_id, "high", tenant="globex")
    shard = queue.keys.shard_of(job_id)
    await queue.scripts.claim(shard, "w", 10, 30_000)
    before = await queue.status(job_id)
    assert before.state is State.RUNNING
    with pytest.raises(TransitionRefused):
        await queue.jobs.set_priority(job_id, "high", tenant="acme")
    assert await queue.status(job_id) == before
