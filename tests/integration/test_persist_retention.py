"""Postgres does not grow forever: partitioned history, retention, and coalesced progress.

Real Redis and Postgres. Time is not waited for: a pass is given a ``now`` some days ahead,
so that what the test just wrote is old to it.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest

from jobtier.config import Settings
from jobtier.core.errors import ConfigError
from jobtier.core.keys import Keys
from jobtier.persist import db
from jobtier.persist.db import AnyConnection, Connection, Pool, query
from jobtier.persist.persister import Persister
from jobtier.persist.retention import (
    PARTITIONS_AHEAD,
    PRUNE_LOCK,
    _delete_finished,
    partition_name,
    partitions,
    prune,
)
from jobtier.streams.entries import LogEntry, parse_entries
from tests.fixtures.engine import wait_for
from tests.fixtures.postgres import (
    assert_listed_by_state,
    log_entries,
    mixed_workload,
    simple_jobs,
    waiting_for_a_lock_on,
)

TERMINAL = ("succeeded", "failed", "cancelled")


@pytest.fixture
async def conn(pg_dsn: str) -> AsyncIterator[Connection]:
    """A connection of its own, as a prune pass has (it holds a session advisory lock)."""
    c = await db.connect(pg_dsn)
    yield c
    await c.close()


def parsed(raw: list[tuple[int, bytes, dict[bytes, bytes]]]) -> list[LogEntry]:
    return [e for shard, entry_id, fields in raw for e in parse_entries(shard, entry_id, fields)]


async def where_rows_are(pool: Pool) -> dict[str, int]:
    rows = await pool.fetch(
        "SELECT tableoid::regclass::text AS part, count(*) AS n FROM job_transitions GROUP BY 1"
    )
    return {r["part"]: r["n"] for r in rows}


async def gaps(pool: Pool, job_ids: list[str]) -> list[Any]:
    return [tuple(r) for r in await pool.fetch(query("history_gaps"), job_ids)]


def today() -> str:
    return partition_name(datetime.now(UTC).date())


def test_retention_settings_are_checked() -> None:
    for bad in (
        {"JOBTIER_PG_HISTORY_RETENTION_DAYS": "-1"},
        {"JOBTIER_PROGRESS_HISTORY_SECONDS": "-0.5"},
        {"JOBTIER_PRUNE_INTERVAL_SECONDS": "0"},
        # Postgres would forget a dead letter Redis can still replay
        {"JOBTIER_PG_JOB_RETENTION_DAYS": "3", "JOBTIER_DEAD_RETENTION_SECONDS": "604800"},
    ):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            Settings.from_env(bad)
    assert Settings.from_env({"JOBTIER_PG_JOB_RETENTION_DAYS": "0"}).pg_job_retention_days == 0


# --- partitions ---------------------------------------------------------------------------------
async def test_partitions_are_kept_ahead_and_rows_land_in_their_day(
    pg_settings: Settings,
    redis: Any,
    redis_as_jobtier: Any,
    pg_pool: Pool,
    keys: Keys,
    conn: Connection,
) -> None:
    # before any pass, a write still succeeds: the default partition takes it
    job_ids = await simple_jobs(redis, keys, 40)
    await Persister(pg_settings, redis_as_jobtier, pg_pool, "p1").drain()
    assert await where_rows_are(pg_pool) == {"job_transitions_default": 120}

    report = await prune(conn, pg_settings)
    assert report is not None
    now = datetime.now(UTC)
    expected = [partition_name((now + timedelta(days=d)).date()) for d in range(-1, 8)]
    assert report.created == expected and len(expected) == PARTITIONS_AHEAD + 2
    daily = [p for p in await partitions(conn) if not p.is_default]
    assert [p.name for p in daily] == expected
    assert all(p.upper - p.lower == timedelta(days=1) for p in daily if p.upper and p.lower)
    # the day's rows moved out of the default partition into their own, nothing lost
    assert await where_rows_are(pg_pool) == {today(): 120}
    assert await gaps(pg_pool, job_ids) == []

    more = await simple_jobs(redis, keys, 10)
    await Persister(pg_settings, redis_as_jobtier, pg_pool, "p1").drain()
    assert await where_rows_are(pg_pool) == {today(): 150}
    assert await gaps(pg_pool, job_ids + more) == []

    again = await prune(conn, pg_settings)  # idempotent
    assert again is not None and again.created == [] and again.removed == {}


async def test_a_batch_that_races_the_days_partition_is_written_whole(
    pg_settings: Settings,
    redis: Any,
    redis_as_jobtier: Any,
    pg_pool: Pool,
    keys: Keys,
    pg_dsn: str,
    caplog: Any,
) -> None:
    """On a fresh database the persister's first pass attaches today's partition while its
    first batches are written. A batch that began before the attach committed routed its rows
    to the default partition and waited for its lock; once it has it, Postgres refuses them
    there (they belong to the new partition now). That is not the data's fault: the batch is
    written again, whole, and nothing is parked as refused. Nor was Postgres away: the log
    says what happened, not that Postgres is available again."""
    caplog.set_level(logging.INFO, logger="jobtier.persist")
    job_ids = await simple_jobs(redis, keys, 1)  # 3 entries; batches of one
    persister = Persister(
        pg_settings.replace(persist_batch_size=1), redis_as_jobtier, pg_pool, "p1"
    )
    day = datetime.now(UTC).date()
    bounds = [datetime.combine(d, datetime.min.time(), UTC) for d in (day, day + timedelta(1))]
    attach = query("create_history_partition").format(
        partition=f'"{today()}"',
        lower=f"'{bounds[0].isoformat()}'",
        upper=f"'{bounds[1].isoformat()}'",
    )
    other = await db.connect(pg_dsn)
    try:
        attaching = other.transaction()
        await attaching.start()
        await other.execute(attach)  # holds the default partition until it commits
        draining = asyncio.create_task(persister.drain())
        # the batch's insert, routed to the default partition before the attach committed
        # (not any lock wait: one job's batches also wait for each other's row of jobs)
        await wait_for(lambda: waiting_for_a_lock_on(pg_pool, "job_transitions_default"))
        await attaching.commit()
        assert await asyncio.wait_for(draining, 30) == 3
    finally:
        await other.close()
    assert persister.stats.parked == persister.stats.bad_entries == 0
    assert await redis.xlen(keys.log_refused(keys.shard_of(job_ids[0]))) == 0
    assert await where_rows_are(pg_pool) == {today(): 3}
    assert await gaps(pg_pool, job_ids) == []
    assert persister.stats.retries >= 1
    assert "event=partition_attached_meanwhile table=job_transitions_default" in caplog.text
    assert "event=batch_written_again after=" in caplog.text
    assert "event=postgres_available" not in caplog.text
    assert "event=postgres_unavailable" not in caplog.text


async def test_replays_stay_harmless_in_a_partitioned_history(
    pg_settings: Settings,
    redis: Any,
    redis_as_jobtier: Any,
    pg_pool: Pool,
    keys: Keys,
    conn: Connection,
) -> None:
    await prune(conn, pg_settings)
    await mixed_workload(redis, keys, n=60, seed=4)
    entries = parsed(await log_entries(redis, keys))
    persister = Persister(pg_settings, redis_as_jobtier, pg_pool, "p1")
    await persister.drain()
    count = await pg_pool.fetchval("SELECT count(*) FROM job_transitions")
    assert count == len(entries)
    await persister.persist(entries)
    await persister.persist(entries[::-1])
    assert await pg_pool.fetchval("SELECT count(*) FROM job_transitions") == count


# --- retention ----------------------------------------------------------------------------------
async def test_expired_history_and_finished_jobs_go_waiting_and_running_jobs_stay(
    pg_settings: Settings,
    redis: Any,
    redis_as_jobtier: Any,
    pg_pool: Pool,
    keys: Keys,
    conn: Connection,
) -> None:
    await prune(conn, pg_settings)
    await mixed_workload(redis, keys, n=120, seed=9)
    await Persister(pg_settings, redis_as_jobtier, pg_pool, "p1").drain()
    states = dict(cast(list[tuple[str, str]], await pg_pool.fetch("SELECT id, state FROM jobs")))
    unfinished = {i for i, s in states.items() if s not in TERMINAL}
    assert unfinished and len(unfinished) < len(states)  # the workload has both kinds
    assert await pg_pool.fetchval("SELECT count(*) FROM job_results") > 0

    # 29 days on: nothing is old enough yet
    soon = await prune(conn, pg_settings, now=datetime.now(UTC) + timedelta(days=29))
    assert soon is not None and soon.jobs == 0 and soon.removed == {}
    assert await pg_pool.fetchval("SELECT count(*) FROM jobs") == len(states)

    later = datetime.now(UTC) + timedelta(days=40)
    report = await prune(conn, pg_settings, now=later, batch=7)  # many small batches
    assert report is not None
    assert report.jobs == len(states) - len(unfinished)
    assert set(await pg_pool.fetchval("SELECT array_agg(id) FROM jobs")) == unfinished
    assert await pg_pool.fetchval("SELECT count(*) FROM job_results") == 0  # cascaded
    # every day up to 30 days before `later` is dropped, today's with all of the history
    assert today() in report.removed
    assert await pg_pool.fetchval("SELECT count(*) FROM job_transitions") == 0
    names = {p.name for p in await partitions(conn)}
    assert today() not in names and partition_name(later.date()) in names
    assert await pg_pool.fetchval("SELECT to_regclass($1)", today()) is None

    # a finished job is deleted only once it is old: the unfinished ones stay for good
    far = await prune(conn, pg_settings, now=later + timedelta(days=3650))
    assert far is not None and far.jobs == 0
    assert await pg_pool.fetchval("SELECT count(*) FROM jobs") == len(unfinished)


async def test_detach_keeps_the_expired_partition_as_a_table(
    pg_settings: Settings,
    redis: Any,
    redis_as_jobtier: Any,
    pg_pool: Pool,
    keys: Keys,
    conn: Connection,
) -> None:
    settings = pg_settings.replace(pg_history_detach=True)
    await prune(conn, settings)
    await simple_jobs(redis, keys, 20)
    await Persister(settings, redis_as_jobtier, pg_pool, "p1").drain()
    report = await prune(conn, settings, now=datetime.now(UTC) + timedelta(days=40))
    assert report is not None and today() in report.removed
    assert await pg_pool.fetchval("SELECT count(*) FROM job_transitions") == 0
    # out of job_transitions, still there for an operator to archive
    assert await pg_pool.fetchval(f"SELECT count(*) FROM {today()}") == 60
    assert today() not in {p.name for p in await partitions(conn)}


async def test_zero_keeps_everything_and_dry_run_changes_nothing(
    pg_settings: Settings,
    redis: Any,
    redis_as_jobtier: Any,
    pg_pool: Pool,
    keys: Keys,
    conn: Connection,
) -> None:
    await prune(conn, pg_settings)
    await simple_jobs(redis, keys, 30)
    await Persister(pg_settings, redis_as_jobtier, pg_pool, "p1").drain()
    later = datetime.now(UTC) + timedelta(days=40)

    dry = await prune(conn, pg_settings, now=later, dry_run=True)
    assert dry is not None and dry.removed[today()] == 90 and dry.jobs == 30
    existing = {p.name for p in await partitions(conn)}
    assert dry.created and not existing & set(dry.created)
    assert await where_rows_are(pg_pool) == {today(): 90}
    assert await pg_pool.fetchval("SELECT count(*) FROM jobs") == 30
    text = "\n".join(dry.lines())
    assert f"would drop partition {today()} (90 rows)" in text
    assert "would delete 30 that finished before" in text

    forever = pg_settings.replace(pg_history_retention_days=0, pg_job_retention_days=0)
    kept = await prune(conn, forever, now=later)
    assert kept is not None and kept.removed == {} and kept.jobs == 0
    assert "kept forever" in "\n".join(kept.lines())
    assert await where_rows_are(pg_pool) == {today(): 90}
    assert await pg_pool.fetchval("SELECT count(*) FROM jobs") == 30

    done = await prune(conn, pg_settings, now=later)  # does what the dry run said
    assert done is not None and set(done.removed) == set(dry.removed) and done.jobs == dry.jobs


async def test_the_prune_command(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool, keys: Keys, pg_dsn: str
) -> None:
    await simple_jobs(redis, keys, 10)
    await Persister(pg_settings, redis_as_jobtier, pg_pool, "p1").drain()
    env = {"JOBTIER_DATABASE_URL": pg_dsn, "PATH": ""}
    dry = await asyncio.to_thread(jobtier, "prune", "--dry-run", env=env)
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.startswith("dry run: nothing changed\n")
    assert f"would create partition {today()}" in dry.stdout
    assert "finished jobs: would delete 0 that finished before" in dry.stdout
    # partitions() only fetches: the pool serves as a connection
    assert [p.name for p in await partitions(cast(AnyConnection, pg_pool))] == [
        "job_transitions_default"
    ]

    done = await asyncio.to_thread(jobtier, "prune", env=env)
    assert done.returncode == 0 and f"created partition {today()}" in done.stdout, done.stderr
    assert await where_rows_are(pg_pool) == {today(): 30}  # moved out of the default one
    # nothing is old yet: a second run has nothing to do
    again = await asyncio.to_thread(jobtier, "prune", env=env)
    assert again.returncode == 0 and "created" not in again.stdout
    assert "deleted 0 rows of the default partition" in again.stdout


def jobtier(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jobtier.cli.main", *args],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip


async def test_a_pass_does_not_wait_behind_a_long_transaction(
    pg_settings: Settings,
    redis: Any,
    redis_as_jobtier: Any,
    pg_pool: Pool,
    keys: Keys,
    conn: Connection,
    pg_dsn: str,
) -> None:
    """DROP PARTITION needs ACCESS EXCLUSIVE on job_transitions: behind a reader's long
    transaction it gives up after its lock timeout (writes queued behind it go on), reports
    the partition skipped, and the next pass drops it. A job row a writer holds is skipped."""
    await prune(conn, pg_settings)
    job_ids = await simple_jobs(redis, keys, 30)
    await Persister(pg_settings, redis_as_jobtier, pg_pool, "p1").drain()
    later = datetime.now(UTC) + timedelta(days=40)

    other = await db.connect(pg_dsn)
    try:
        reading = other.transaction()
        await reading.start()
        await other.fetchval("SELECT count(*) FROM job_transitions")  # holds ACCESS SHARE
        await other.fetchval("SELECT id FROM jobs WHERE id = $1 FOR UPDATE", job_ids[0])
        report = await prune(conn, pg_settings, now=later, lock_timeout_ms=50)
        assert report is not None
        assert today() in report.skipped and today() not in report.removed
        assert report.jobs == 29  # every finished job but the locked one
        # the persister's writes still go through meanwhile
        more = await simple_jobs(redis, keys, 5)
        await Persister(pg_settings, redis_as_jobtier, pg_pool, "p1").drain()
        assert await gaps(pg_pool, more) == []
        await reading.rollback()
    finally:
        await other.close()

    report = await prune(conn, pg_settings, now=later, lock_timeout_ms=50)
    assert report is not None and today() in report.removed and report.skipped == []
    assert report.jobs == 6


async def test_one_pass_at_a_time(
    pg_settings: Settings,
    redis: Any,
    redis_as_jobtier: Any,
    pg_pool: Pool,
    keys: Keys,
    conn: Connection,
    pg_dsn: str,
) -> None:
    await simple_jobs(redis, keys, 10)
    await Persister(pg_settings, redis_as_jobtier, pg_pool, "p1").drain()
    holder = await db.connect(pg_dsn)
    try:
        await holder.execute("SELECT pg_advisory_lock($1)", PRUNE_LOCK)  # another pass runs
        later = datetime.now(UTC) + timedelta(days=40)
        assert await prune(conn, pg_settings, now=later) is None
        assert await pg_pool.fetchval("SELECT count(*) FROM jobs") == 10
        assert [p.name for p in await partitions(conn)] == ["job_transitions_default"]
    finally:
        await holder.execute("SELECT pg_advisory_unlock($1)", PRUNE_LOCK)
        await holder.close()
    report = await prune(conn, pg_settings, now=datetime.now(UTC) + timedelta(days=40))
    assert report is not None and report.jobs == 10


async def test_the_persister_prunes_on_its_own(
    pg_settings: Settings,
    redis: Any,
    redis_as_jobtier: Any,
    pg_pool: Pool,
    keys: Keys,
    conn: Connection,
) -> None:
    persister = Persister(pg_settings, redis_as_jobtier, pg_pool, "p1")
    task = asyncio.create_task(persister.run())
    try:

        async def ready() -> bool:
            return len(await partitions(conn)) == PARTITIONS_AHEAD + 3  # with the default

        async with asyncio.timeout(20):
            while not await ready():
                await asyncio.sleep(0.02)
    finally:
        persister.stop()
        await asyncio.wait_for(task, 10)
    assert today() in {p.name for p in await partitions(conn)}


class CountingConnection:
    """A connection that counts the statements it is asked to fetch a row for."""

    def __init__(self, conn: Connection) -> None:
        self.conn, self.fetched = conn, 0

    async def fetchrow(self, sql: str, *args: Any) -> Any:
        self.fetched += 1
        return await self.conn.fetchrow(sql, *args)


async def test_finished_jobs_go_in_one_pass_past_old_jobs_that_stay(
    pg_pool: Pool, conn: Connection
) -> None:
    """Jobs created long ago that have not finished (waiting for far dependencies, scheduled
    far ahead, running) or finished lately stay, and each is read once per pass: windows of
    a batch in created_at order (two jobs share each time, some across a window's edge), the
    jobs finished before the cutoff deleted from each."""
    now = datetime.now(UTC)
    cutoff = now - timedelta(days=30)
    rows, old = [], set()
    for i in range(55):  # in created_at order, the kinds interleaved
        created = now - timedelta(days=100) + timedelta(minutes=i // 2)
        kind, n = ("stays", "old", "late")[i % 3], i // 3
        if kind == "stays":
            state, updated = ("waiting", "scheduled", "running")[n % 3], created
        else:
            state = ("succeeded", "failed", "cancelled")[n % 3]
            updated = created + timedelta(hours=1) if kind == "old" else now - timedelta(days=1)
        rows.append((f"J{i:02d}", state, created, updated))
        if kind == "old":
            old.add(f"J{i:02d}")
    await pg_pool.executemany(
        "INSERT INTO jobs (id, tenant, type, priority, state, version, attempt, max_attempts,"
        " created_at, updated_at, doc, queue)"
        " VALUES ($1, 't', 'echo', 'normal', $2, 2, 1, 1, $3, $4, '\\x7b7d', 'default')",
        rows,
    )
    counting = CountingConnection(conn)
    deleted = await _delete_finished(counting, cutoff, 7)  # type: ignore[arg-type]
    assert deleted == len(old) == 18
    assert {r[1] for r in rows if r[0] in old} == {"succeeded", "failed", "cancelled"}
    assert {r[1] for r in rows if r[0] not in old} >= {"waiting", "scheduled", "running"}
    left = {r["id"] for r in await pg_pool.fetch("SELECT id FROM jobs")}
    assert left == {r[0] for r in rows} - old
    assert counting.fetched == 8  # 55 jobs read 7 at a time: the 8th window is short
    await assert_listed_by_state(pg_pool)
    with pytest.raises(ValueError, match="batch"):
        await _delete_finished(conn, cutoff, 0)
