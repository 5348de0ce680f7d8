"""Purging a queue (purge.lua): every ready or parked job of the queue is cancelled as a
cancel would cancel it — counters, tenant rings, waiting counts, concurrency keys and the
transition log — and nothing else is touched."""

from __future__ import annotations

from typing import Any, cast

import pytest

from jobtier.core.model import PRIORITIES, State, decode_status
from jobtier.engine.queue import Queue
from jobtier.streams.entries import split_fields
from tests.fixtures.postgres import log_entries

pytestmark = pytest.mark.contract  # on the single Redis and on the Redis Cluster


async def ready_keys(queue: Queue, name: str) -> list[str]:
    """The ready lists and tenant rings of queue ``name`` that exist in any shard."""
    found = []
    for shard in range(queue.keys.shards):
        for p in PRIORITIES:
            ring = queue.keys.ring(shard, name, p.value)
            for tenant in cast(list[bytes], await queue.redis.lrange(ring, 0, -1)):
                found.append(queue.keys.ready(shard, name, p.value, tenant.decode()))
            if await queue.redis.exists(ring):
                found.append(ring)
    return found


async def test_purge_cancels_every_ready_job_of_the_queue_and_nothing_else(
    queue: Queue,
) -> None:
    doomed = []
    for i in range(60):
        tenant = ("acme", "globex", "initech")[i % 3]
        priority = PRIORITIES[i % 4].value
        sub = await queue.submit("echo", i, queue="bulk", tenant=tenant, priority=priority)
        doomed.append(sub.job_id)
    kept = [(await queue.submit("echo", i, queue="other", tenant="acme")).job_id for i in range(5)]
    later = (await queue.submit("echo", 0, queue="bulk", tenant="acme", delay=3600)).job_id
    # one job of the queue running: a purge leaves it to finish
    running = (await queue.submit("echo", "r", queue="live", tenant="acme")).job_id
    shard = queue.keys.shard_of(running)
    claimed = await queue.scripts.claim(shard, "w1", 1, 30_000, queues=[("live", -1)])
    assert [j.id for j in claimed.jobs] == [running]

    purged = await queue.admin.purge("bulk", batch=7)  # several calls per shard

    assert (purged.queue, purged.cancelled, purged.remaining) == ("bulk", 60, 0)
    for job_id in doomed:
        status = await queue.status(job_id)
        assert status.state is State.CANCELLED and status.cancel_requested, status
    assert all([(await queue.status(j)).state is State.QUEUED for j in kept])
    assert (await queue.status(later)).state is State.SCHEDULED
    assert (await queue.status(running)).state is State.RUNNING
    stats = await queue.admin.stats()
    assert stats["queues"]["bulk"]["queued"] == {p.value: 0 for p in PRIORITIES}
    assert stats["queues"]["other"]["queued"]["normal"] == 5
    assert await ready_keys(queue, "bulk") == []  # lists and rings gone with their jobs
    # the tenants' waiting counts: acme keeps its 5 `other` jobs and the scheduled one
    assert await queue.admin.waiting_by_tenant() == {"acme": 6, "globex": 0, "initech": 0}
    # every cancellation is in the log for Postgres: queued -> cancelled, made by an admin
    entries = [
        fields
        for _, _, whole in await log_entries(queue.redis, queue.keys)
        for fields in split_fields(whole)  # (a call's transitions are one entry)
        if b'"state":"cancelled"' in fields[b"d"]
    ]
    assert sorted(decode_status(f[b"d"]).id for f in entries) == sorted(doomed)
    assert {(f[b"fr"], f[b"w"]) for f in entries} == {(b"queued", b"admin")}
    # finished jobs expire like any cancelled one
    assert 0 < await queue.redis.ttl(queue.keys.job(doomed[0])) <= queue.settings.retention_seconds
    # a worker finds nothing left to claim in the queue
    for s in range(queue.keys.shards):
        batch = await queue.scripts.claim(s, "w2", 100, 30_000, queues=[("bulk", -1)])
        assert batch.jobs == []


async def test_purge_takes_parked_jobs_too(queue: Queue) -> None:
    jobs = [(await queue.submit("resize", i, queue="img")).job_id for i in range(6)]
    # a worker that only runs `checksum` hands them back: they are parked for one that can
    for s in range(queue.keys.shards):
        await queue.scripts.claim(s, "w", 10, 30_000, queues=[("img", -1)], types=["checksum"])
    assert (await queue.admin.stats())["queues"]["img"]["parked"] == 6

    purged = await queue.admin.purge("img")

    assert (purged.cancelled, purged.remaining) == (6, 0)
    stats = await queue.admin.stats()
    assert stats["queues"]["img"]["parked"] == 0 and stats["total"]["parked"] == 0
    assert all([(await queue.status(j)).state is State.CANCELLED for j in jobs])


async def test_jobs_held_behind_a_concurrency_key_are_admitted_and_said_to_remain(
    queue: Queue,
) -> None:
    jobs = [
        (await queue.submit("echo", i, queue="keyed", concurrency_key="acct-1")).job_id
        for i in range(3)
    ]
    # one is ready, two wait behind the key: the purge takes the ready one, whose leaving
    # admits the next, which it leaves (it was not ready when the purge began)
    purged = await queue.admin.purge("keyed")
    assert (purged.cancelled, purged.remaining) == (1, 1)
    states = [(await queue.status(j)).state for j in jobs]
    assert states == [State.CANCELLED, State.QUEUED, State.QUEUED]
    again = await queue.admin.purge("keyed")
    assert (again.cancelled, again.remaining) == (1, 1)
    last = await queue.admin.purge("keyed")
    assert (last.cancelled, last.remaining) == (1, 0)
    assert all([(await queue.status(j)).state is State.CANCELLED for j in jobs])
    shard = queue.keys.shard_of(jobs[0])
    assert await queue.redis.hgetall(queue.keys.ckeys(shard)) == {}  # the key is idle


async def test_a_purge_of_an_empty_or_unknown_queue_does_nothing(queue: Queue) -> None:
    kept = (await queue.submit("echo", 1)).job_id
    purged = await queue.admin.purge("nothing-here")
    assert (purged.cancelled, purged.remaining) == (0, 0)
    assert (await queue.status(kept)).state is State.QUEUED


@pytest.mark.parametrize("bad", ["", "a:b", "x" * 65, "sp ace"])
async def test_a_bad_queue_name_is_refused_before_anything_runs(queue: Queue, bad: Any) -> None:
    from jobtier.core.errors import InvalidRequest

    with pytest.raises(InvalidRequest):
        await queue.admin.purge(bad)
