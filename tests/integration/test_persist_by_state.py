"""Listings by state without an index of ``jobs`` over ``state``: a job's later transitions
are heap-only updates of its row, and ``jobs_by_state`` follows every writer of ``jobs``,
whatever order its batches commit in (tests/fixtures/postgres.py's ``assert_listed_by_state``,
which ``assert_pg_matches_redis`` runs, checks it there too)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from jobtier.config import Settings
from jobtier.core.keys import Keys
from jobtier.persist.batch import write_batch
from jobtier.persist.db import Connection, Pool
from jobtier.persist.pg_reader import PgReader
from jobtier.persist.retention import prune
from jobtier.streams.entries import parse_entries
from tests.fixtures.engine import wait_for
from tests.fixtures.postgres import (
    assert_listed_by_state,
    assert_pg_matches_redis,
    log_entries,
    mixed_workload,
    simple_jobs,
)


async def updates_counted(pool: Pool) -> tuple[int, int]:
    """(updates, heap-only updates) of ``jobs`` in this database so far, as Postgres counts
    them (flushed by the writing session when it goes idle)."""
    row = await pool.fetchrow(
        "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'jobs'"
    )
    assert row is not None
    return int(row["n_tup_upd"]), int(row["n_tup_hot_upd"])


async def test_a_jobs_later_transitions_are_heap_only_updates(
    settings: Settings, redis: Any, pg_pool: Pool
) -> None:
    """Jobs written as the persister writes them when it keeps up: the submits in one batch,
    the claims in the next, the completions in a third. The updates of the jobs' rows are
    HOT (no index entry written), and the listings by state see each step."""
    keys = Keys(settings.prefix, settings.shards)
    n = 300
    job_ids = await simple_jobs(redis, keys, n)
    entries = [e for s, i, f in await log_entries(redis, keys) for e in parse_entries(s, i, f)]
    reader = PgReader(pg_pool)
    async with pg_pool.acquire() as conn:
        for version, state in ((1, "queued"), (2, "running"), (3, "succeeded")):
            assert await write_batch(conn, [e for e in entries if e.status.version == version]) == n
            listed = await reader.list_jobs("t1", state=state, limit=500)
            assert {j.id for j in listed[0]} == set(job_ids), state
            await assert_listed_by_state(pg_pool)
        await conn.execute("SELECT pg_stat_force_next_flush()")  # at this session's next idle

    async def all_counted() -> bool:
        return (await updates_counted(pg_pool))[0] >= 2 * n

    await wait_for(all_counted)
    updates, hot = await updates_counted(pg_pool)
    assert updates == 2 * n
    # each batch moved every job of each page on at once: fillfactor 50 leaves each page room
    # for all of its rows' next versions, bar a page a few smaller rows filled past half
    # (567 of 600 here when written); with the table's old indexes, none
    assert hot >= 0.8 * updates, (hot, updates)
    assert await pg_pool.fetchval("SELECT count(*) FROM jobs_by_state") == 0
    await assert_pg_matches_redis(redis, pg_pool, keys, job_ids)


async def test_listings_by_state_follow_every_outcome_and_retention(
    pg_settings: Settings, redis: Any, redis_as_jobtier: Any, pg_pool: Pool
) -> None:
    """A mixed workload (retries, failures, cancels, replays of dead letters, …) persisted:
    each listing by state gives exactly the jobs Postgres holds in that state, every page
    through; then retention deletes the finished jobs and their rows here with them."""
    keys = Keys(pg_settings.prefix, pg_settings.shards)
    job_ids = await mixed_workload(redis, keys, n=150, seed=13)
    from jobtier.persist.persister import Persister

    await Persister(pg_settings, redis_as_jobtier, pg_pool, "p1").drain()
    await assert_pg_matches_redis(redis, pg_pool, keys, job_ids)
    rows = await pg_pool.fetch("SELECT id, tenant, state FROM jobs")
    states = {r["id"]: r["state"] for r in rows}
    assert len(set(states.values())) >= 4, states  # the workload reaches several states
    reader = PgReader(pg_pool)
    for tenant, state in sorted({(r["tenant"], r["state"]) for r in rows}):
        expected = sorted(r["id"] for r in rows if (r["tenant"], r["state"]) == (tenant, state))
        for order in ("desc", "asc"):
            found: list[str] = []
            cursor = None
            while True:
                page, cursor = await reader.list_jobs(
                    tenant, state=state, limit=7, cursor=cursor, order=order
                )
                found += [j.id for j in page]
                if cursor is None:
                    break
            assert sorted(found) == expected, (tenant, state, order)
            assert len(found) == len(set(found))  # no job on two pages
    for state in set(states.values()):  # the console's listing, across tenants
        listed, more = await reader.admin_list_jobs(state=state, limit=500)
        assert more is None
        assert sorted(json.loads(doc)["id"] for _, doc in listed) == sorted(
            j for j, s in states.items() if s == state
        )
    async with pg_pool.acquire() as conn:
        later = datetime.now(UTC) + timedelta(days=pg_settings.pg_job_retention_days + 1)
        # prune is typed for a connection of its own; a pool's held throughout serves alike
        report = await prune(cast(Connection, conn), pg_settings, now=later)
    assert report is not None
    finished = [j for j, s in states.items() if s in ("succeeded", "failed", "cancelled")]
    assert report.jobs == len(finished)
    left = {r["id"] for r in await pg_pool.fetch("SELECT id FROM jobs")}
    assert left == set(states) - set(finished)
    await assert_listed_by_state(pg_pool)


async def test_the_triggers_find_rows_by_key_however_the_table_grew(pg_pool: Pool) -> None:
    """One session (a persister's connection) moves jobs on while jobs_by_state is nearly
    empty, so that PL/pgSQL would keep its plans from then; the table then grows to 20,000
    rows, and 111 jobs succeed: their rows are found by key, not by reading the table (or an
    index of it) whole, as a plan made for the empty table did. Postgres's count of what
    the statement read from the table and its indexes says which. (On a small table,
    reading it whole is the cheaper plan, and Postgres takes it.)"""
    insert = (
        "INSERT INTO jobs (id, tenant, type, priority, state, version, attempt, max_attempts,"
        " created_at, updated_at, doc, queue)"
        " SELECT $1 || g, 't', 'echo', 'normal', 'queued', 1, 0, 1, now(), now(), '\\x7b7d',"
        " 'default' FROM generate_series(1, $2) g"
    )
    move = "UPDATE jobs SET state = $2, version = version + 1 WHERE id LIKE $1 || '%'"
    read = (
        "SELECT sum(pg_stat_get_xact_tuples_returned(oid)) FROM pg_class"
        " WHERE oid = 'jobs_by_state'::regclass"
        " OR oid IN (SELECT indexrelid FROM pg_index WHERE indrelid = 'jobs_by_state'::regclass)"
    )
    async with pg_pool.acquire() as conn:
        await conn.execute("ANALYZE jobs_by_state")  # empty, as just after a migration
        for i in range(8):  # past the 5 calls after which PL/pgSQL may keep a generic plan
            await conn.execute(insert, f"S{i}-", 1)
            await conn.execute(move, f"S{i}-", "running")
            await conn.execute(move, f"S{i}-", "succeeded")
        await conn.execute(insert, "G", 20_000)
        async with conn.transaction():  # the counts are the session's not yet reported ones
            before = int(await conn.fetchval(read))
            await conn.execute(move, "G100", "succeeded")  # G100, G1000..9, G10000..99: 111
            got = int(await conn.fetchval(read)) - before
    assert 111 <= got < 1000, got  # by key (the whole table, or an index, would be 20,000)
    assert await pg_pool.fetchval("SELECT count(*) FROM jobs_by_state") == 20_000 - 111
    await assert_listed_by_state(pg_pool)
