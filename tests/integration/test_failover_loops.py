"""Two loops while a cluster master is down, each kept going for the masters that are up.

- The scheduler: the healthy shards have their jobs promoted and their expired leases
  reclaimed on time, and the lost master's shards are retried on their own back-off. (Its
  calls went as one pipeline taken whole: one dead node failed every pass, and nothing was
  promoted or reclaimed anywhere until it was back.)
- A worker's full heartbeat: it still says the worker is alive and refreshes its limits when
  the beat failed on the lost node, and the progress that beat carried for the lost shards'
  jobs is sent again rather than dropped. (A failed beat skipped both, and its progress was
  lost.)
- A worker's permits of a limited queue: those of the jobs that ended on the masters that
  are up are given back while the lost master's outcomes wait. (They waited for a round of
  outcomes that landed whole: the queue ran below its limit until the master was back.)
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

import msgspec
import pytest
import redis as syncredis
from redis.crc import key_slot
from redis.exceptions import RedisError

from jobtier.core.model import QueueLimits, State
from jobtier.dev.local_redis import LocalRedis
from jobtier.dev.local_replicas import LocalCluster
from jobtier.engine.produce import DEFAULT_TENANT
from jobtier.engine.queue import Queue
from jobtier.scheduler import NOW, Scheduler
from jobtier.store.calls import claim_call, parse_claim
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import TaskRegistry, task
from tests.fixtures.cluster import FAILOVER_SHARDS, failover_settings
from tests.fixtures.engine import Background, wait_for, worker_for
from tests.integration.test_failover_parts import (
    down_until_exit,
    owners,
    states_are,
    victim_of,
)

pytestmark = pytest.mark.slow

SHARDS = FAILOVER_SHARDS


@task(name="idle", retries=2)
async def idle(ctx: JobContext, payload: Any) -> None:
    return None


@pytest.fixture
def queue(failover_queue: Queue) -> Queue:
    """This module's queue is the failover cluster's."""
    return failover_queue


def key_on(queue: Queue, shard: int, label: str) -> str:
    """An idempotency key that puts a job on ``shard``."""
    keys = queue.keys
    return next(
        k
        for k in (f"{label}-{shard}-{i}" for i in itertools.count())
        if keys.shard_for(DEFAULT_TENANT, k) == shard
    )


async def test_the_scheduler_promotes_and_reclaims_on_the_masters_that_are_up(
    failover_cluster: LocalCluster,
    queue: Queue,
    background: Background,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="jobtier.scheduler")
    keys = queue.keys
    victim, lost = victim_of(failover_cluster, keys)
    healthy = [s for s in range(keys.shards) if s not in lost]
    # a job on every healthy shard whose lease will expire while the victim is down: claimed
    # by a worker that is never heard of again
    leased = {}
    for shard in healthy:
        job = await queue.submit(idle, None, idempotency_key=key_on(queue, shard, "leased"))
        reply = await queue.scripts.call(*claim_call(shard, "gone", 1, 1000))
        assert [j.id for j in parse_claim(shard, reply).jobs] == [job.job_id]
        leased[shard] = job.job_id
    scheduler = Scheduler(queue.store, resolve=False)
    background.start(scheduler)
    await wait_for(lambda: scheduler.stats.passes > 0)  # subscribed, and running its passes
    async with down_until_exit(failover_cluster, victim):
        # due in a moment, on the healthy shards only: the victim's shards cannot be written
        delayed = [
            (await queue.submit(idle, None, delay=0.3, idempotency_key=key_on(queue, s, "d")))
            for s in healthy
        ]
        ids = [j.job_id for j in delayed]
        assert await states_are(queue, ids, [State.SCHEDULED])
        await wait_for(lambda: states_are(queue, ids, [State.QUEUED]), timeout=30)
        await wait_for(lambda: states_are(queue, leased.values(), [State.QUEUED]), timeout=30)
        assert scheduler.stats.requeued >= len(healthy)
        # the victim's shards were tried, failed, and named
        failures = [r.getMessage() for r in caplog.records if "scheduler_shards_failed" in r.msg]
        assert failures
        named = {
            int(s) for m in failures for s in m.split("shards=", 1)[1].split(" ", 1)[0].split(",")
        }
        assert named <= lost, (named, lost)
        # the lost shards wait out their back-off: a new subscription (made every few tens
        # of ms while a node is down) does not make them due again at once
        assert all(scheduler._retry[s].failures for s in named)
        scheduler._on_reset()
        assert all(scheduler._next_due[s] != NOW for s in named), scheduler._next_due
    # the promoted replica serves the lost shards, and the scheduler finds its way there:
    # a job delayed on one of them is promoted too
    shard = min(lost)
    late = await queue.submit(idle, None, delay=0.2, idempotency_key=key_on(queue, shard, "l"))
    await wait_for(lambda: states_are(queue, [late.job_id], [State.QUEUED]), timeout=30)


class Gate:
    def __init__(self) -> None:
        self.running: set[str] = set()
        self.report = asyncio.Event()
        self.release = asyncio.Event()


GATE = Gate()


@task(name="reports", retries=2)
async def reports(ctx: JobContext, payload: Any) -> None:
    GATE.running.add(ctx.job_id)
    await GATE.report.wait()
    ctx.progress({"step": 1})
    await GATE.release.wait()


def master_of(cluster: LocalCluster, key: str) -> int:
    """The port of the master that serves ``key``."""
    with syncredis.Redis(port=cluster.running()[0].port) as client:
        ranges = client.execute_command("CLUSTER", "SLOTS")
    slot = key_slot(key.encode())
    return next(int(r[2][1]) for r in ranges if int(r[0]) <= slot <= int(r[1]))


def victim_beside(cluster: LocalCluster, queue: Queue) -> tuple[LocalRedis, set[int]]:
    """A master that serves some shards but not the live workers' hash, and its shards."""
    where = owners(cluster, queue.keys)
    spared = master_of(cluster, queue.keys.workers())
    victim = next(m for m in cluster.masters() if m.port != spared and m.port in where.values())
    return victim, {s for s, port in where.items() if port == victim.port}


async def test_a_worker_says_it_is_alive_and_keeps_progress_while_a_master_is_down(
    failover_cluster: LocalCluster, background: Background
) -> None:
    global GATE
    GATE = Gate()
    settings = failover_settings(failover_cluster, lease_seconds=3.0)
    async with await Queue.connect(settings, catalog=False) as queue:
        jobs = {
            shard: (await queue.submit(reports, None, idempotency_key=key_on(queue, shard, "r")))
            for shard in range(SHARDS)
        }
        ids = {shard: job.job_id for shard, job in jobs.items()}
        victim, lost = victim_beside(failover_cluster, queue)
        healthy = [job for shard, job in ids.items() if shard not in lost]
        worker = worker_for(queue, TaskRegistry([reports]), concurrency=SHARDS)
        background.start(worker)
        try:
            await wait_for(lambda: len(GATE.running) == SHARDS)

            async def seen_since(moment: float) -> bool:
                """The worker advertised itself after ``moment``."""
                raw = await queue.redis.hget(queue.keys.workers(), worker.id)
                return raw is not None and float(msgspec.json.decode(raw)["seen_at"]) > moment

            async def progress_of(job_ids: list[str]) -> bool:
                try:
                    found = await asyncio.gather(*(queue.status(j) for j in job_ids))
                except RedisError:  # a lost shard's, until its replica is promoted and known
                    return False
                return all(status.progress == {"step": 1} for status in found)

            async with down_until_exit(failover_cluster, victim):
                killed = time.time()
                GATE.report.set()
                await wait_for(lambda: progress_of(healthy), timeout=30)
                # full beats fail on the victim's shards, and the worker is still advertised
                await wait_for(lambda: seen_since(killed), timeout=30)
            # the victim's replica serves its shards now: the progress reported while they were
            # down reaches them, though no task reported again
            await wait_for(lambda: progress_of([ids[s] for s in lost]), timeout=30)
            GATE.release.set()
            await wait_for(lambda: states_are(queue, ids.values(), [State.SUCCEEDED]), timeout=30)
        finally:  # the worker's last writes (its sign-off) go before the client closes
            GATE.release.set()
            await background.stop()


@task(name="gated", queue="partner", retries=2)
async def gated(ctx: JobContext, payload: Any) -> None:
    GATE.running.add(ctx.job_id)
    await GATE.release.wait()


async def test_a_worker_gives_back_the_permits_of_the_jobs_that_ended_on_the_masters_up(
    failover_cluster: LocalCluster, queue: Queue, background: Background
) -> None:
    global GATE
    GATE = Gate()
    await queue.admin.set_limits("partner", QueueLimits(concurrency=SHARDS))
    ids = {
        shard: (await queue.submit(gated, None, idempotency_key=key_on(queue, shard, "g"))).job_id
        for shard in range(SHARDS)
    }
    # the victim serves some of the jobs' shards, not the queue's permits
    where = owners(failover_cluster, queue.keys)
    home = where[queue.keys.home("partner")]
    victim = next(m for m in failover_cluster.masters() if m.port != home)
    lost = {s for s, port in where.items() if port == victim.port}
    assert lost
    worker = worker_for(queue, TaskRegistry([gated]), concurrency=SHARDS)
    background.start(worker)
    await wait_for(lambda: len(GATE.running) == SHARDS)
    assert await queue.admin.running_permits("partner") == SHARDS

    async def permits_held(n: int) -> bool:
        return await queue.admin.running_permits("partner") == n

    async with down_until_exit(failover_cluster, victim):
        GATE.release.set()
        await wait_for(lambda: worker.stats.succeeded == SHARDS - len(lost), timeout=30)
        await wait_for(lambda: permits_held(len(lost)), timeout=30)
    await wait_for(lambda: states_are(queue, ids.values(), [State.SUCCEEDED]), timeout=30)
    await wait_for(lambda: permits_held(0), timeout=30)


@task(name="limited", queue="partner", retries=2)
async def limited(ctx: JobContext, payload: Any) -> None:
    return None


async def test_a_limited_queue_is_claimed_on_the_masters_up_while_another_is_down(
    failover_cluster: LocalCluster, queue: Queue, background: Background
) -> None:
    """A limited queue's claim loop reads its ready jobs and claims them shard by shard: the
    jobs of the masters that are up start while another master is down. (Its read of the
    ready counts, one pipeline taken whole, failed every round: the queue ran nothing
    anywhere until the master was back.)"""
    await queue.admin.set_limits("partner", QueueLimits(concurrency=2))
    where = owners(failover_cluster, queue.keys)
    home = where[queue.keys.home("partner")]
    victim = next(m for m in failover_cluster.masters() if m.port != home)
    lost = {s for s, port in where.items() if port == victim.port}
    assert lost
    worker = worker_for(queue, TaskRegistry([limited]), concurrency=4)
    background.start(worker)
    await wait_for(lambda: "partner" in worker.limits)  # its loop runs
    async with down_until_exit(failover_cluster, victim):
        up = [
            (await queue.submit(limited, i, idempotency_key=key_on(queue, shard, f"l{i}"))).job_id
            for shard in range(SHARDS)
            if shard not in lost
            for i in range(3)
        ]
        await wait_for(lambda: states_are(queue, up, [State.SUCCEEDED]), timeout=60)

    async def none_held() -> bool:
        return await queue.admin.running_permits("partner") == 0

    await wait_for(none_held, timeout=30)
