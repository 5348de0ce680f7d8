"""The write-behind lag counts what waits, and nothing else — across a Redis restart too.

Redis 7.0 counts a consumer group's ``lag`` from a read counter that its AOF does not keep
up to date (XREADGROUP is recorded as XCLAIM): after an AOF rewrite and a restart the
counter is the rewrite's, and ``lag`` reports every entry read since as still waiting, in
streams that may be empty. Admission control then refused submits for a backlog that did
not exist. These tests restart a real redis-server from its AOF with the group mid-stream.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import BusyLoadingError
from redis.exceptions import ConnectionError as RedisConnectionError

from jobtier.api.records import postgres_extension
from jobtier.config import Settings
from jobtier.core.keys import Keys
from jobtier.dev.local_redis import LocalRedis
from jobtier.persist.db import Pool
from jobtier.persist.persister import Persister
from jobtier.store import format as job_format
from jobtier.streams.entries import split_fields
from jobtier.streams.group import LAG_EXACT_UP_TO, lag, oldest_waiting
from tests.fixtures.api import StartApi
from tests.fixtures.postgres import assert_pg_matches_redis, simple_jobs

pytestmark = pytest.mark.slow


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[LocalRedis]:
    server = LocalRedis(tmp_path / "redis").start()
    yield server
    server.stop(signal.SIGKILL)


@pytest.fixture
def settings(own_redis: LocalRedis) -> Settings:
    """This module's tests kill their Redis: a server of their own, not the session's."""
    return Settings.from_env({}, redis_url=own_redis.url, shards=4, api_port=0)


@pytest.fixture
async def redis(settings: Settings) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(settings.redis_url)
    # marked as a process's start marks a new Redis: the scripts below run without one
    await job_format.adopt(client, Keys(settings.prefix, settings.shards))
    yield client
    await client.aclose()


async def waiting_entries(redis: Any, keys: Keys) -> list[dict[bytes, bytes]]:
    """What waits, read entry by entry: the fields of the pending entries and of every entry
    after the group's last-delivered id."""
    found = []
    for shard in range(keys.shards):
        stream = keys.log(shard)
        group = next(g for g in await redis.xinfo_groups(stream))
        pending = await redis.xpending_range(stream, keys.persist_group(), "-", "+", 10_000)
        for p in pending:
            found += [f for _, f in await redis.xrange(stream, p["message_id"], p["message_id"])]
        found += [f for _, f in await redis.xrange(stream, min=b"(" + group["last-delivered-id"])]
    return found


async def truly_waiting(redis: Any, keys: Keys) -> int:
    """The transitions that wait, counted one by one (an entry holds one script's)."""
    return sum(len(split_fields(f)) for f in await waiting_entries(redis, keys))


async def lag_redis_reports(redis: Any, keys: Keys) -> int:
    """Pending entries plus XINFO GROUPS' ``lag``, summed over the shards (what lag() used),
    in entries."""
    total = 0
    for shard in range(keys.shards):
        group = next(g for g in await redis.xinfo_groups(keys.log(shard)))
        total += group["pending"] + (group["lag"] or 0)
    return total


async def assert_same_age(redis: Any, keys: Keys, waiting: int) -> None:
    """lag() counting one entry per shard (a sampler's bound) finds ``waiting`` entries and
    the same oldest one as lag() counting a hundred: its age is the first call's plus the
    time between the two calls (both from this process's clock)."""
    start = time.monotonic()
    _, age = await lag(redis, keys)
    count, age_1 = await lag(redis, keys, exact=1)
    assert count == waiting
    assert age - 0.001 <= age_1 <= age + (time.monotonic() - start) + 0.001


async def restart_from_aof(server: LocalRedis, redis: Any) -> None:
    """SIGKILL (no shutdown, no final AOF flush) and start again on the same data."""
    server.stop(signal.SIGKILL)
    server.start()
    async with asyncio.timeout(30):
        while True:
            try:
                await redis.ping()
                return
            except (BusyLoadingError, RedisConnectionError):
                await asyncio.sleep(0.02)


async def test_lag_after_a_restart_from_the_aof_counts_only_what_waits(
    pg_settings: Settings,
    own_redis: LocalRedis,
    redis: Any,
    keys: Keys,
    pg_pool: Pool,
    start_api: StartApi,
) -> None:
    # every write on disk before its reply: under everysec a busy disk lets Redis postpone the
    # AOF write, and the SIGKILL below would lose what this test counts (not what it tests)
    await redis.config_set("appendfsync", "always")
    persister = Persister(pg_settings, redis, pg_pool, "p1")
    job_ids = await simple_jobs(redis, keys, 40)
    await persister.drain()
    await redis.bgrewriteaof()  # the AOF's base now holds the group's read counter as it is
    async with asyncio.timeout(60):
        while (await redis.info("persistence"))["aof_rewrite_in_progress"]:
            await asyncio.sleep(0.02)
    job_ids += await simple_jobs(redis, keys, 40)
    await persister.drain()  # read, written, acknowledged, trimmed: nothing waits
    assert await lag(redis, keys) == (0, 0.0)

    # mid-stream: some entries delivered to a persister and not acknowledged, some not read
    job_ids += await simple_jobs(redis, keys, 20)
    for shard in range(keys.shards):
        await redis.xreadgroup(keys.persist_group(), "p2", {keys.log(shard): ">"}, count=4)
    before = await truly_waiting(redis, keys)
    # pytest types approx() as ApproxBase, which mypy's strict equality holds never equal to a float
    assert before == 60 and await lag(redis, keys) == (60, pytest.approx(0, abs=60))  # type: ignore[comparison-overlap]

    await restart_from_aof(own_redis, redis)
    assert await truly_waiting(redis, keys) == before
    # the scenario reproduces the stale counter (else this test would prove nothing)
    assert await lag_redis_reports(redis, keys) > len(await waiting_entries(redis, keys))
    assert (await lag(redis, keys))[0] == before
    # counting one entry per shard (a sampler's bound): the same oldest entry, so the same
    # age; past the bound, the entries present and not pending, under the stale counter: all
    # that waits, as the persister trimmed what it had written
    await assert_same_age(redis, keys, before)

    # admission control: a limit the phantom backlog is over and the real one is not
    api = await start_api(
        postgres_extension(pg_settings),
        database_url=pg_settings.database_url,
        persist_max_lag=before + 20,
    )
    async with api.client() as client:
        reply = await client.post("/v1/jobs", json={"type": "echo", "payload": {}})
        assert reply.status_code == 202, reply.text
        job_ids.append(reply.json()["id"])

    persister.consumer.claim_idle_ms = 0  # take p2's entries over now
    await persister.drain()
    assert await lag(redis, keys) == (0, 0.0)
    assert await lag(redis, keys, exact=1) == (0, 0.0)  # nothing waits: 0 whatever the bound
    assert await oldest_waiting(redis, keys) == (False, 0.0)  # the age alone: likewise
    assert await truly_waiting(redis, keys) == 0
    assert await lag_redis_reports(redis, keys) > 0  # Redis's own counter still says otherwise
    await assert_pg_matches_redis(redis, pg_pool, keys, job_ids)


async def test_lag_of_a_long_backlog_is_exact_with_a_sound_counter(
    pg_settings: Settings, redis: Any, keys: Keys, pg_pool: Pool
) -> None:
    """Past LAG_EXACT_UP_TO undelivered entries per shard the count comes from Redis's
    counter (bounded by the entries that exist); with no restart in between, it is exact
    (the entries not read at the mean of those read: here each holds 2 transitions)."""
    persister = Persister(pg_settings, redis, pg_pool, "p1")
    await persister.consumer.setup()
    for _ in range(LAG_EXACT_UP_TO):  # 3 entries a shard each: 3x the exact count
        await simple_jobs(redis, keys, 2 * keys.shards)
    for shard in range(keys.shards):
        await redis.xreadgroup(keys.persist_group(), "p2", {keys.log(shard): ">"}, count=7)
    truth = await truly_waiting(redis, keys)
    assert truth == 3 * 2 * LAG_EXACT_UP_TO * keys.shards
    waiting, age = await lag(redis, keys)
    assert waiting == truth and age >= 0
    # one entry per shard counted (a sampler's bound): the rest from the sound counter, the
    # age from the same oldest entry
    await assert_same_age(redis, keys, truth)
    persister.consumer.claim_idle_ms = 0
    await persister.drain()
    assert await lag(redis, keys) == (0, 0.0)
    assert await lag(redis, keys, exact=1) == (0, 0.0)
