"""The parts that ride through a Redis master's failover, each on its own: the cluster
client's commands to healthy nodes while one is down, the status reader's batch across
nodes, a worker's claim round, its outcomes and its lease extensions across nodes, and the
status subscription following the sentinels' master. (The roles together, as processes
under load: test_failover.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import pytest
import redis as syncredis
from redis.asyncio.cluster import NodesManager
from redis.crc import key_slot
from redis.exceptions import RedisClusterException, RedisError

from jobtier.config import Settings
from jobtier.core.keys import Keys
from jobtier.core.model import State
from jobtier.dev.local_redis import LocalRedis
from jobtier.dev.local_replicas import LocalCluster, LocalSentinels
from jobtier.engine.produce import DEFAULT_TENANT
from jobtier.engine.queue import Queue
from jobtier.scheduler import Scheduler
from jobtier.status.nearcache import Entry
from jobtier.status.reader import RESYNC, StatusReader
from jobtier.store.calls import claim_call, parse_claim
from jobtier.store.redis import REFRESH_EVERY, Cluster, connect
from jobtier.store.scripts import Scripts
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import TaskRegistry, task
from tests.fixtures.cluster import FAILOVER_SHARDS, failover_settings
from tests.fixtures.engine import Background, wait_for, worker_for

pytestmark = pytest.mark.slow

SHARDS = FAILOVER_SHARDS


@pytest.fixture
def queue(failover_queue: Queue) -> Queue:
    """This module's queue is the failover cluster's."""
    return failover_queue


def owners(cluster: LocalCluster, keys: Keys) -> dict[int, int]:
    """Shard -> the port of the master that serves it."""
    with syncredis.Redis(port=cluster.running()[0].port) as client:
        ranges = client.execute_command("CLUSTER", "SLOTS")
    out = {}
    for shard in range(keys.shards):
        slot = key_slot(keys.base(shard).encode())
        out[shard] = next(int(r[2][1]) for r in ranges if int(r[0]) <= slot <= int(r[1]))
    return out


def victim_of(cluster: LocalCluster, keys: Keys) -> tuple[LocalRedis, set[int]]:
    """The master serving shard 0, and the shards it serves."""
    where = owners(cluster, keys)
    victim = next(m for m in cluster.masters() if m.port == where[0])
    return victim, {s for s, port in where.items() if port == victim.port}


async def test_commands_to_healthy_nodes_go_on_while_a_pipeline_fails_on_a_dead_one(
    failover_cluster: LocalCluster, queue: Queue
) -> None:
    """redis-py answers a pipeline failed on one node by closing the whole client: commands
    in flight on the other nodes then fail (AttributeError: 'NoneType' object has no
    attribute 'writelines', or a connection error). Ours only re-reads the topology."""
    redis = queue.redis
    assert isinstance(redis, Cluster)
    keys = queue.keys
    victim, lost = victim_of(failover_cluster, keys)
    healthy = [s for s in range(keys.shards) if s not in lost]
    for s in range(keys.shards):
        await redis.set(keys.base(s) + "probe", s)
    # its replica kept from taking over meanwhile: a pipeline sent late on a slow machine
    # would otherwise find it promoted (the fixture revives the victim afterwards)
    async with down_until_exit(failover_cluster, victim):
        await _healthy_reads_go_on(redis, keys, healthy)
    # the promoted replica serves the lost shards: a command finds it by itself
    await wait_for(lambda: _reads(redis, keys, sorted(lost)), timeout=30)


@contextlib.contextmanager
def no_promotion(cluster: LocalCluster, master: LocalRedis) -> Iterator[None]:
    """``master``'s replicas take no part in a failover while the block runs (the test looks
    at a cluster with that master down as long as it needs, loaded machine or not); then
    they do again, and the caller waits for the promotion."""
    replicas = cluster.replicas_of(master)
    assert replicas
    for replica in replicas:
        with syncredis.Redis(port=replica.port) as r:
            r.config_set("cluster-replica-no-failover", "yes")
    try:
        yield
    finally:
        for replica in replicas:
            with syncredis.Redis(port=replica.port) as r:
                r.config_set("cluster-replica-no-failover", "no")


async def test_a_topology_refresh_while_the_first_master_is_down_fails_no_healthy_command(
    failover_cluster: LocalCluster, queue: Queue
) -> None:
    """redis-py reads the command table (COMMAND) again on every topology refresh, from the
    first master listed, and asks that node for the keys of XREAD / XREADGROUP (COMMAND
    GETKEYS). With that master killed, every refresh failed until its replica was promoted,
    and each command that asked for one (any command after a failed one, on any node)
    failed with it, as did every stream read: 503s on the healthy masters' shards, a
    persister that read nothing. The table is read once; stream keys are found here."""
    redis = queue.redis
    assert isinstance(redis, Cluster)
    keys = queue.keys
    first = redis.nodes_manager.default_node
    victim = next(m for m in failover_cluster.masters() if m.port == first.port)
    healthy = [s for s, port in owners(failover_cluster, keys).items() if port != victim.port]
    assert healthy
    for s in range(keys.shards):
        await redis.set(keys.base(s) + "probe", s)
        await redis.xadd(keys.base(s) + "probe-stream", {"n": s})
    try:
        await _refresh_with_the_first_master_down(failover_cluster, redis, keys, victim, healthy)
    finally:  # the replica takes over, and the fixture revives the victim
        await asyncio.to_thread(failover_cluster.wait_promoted, victim)


async def _refresh_with_the_first_master_down(
    cluster: LocalCluster, redis: Cluster, keys: Keys, victim: LocalRedis, healthy: list[int]
) -> None:
    with no_promotion(cluster, victim):
        cluster.kill(victim)
        for _ in range(3):
            redis._initialize = True  # a command failed on the dead node: refresh due
            redis._refreshed_at = -REFRESH_EVERY
            for s in healthy:
                assert await redis.get(keys.base(s) + "probe") == str(s).encode()
                read: Any = await redis.xread({keys.base(s) + "probe-stream": "0"}, count=1)
                assert read[0][1][0][1] == {b"n": str(s).encode()}
        assert victim.port in {n.port for n in redis.get_primaries()}  # still listed


async def test_a_refresh_that_fails_leaves_the_known_map_in_use(
    failover_cluster: LocalCluster, queue: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No startup node answering CLUSTER SLOTS is, in redis-py, a RedisClusterException (no
    RedisError): commands still go by the map known, and the refresh is tried again only
    REFRESH_EVERY later, not before every command."""
    redis = queue.redis
    assert isinstance(redis, Cluster)
    keys = queue.keys
    for s in range(keys.shards):
        await redis.set(keys.base(s) + "probe", s)
    attempts = 0

    async def unreadable(self: NodesManager, *args: object, **kwargs: object) -> None:
        nonlocal attempts
        attempts += 1
        raise RedisClusterException("Redis Cluster cannot be connected. Please provide ...")

    monkeypatch.setattr(NodesManager, "initialize", unreadable)  # slotted: the class
    monkeypatch.setattr("jobtier.store.redis.REFRESH_EVERY", 3600.0)
    redis._refreshed_at = -7200.0
    for _ in range(3):
        redis._initialize = True
        for s in range(keys.shards):
            assert await redis.get(keys.base(s) + "probe") == str(s).encode()
    assert attempts == 1


async def _healthy_reads_go_on(redis: Cluster, keys: Keys, healthy: list[int]) -> None:
    errors: list[BaseException] = []
    done = 0
    stop = time.monotonic() + 1.5  # the victim stays down meanwhile (down_until_exit)

    async def healthy_reads() -> None:
        nonlocal done
        while time.monotonic() < stop:
            for s in healthy:
                try:
                    assert await redis.get(keys.base(s) + "probe") == str(s).encode()
                    done += 1
                except Exception as exc:
                    errors.append(exc)

    async def failing_pipelines() -> None:
        while time.monotonic() < stop:
            pipe = redis.pipeline()
            for s in range(keys.shards):
                pipe.get(keys.base(s) + "probe")
            with pytest.raises(RedisError):
                await pipe.execute()

    await asyncio.gather(*(healthy_reads() for _ in range(8)), failing_pipelines())
    assert errors == [], errors[:5]
    assert done > 0


async def _reads(redis: Cluster, keys: Keys, shards: list[int]) -> bool:
    try:
        return [await redis.get(keys.base(s) + "probe") for s in shards] == [
            str(s).encode() for s in shards
        ]
    except RedisError:
        return False


async def test_a_status_batch_is_answered_for_the_nodes_that_are_up(
    failover_cluster: LocalCluster, queue: Queue
) -> None:
    keys = queue.keys
    jobs: list[str] = []
    for shard in range(keys.shards):  # a job on every shard (ids name their shard)
        while len(jobs) <= shard:
            job = await queue.submit("echo", shard)
            if keys.shard_of(job.job_id) == shard:
                jobs.append(job.job_id)
    victim, lost = victim_of(failover_cluster, keys)
    reader = StatusReader(queue.redis, keys, near_cache=False)
    failover_cluster.kill(victim)
    try:
        # one coalesced batch: every id asked in this tick, read in one round trip per node
        results = await asyncio.gather(*(reader.get(j) for j in jobs), return_exceptions=True)
    finally:  # the fixture revives the victim once its replica took over
        await asyncio.to_thread(failover_cluster.wait_promoted, victim)
    for job_id, result in zip(jobs, results, strict=True):
        if keys.shard_of(job_id) in lost:
            assert isinstance(result, RedisError), (job_id, result)
        else:
            assert isinstance(result, tuple) and result[2] >= 1, (job_id, result)
    assert reader.coalescer is not None and reader.coalescer.batches == 1

    async def all_read() -> bool:
        found = await asyncio.gather(*(reader.get(j) for j in jobs), return_exceptions=True)
        return all(isinstance(r, tuple) for r in found)

    await wait_for(all_read, timeout=30)


async def test_a_claim_round_starts_the_jobs_of_the_nodes_that_are_up(
    failover_cluster: LocalCluster, queue: Queue
) -> None:
    """The claims of one round go one pipeline per node: a dead node fails its shards'
    claims only (call_many_each), the others' jobs are claimed."""
    keys = queue.keys
    for shard in range(keys.shards):
        done = False
        while not done:
            job = await queue.submit("echo", shard)
            done = keys.shard_of(job.job_id) == shard
    victim, lost = victim_of(failover_cluster, keys)
    scripts: Scripts = queue.store.scripts
    failover_cluster.kill(victim)
    calls = [claim_call(shard, "w1", 10, 5000) for shard in range(keys.shards)]
    try:
        replies = await scripts.call_many_each(calls)
    finally:  # the fixture revives the victim once its replica took over
        await asyncio.to_thread(failover_cluster.wait_promoted, victim)
    for shard, reply in enumerate(replies):
        if shard in lost:
            assert isinstance(reply, RedisError), (shard, reply)
        else:
            assert parse_claim(shard, reply).jobs, (shard, reply)


class Held:
    """The ``held`` task's attempts wait for ``release``; ``runs`` counts them per job."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.runs: Counter[str] = Counter()


HELD = Held()


@task(name="held", retries=2, backoff_base=0.05)
async def held(ctx: JobContext, payload: Any) -> str:
    HELD.runs[ctx.job_id] += 1
    await HELD.release.wait()
    return "released"


async def held_jobs(queue: Queue) -> dict[int, str]:
    """One ``held`` job on every shard (an idempotency key picks a job's shard): shard -> id."""
    global HELD
    HELD = Held()
    keys = queue.keys
    jobs = {}
    for shard in range(keys.shards):
        key = next(
            k
            for k in (f"held-{shard}-{i}" for i in itertools.count())
            if keys.shard_for(DEFAULT_TENANT, k) == shard
        )
        jobs[shard] = (await queue.submit(held, None, idempotency_key=key)).job_id
        assert keys.shard_of(jobs[shard]) == shard
    return jobs


@contextlib.asynccontextmanager
async def down_until_exit(cluster: LocalCluster, victim: LocalRedis) -> AsyncIterator[None]:
    """Kill ``victim`` with its replicas told not to take over (``no_promotion``), so that it
    stays down while the test looks; on exit they may, and the promotion is awaited (the
    fixture then brings the victim back)."""
    try:
        with no_promotion(cluster, victim):
            cluster.kill(victim)
            yield
            # nothing was promoted while the test looked
            assert victim.pid is None and cluster.replicas_of(victim), cluster.roles()
    finally:
        if victim.pid is None:
            await asyncio.to_thread(cluster.wait_promoted, victim)


async def states_are(queue: Queue, jobs: Iterable[str], states: Iterable[State]) -> bool:
    wanted = set(states)
    try:
        found = await asyncio.gather(*(queue.status(j) for j in jobs))
    except RedisError:
        return False
    return all(status.state in wanted for status in found)


async def test_a_worker_completes_the_jobs_of_the_masters_that_are_up(
    failover_cluster: LocalCluster,
    queue: Queue,
    background: Background,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The outcomes of one report round go one pipeline per node and are taken call by call
    (call_many_each): the worker knows the jobs on the healthy masters ended while a master
    is down, and sends again only the lost shards' outcomes. (Taken as one batch, the
    healthy nodes' completions ran but the batch failed: sent again after the promotion,
    they were refused as stale.)"""
    caplog.set_level(logging.INFO, logger="jobtier.worker")
    jobs = await held_jobs(queue)
    victim, lost = victim_of(failover_cluster, queue.keys)
    healthy = [job for shard, job in jobs.items() if shard not in lost]
    worker = worker_for(queue, TaskRegistry([held]), concurrency=len(jobs))
    background.start(worker)
    background.start(Scheduler(queue.store))
    await wait_for(lambda: len(HELD.runs) == len(jobs))  # every job runs
    async with down_until_exit(failover_cluster, victim):
        HELD.release.set()
        await wait_for(lambda: worker.stats.succeeded == len(healthy))
        assert await states_are(queue, healthy, [State.SUCCEEDED])
    # the lost shards' outcomes land on the promoted replica (or their jobs run again)
    await wait_for(lambda: states_are(queue, jobs.values(), [State.SUCCEEDED]), timeout=30)
    assert all(HELD.runs[job] == 1 for job in healthy), HELD.runs
    refused = [r.getMessage() for r in caplog.records if "stale_write_refused" in r.getMessage()]
    assert not [m for m in refused if any(job in m for job in healthy)], refused


async def test_a_worker_beats_for_the_jobs_of_the_masters_that_are_up(
    failover_cluster: LocalCluster, background: Background, caplog: pytest.LogCaptureFixture
) -> None:
    """A beat goes one pipeline per node and its replies are taken call by call
    (call_many_each): while a master is down, the leases on the healthy masters are extended
    past the lease they had when it died, none of their jobs is lost or run twice, and the
    beat's replies for them are acted on (a cancel request, which this worker learns of by
    its beats alone, stops its job). (Taken as one batch, the healthy nodes' extensions ran
    but the beat failed: their replies were dropped until the promotion.)"""
    caplog.set_level(logging.INFO, logger="jobtier.worker")
    settings = failover_settings(failover_cluster, lease_seconds=3.0)
    queue = await Queue.connect(settings, catalog=False)
    try:
        keys = queue.keys
        jobs = await held_jobs(queue)
        victim, lost = victim_of(failover_cluster, keys)
        healthy = {shard: job for shard, job in jobs.items() if shard not in lost}
        worker = worker_for(queue, TaskRegistry([held]), concurrency=len(jobs), cancel_push=False)
        background.start(worker)
        background.start(Scheduler(queue.store))
        await wait_for(lambda: len(HELD.runs) == len(jobs))

        async def deadlines() -> list[float]:
            scores = [await queue.redis.zscore(keys.active(s), j) for s, j in healthy.items()]
            assert all(score is not None for score in scores), scores
            return [float(score) for score in scores if score is not None]

        cancelled = next(iter(healthy.values()))
        async with down_until_exit(failover_cluster, victim):
            # the local nodes' clock is ours: wait until every lease held at the kill ended
            ended = max(await deadlines()) + 300
            await wait_for(lambda: time.time() * 1000 > ended, timeout=15)
            now = time.time() * 1000
            assert min(await deadlines()) > now  # extended meanwhile
            assert worker.stats.leases_lost == 0
            await queue.cancel(cancelled)
            await wait_for(lambda: states_are(queue, [cancelled], [State.CANCELLED]))
        HELD.release.set()
        others = [job for job in jobs.values() if job != cancelled]
        await wait_for(lambda: states_are(queue, others, [State.SUCCEEDED]), timeout=30)
        assert all(HELD.runs[job] == 1 for job in healthy.values()), HELD.runs
        lost_leases = [r.getMessage() for r in caplog.records if "lease_lost" in r.getMessage()]
        assert not [m for m in lost_leases if any(j in m for j in healthy.values())], lost_leases
    finally:
        await background.stop()
        await queue.close()


async def test_the_status_subscription_follows_the_sentinels_master(
    sentinels: LocalSentinels, sentinel_settings: Settings
) -> None:
    redis = connect(sentinel_settings)
    keys = Keys(sentinel_settings.prefix, sentinel_settings.shards)
    reader = StatusReader(redis, keys)
    subscriber = reader.subscription("test")
    heard: list[int] = []
    reader.add_listener("job-x", lambda version, _t, _d: heard.append(version))
    await subscriber.start()
    try:
        assert reader.near is not None
        reader.near.put("job-x", Entry("t", 1, b"{}", time.monotonic(), False))
        first = sentinels.master()
        sentinels.kill(first)
        # lost at once: the cache no longer serves what the old master said
        await wait_for(lambda: not subscriber.live(), timeout=10)
        assert reader.near.get("job-x", time.monotonic()) is None
        promoted = await asyncio.to_thread(sentinels.wait_promoted, first)
        await wait_for(subscriber.live, timeout=30)
        assert RESYNC in heard  # listeners told to read again
        # the subscription is on the promoted master: its events arrive
        with syncredis.Redis(port=promoted.port, password=promoted.password) as client:

            def published() -> bool:
                client.execute_command("SPUBLISH", keys.events(0), b"job-x 7 t\n{}")
                return 7 in heard

            await wait_for(published, timeout=10, interval=0.1)
    finally:
        await subscriber.stop()
        await redis.aclose()
