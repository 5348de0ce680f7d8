"""The near cache keeps terminal documents far past its short TTL, and never serves one stale:
a replay's event advances it; a lost subscription, a silent one (no answer to PING) and a
Redis restart empty it before a missed event could leave a replayed job's old state behind.
Real Redis, real subscriptions, real scripts."""

from __future__ import annotations

import logging
import signal
from collections.abc import AsyncIterator

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from jobtier.config import Settings
from jobtier.core.keys import Keys
from jobtier.core.model import JobSpec, State, decode_status
from jobtier.dev.local_redis import LocalRedis
from jobtier.engine.queue import Queue
from jobtier.status.reader import StatusReader, is_terminal
from jobtier.store.calls import fail_call
from jobtier.store.redis import RedisClient
from jobtier.store.subscriber import ShardSubscriber
from tests.fixtures.engine import wait_for

TENANT = "acme"
ERROR = b'{"type":"ValueError","message":"boom"}'


class Clock:
    """A clock the test moves: the cache's lifetimes are checked without waiting."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def dead_job(queue: Queue) -> str:
    """A job failed for good (dead-lettered) through the real submit, claim and fail."""
    [sub] = await queue.submit_many(
        [JobSpec(type="echo", payload=1, max_attempts=1)], tenant=TENANT
    )
    assert not isinstance(sub, Exception)
    shard = queue.keys.shard_of(sub.job_id)
    batch = await queue.scripts.claim(shard, "worker-t", 10, 60_000)
    [job] = [j for j in batch.jobs if j.id == sub.job_id]
    call = fail_call(shard, "worker-t", 3600, [(job.id, job.lease_version, ERROR, -1)])
    assert (await queue.scripts.call_many([call]))[0][0] == 0
    assert (await queue.status(sub.job_id)).state is State.FAILED
    return sub.job_id


@pytest.fixture
async def reader(settings: Settings, redis_as_jobtier: RedisClient) -> AsyncIterator[StatusReader]:
    keys = Keys(settings.prefix, settings.shards)
    reader = StatusReader(redis_as_jobtier, keys, ttl=2.0, final_ttl=3600.0, clock=Clock())
    subscriber = reader.subscription("test-final")
    reader.subscriber = subscriber  # type: ignore[attr-defined]
    await subscriber.start()
    yield reader
    await subscriber.stop()


def clock_of(reader: StatusReader) -> Clock:
    clock = reader._clock
    assert isinstance(clock, Clock)
    return clock


async def test_a_terminal_document_outlives_the_short_ttl_and_follows_a_replay(
    queue: Queue, reader: StatusReader
) -> None:
    job_id = await dead_job(queue)
    first = await reader.get(job_id)
    assert first is not None and is_terminal(first[1]) and reader.redis_loads == 1
    clock_of(reader).now += 600  # far past the 2 s safety net, within final_ttl
    assert await reader.get(job_id) == first
    assert reader.redis_loads == 1  # a near-cache hit

    replayed = await queue.jobs.replay(job_id)
    assert replayed.state is State.QUEUED

    async def serves_the_replay() -> bool:
        status = await reader.get(job_id)
        return status is not None and status[2] == replayed.version

    await wait_for(serves_the_replay)
    status = await reader.get(job_id)
    assert status is not None and decode_status(status[1]).state is State.QUEUED
    assert reader.redis_loads == 1  # advanced by the replay's event, not reloaded
    # no longer terminal: the short ttl applies again
    clock_of(reader).now += 3
    assert await reader.get(job_id) == status
    assert reader.redis_loads == 2


async def test_a_non_terminal_document_keeps_the_short_ttl(
    queue: Queue, reader: StatusReader
) -> None:
    [sub] = await queue.submit_many([JobSpec(type="echo", payload=1)], tenant=TENANT)
    assert not isinstance(sub, Exception)
    assert await reader.get(sub.job_id) is not None
    clock_of(reader).now += 3
    assert await reader.get(sub.job_id) is not None
    assert reader.redis_loads == 2


async def test_a_lost_subscription_empties_the_cache_before_a_replay_could_be_missed(
    queue: Queue, reader: StatusReader, redis: RedisClient
) -> None:
    job_id = await dead_job(queue)
    assert await reader.get(job_id) is not None
    subscriber: ShardSubscriber = reader.subscriber  # type: ignore[attr-defined]
    near = reader.near
    assert near is not None and job_id in near and subscriber.live()
    generation = near.generation
    await redis.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
    await wait_for(lambda: near.generation > generation)  # on_lost ran
    assert job_id not in near
    # the replay may land while the subscription is down: its event is then lost
    replayed = await queue.jobs.replay(job_id)
    await wait_for(subscriber.live)
    status = await reader.get(job_id)
    assert status is not None and status[2] == replayed.version


async def test_a_silent_subscription_is_closed_and_counts_as_lost(
    queue: Queue, reader: StatusReader, redis: RedisClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="jobtier.redis")
    job_id = await dead_job(queue)
    assert await reader.get(job_id) is not None
    subscriber: ShardSubscriber = reader.subscriber  # type: ignore[attr-defined]
    subscriber.PING_INTERVAL, subscriber.PONG_TIMEOUT = 0.05, 0.3
    near = reader.near
    assert near is not None
    generation = near.generation
    # the server answers nothing for 2 s (its connection stays open): only the pings tell
    await redis.execute_command("CLIENT", "PAUSE", "2000", "ALL")
    await wait_for(lambda: near.generation > generation)
    assert job_id not in near
    assert any("event=subscription_silent" in m for m in caplog.messages)
    await wait_for(subscriber.live)


async def test_a_redis_restart_empties_the_cache(redis_to_kill: LocalRedis) -> None:
    """On a Redis of the test's own, SIGKILLed (no goodbye) and started again on its AOF:
    the reader's subscriber sees a new server, empties the near cache, and the replay made
    after the restart is served, not the cached terminal document. Nothing is reloaded by
    the test: the scripts the restart dropped are loaded again by the calls that need them."""
    settings = Settings.from_env({}, redis_url=redis_to_kill.url, shards=4, lease_seconds=5.0)
    async with await Queue.connect(settings, catalog=False) as queue:
        reader = StatusReader(queue.redis, queue.keys, ttl=2.0, final_ttl=3600.0, clock=Clock())
        subscriber = reader.subscription("test-restart")
        await subscriber.start()
        try:
            await _restart_empties(queue, reader, subscriber, redis_to_kill)
        finally:
            await subscriber.stop()


async def _restart_empties(
    queue: Queue, reader: StatusReader, subscriber: ShardSubscriber, server: LocalRedis
) -> None:
    job_id = await dead_job(queue)
    first = await reader.get(job_id)
    assert first is not None
    near = reader.near
    assert near is not None and job_id in near
    generation = near.generation
    server.stop(signal.SIGKILL)
    server.start()  # its AOF (appendfsync always): the job is there again
    await wait_for(lambda: near.generation > generation, timeout=30)
    assert job_id not in near
    await wait_for(subscriber.live, timeout=30)

    async def replayed() -> int | None:  # the pooled connections died with the old server
        try:
            return (await queue.jobs.replay(job_id)).version
        except RedisConnectionError:
            return None

    versions: list[int] = []

    async def replay_made() -> bool:
        version = await replayed()
        if version is not None:
            versions.append(version)
        return version is not None

    await wait_for(replay_made, timeout=30)

    async def serves_the_replay() -> bool:
        try:  # the reader's pooled connections died with the old server too
            status = await reader.get(job_id)
        except RedisConnectionError:
            return False
        return status is not None and status[2] == versions[0]

    await wait_for(serves_the_replay)
