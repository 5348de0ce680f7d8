"""Failures under load: a persister process SIGKILLed mid-stream; Postgres stopped and started."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from typing import Any

import pytest

from jobtier.config import Settings
from jobtier.core.keys import Keys
from jobtier.dev.local_postgres import LocalPostgres
from jobtier.persist.db import Pool, create_pool, migrate
from jobtier.persist.persister import Persister
from jobtier.streams.group import lag
from tests.fixtures.postgres import assert_pg_matches_redis, simple_jobs

pytestmark = pytest.mark.slow

CHILD = r"""
import asyncio, logging, sys
from jobtier.config import Settings
from jobtier.store.redis import connect
from jobtier.persist.db import create_pool
from jobtier.persist.persister import Persister

async def main() -> None:
    redis_url, dsn, name, batch, idle = sys.argv[1:6]
    settings = Settings.from_env(
        {}, redis_url=redis_url, database_url=dsn, shards=4,
        persist_batch_size=int(batch), persist_claim_idle_seconds=float(idle),
    )
    pool = await create_pool(dsn)
    await Persister(settings, connect(settings), pool, name).run()

logging.basicConfig(level=logging.INFO, stream=sys.stderr)
asyncio.run(main())
"""


@pytest.fixture
def spawn(pg_settings: Settings) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start persister processes (killed at the end of the test if still running)."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(name: str, batch: int = 100, claim_idle: float = 30.0) -> subprocess.Popen[bytes]:
        args = [pg_settings.redis_url, pg_settings.database_url, name, str(batch), str(claim_idle)]
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, *args], stdout=subprocess.DEVNULL, start_new_session=True
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 60.0) -> None:
    """Wait for a condition (liveness, not a timing assertion: the bound is generous)."""
    async with asyncio.timeout(timeout):
        while not await check():
            await asyncio.sleep(0.02)


async def persisted(pool: Pool) -> int:
    return int(await pool.fetchval("SELECT count(*) FROM job_transitions"))


async def until_count(
    what: str,
    measure: Callable[[], Awaitable[int]],
    done: Callable[[int], bool],
    persister: subprocess.Popen[bytes],
    stall: float = 60.0,
) -> int:
    """Wait until ``done(measure())`` while ``persister`` works; returns the last measure.

    Liveness, not timing: how long the work takes depends on the machine's load, so there is
    no bound on the whole wait. It fails when the persister process exits, or when the
    measure has not moved for ``stall`` seconds (a persister that is stuck), naming what it
    waited for and where it stopped.
    """
    value = await measure()
    moved_at = time.monotonic()
    while not done(value):
        if persister.poll() is not None:
            raise AssertionError(
                f"{what}: the persister exited ({persister.returncode}) at {value}"
            )
        if time.monotonic() - moved_at > stall:
            raise AssertionError(f"{what}: no progress for {stall:g} s, stuck at {value}")
        await asyncio.sleep(0.02)
        now = await measure()
        if now != value:
            value, moved_at = now, time.monotonic()
    return value


async def test_sigkilled_persister_loses_and_doubles_nothing(
    redis: Any, pg_pool: Pool, keys: Keys, spawn: Callable[..., subprocess.Popen[bytes]]
) -> None:
    job_ids: list[str] = []

    async def produce(rounds: int) -> None:
        for _ in range(rounds):
            job_ids.extend(await simple_jobs(redis, keys, 100))
            await asyncio.sleep(0.005)

    total = 3 * 100 * 60
    producer = asyncio.create_task(produce(60))  # 18,000 transitions
    first = spawn("p1")
    count = partial(persisted, pg_pool)
    await until_count("p1 persisting 1000", count, lambda n: n >= 1000, first)
    first.kill()  # SIGKILL, mid-stream: some entries committed and unacknowledged, some read
    first.wait()

    again = spawn("p1")  # restarted under its name: reads its own pending entries back first
    # (the dead one's last transaction may still commit after this count: more, not fewer)
    target = min(await persisted(pg_pool) + 1000, total)
    await until_count(
        f"p1 restarted persisting up to {target}", count, lambda n: n >= target, again
    )
    again.kill()
    again.wait()
    await producer
    assert 3 * len(job_ids) == total

    # a different persister takes over the dead one's pending entries after the idle timeout
    other = spawn("p2", claim_idle=0.2)
    waiting = partial(_waiting, redis, keys)
    await until_count("p2 draining the logs", waiting, lambda n: n == 0, other)
    other.terminate()
    other.wait()

    await assert_pg_matches_redis(redis, pg_pool, keys, job_ids)
    assert await persisted(pg_pool) == 3 * len(job_ids)


async def _at_least(pool: Pool, n: int) -> bool:
    return await persisted(pool) >= n


async def _drained(redis: Any, keys: Keys) -> bool:
    return await _waiting(redis, keys) == 0


async def _waiting(redis: Any, keys: Keys) -> int:
    """Log entries the persisters have not acknowledged (committed) yet."""
    return (await lag(redis, keys))[0]


async def test_postgres_outage_loses_nothing_and_the_lag_drains(
    pg_settings: Settings,
    redis: Any,
    redis_as_jobtier: Any,
    keys: Keys,
    pg_factory: Callable[[], LocalPostgres],
    caplog: Any,
) -> None:
    caplog.set_level(logging.INFO, logger="jobtier.persist")
    pg = pg_factory()
    await migrate(pg.dsn)
    pool = await create_pool(pg.dsn, max_size=2)
    settings = pg_settings.replace(database_url=pg.dsn, persist_batch_size=200)
    persister = Persister(settings, redis_as_jobtier, pool, "p1")
    task = asyncio.create_task(persister.run())
    job_ids: list[str] = []
    producing = True

    async def produce() -> None:
        while producing:
            job_ids.extend(await simple_jobs(redis, keys, 50))
            await asyncio.sleep(0.01)

    producer = asyncio.create_task(produce())
    try:
        await until(lambda: _at_least(pool, 600))
        await asyncio.to_thread(pg.stop, "fast")
        await until(lambda: _true(persister.stats.retries >= 3))
        waiting = (await lag(redis, keys))[0]
        await until(lambda: _lag_above(redis, keys, waiting + 300))  # the log grows in Redis

        await asyncio.to_thread(pg.start)
        producing = False
        await producer
        await until(lambda: _drained(redis, keys))
    finally:
        producing = False
        persister.stop()
        await asyncio.wait_for(task, 30)
        with contextlib.suppress(Exception):
            await producer
    await assert_pg_matches_redis(redis, pool, keys, job_ids)
    await pool.close()
    assert "event=postgres_unavailable retry_in=" in caplog.text
    assert "event=postgres_available" in caplog.text


async def _true(value: bool) -> bool:
    return value


async def _lag_above(redis: Any, keys: Keys, n: int) -> bool:
    return (await lag(redis, keys))[0] > n
