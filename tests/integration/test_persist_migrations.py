"""migrate is idempotent and race-free, knows the migrations folded into 0001, and the schema
it makes lists jobs by state through triggers while a job's row changes in place."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Iterator
from typing import Any, cast

import pytest
from asyncpg import CheckViolationError, Record

from jobtier.config import Settings
from jobtier.core.errors import ConfigError
from jobtier.core.keys import Keys
from jobtier.core.model import decode_status
from jobtier.dev.local_postgres import LocalPostgres
from jobtier.persist import db
from jobtier.persist.persister import Persister
from jobtier.persist.pg_reader import PgReader, _by_state, listing_sql
from jobtier.persist.schedule_store import to_schedule
from tests.fixtures.postgres import generic_plan, mixed_workload


@pytest.fixture
def empty_db(pg_server: LocalPostgres) -> Iterator[str]:
    """A database with no schema at all (from template0)."""
    name = f"jt_empty_{uuid.uuid4().hex[:12]}"
    pg_server.psql(f'CREATE DATABASE "{name}" TEMPLATE template0 OWNER "{pg_server.user}"')
    yield name
    pg_server.psql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def test_migrate_is_idempotent_and_two_migrators_do_not_race(
    pg_server: LocalPostgres, empty_db: str
) -> None:
    dsn = pg_server.dsn_for(empty_db)
    first, second = await asyncio.gather(db.migrate(dsn), db.migrate(dsn))
    names = [name for name, _ in db.migrations()]
    assert sorted([first, second]) == [[], names]
    assert await db.migrate(dsn) == []
    conn = await db.connect(dsn)
    try:
        recorded = [r["name"] for r in await conn.fetch("SELECT name FROM schema_migrations")]
    finally:
        await conn.close()
    assert recorded == names


async def test_local_databases_collate_bytewise_and_migrate_names_any_other_collation(
    pg_server: LocalPostgres, pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    # LocalPostgres (jobtier run, the benches, these tests) creates its databases in C
    conn = await db.connect(pg_dsn)
    try:
        row = await conn.fetchrow(
            "SELECT datcollate, datctype FROM pg_database WHERE datname = current_database()"
        )
        assert row is not None
        collate, ctype = row
        # the same order as C.UTF-8 for UTF-8 text: by code point
        words = ["é", "z", "Z", "a", "ä", "€", "1"]
        order = "SELECT array_agg(w ORDER BY w) FROM unnest($1::text[]) w"
        ordered = await conn.fetchval(order, words)
    finally:
        await conn.close()
    assert (collate, ctype) == ("C", "C.UTF-8")
    assert ordered == sorted(words)
    with caplog.at_level("INFO", logger="jobtier.persist"):
        assert await db.migrate(pg_dsn) == []
    assert "event=database_collation" not in caplog.text

    # databases of other collations are migrated as well, and the log says what it costs; one
    # of C.UTF-8 orders the words as C does
    others = {
        "LC_COLLATE 'C.UTF-8' LC_CTYPE 'C.UTF-8'": "collation=C.UTF-8",
        # C in datcollate, but compared through ICU
        "LOCALE_PROVIDER icu ICU_LOCALE 'en-US' LC_COLLATE 'C' LC_CTYPE 'C.UTF-8'": (
            "collation=ICU en-US"
        ),
    }
    for options, named in others.items():
        name = f"jt_collation_{uuid.uuid4().hex[:12]}"
        pg_server.psql(
            f'CREATE DATABASE "{name}" TEMPLATE template0 OWNER "{pg_server.user}" {options}'
        )
        try:
            caplog.clear()
            with caplog.at_level("INFO", logger="jobtier.persist"):
                applied = await db.migrate(pg_server.dsn_for(name))
            assert applied == [n for n, _ in db.migrations()]
            notes = [
                r.getMessage()
                for r in caplog.records
                if "event=database_collation" in r.getMessage()
            ]
            assert len(notes) == 1, notes
            assert named in notes[0] and "LC_COLLATE_C" in notes[0], notes
            if named == "collation=C.UTF-8":
                conn = await db.connect(pg_server.dsn_for(name))
                try:
                    assert await conn.fetchval(order, words) == ordered
                finally:
                    await conn.close()
        finally:
            pg_server.psql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_every_migration_is_numbered_in_order() -> None:
    found = db.migrations()
    assert found, "no migrations"
    # numbers increase; a gap is allowed (branches reserve numbers ahead of their merge)
    numbers = [int(name[:4]) for name, _ in found]
    assert numbers[0] == 1 and numbers == sorted(set(numbers)), numbers
    for name, sql in found:
        assert re.match(r"^[0-9]{4}_[a-z0-9_]+$", name)
        assert "CONCURRENTLY" not in sql.upper()  # migrations run inside a transaction


async def test_migrations_folded_into_0001_are_known(
    pg_server: LocalPostgres, empty_db: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A database migrated before the squash has the names folded into 0001 recorded: known,
    while a name this code does not have is the sign of a newer database."""
    dsn = pg_server.dsn_for(empty_db)
    # 0001 and the migrations added after the squash
    assert await db.migrate(dsn) == [name for name, _ in db.migrations()]
    for recorded, warned in ((db.FOLDED, False), (("0010_from_newer_code",), True)):
        conn = await db.connect(dsn)
        try:
            for name in recorded:
                await conn.execute(db.query("record_migration"), name)
        finally:
            await conn.close()
        caplog.clear()
        with caplog.at_level("INFO", logger="jobtier.persist"):
            assert await db.migrate(dsn) == []
        assert ("event=unknown_migrations names=0010_from_newer_code " in caplog.text) is warned


async def test_a_database_half_way_through_the_folded_migrations_is_refused(
    pg_server: LocalPostgres, empty_db: str
) -> None:
    """Part of the old migrations applied (up to 0005, say): 0001_initial, recorded already,
    would not add the rest, so migrate says what is missing and changes nothing."""
    dsn = pg_server.dsn_for(empty_db)
    await db.migrate(dsn)
    conn = await db.connect(dsn)
    try:
        for name in db.FOLDED[:3]:
            await conn.execute(db.query("record_migration"), name)
    finally:
        await conn.close()
    with pytest.raises(ConfigError, match="missing: 0005_console, 0007_webhooks_results"):
        await db.migrate(dsn)


async def test_jobs_by_state_lists_the_jobs_not_succeeded_and_jobs_indexes_no_state(
    pg_dsn: str,
) -> None:
    """jobs_by_state holds the jobs not succeeded, kept in step by the triggers; no index of
    `jobs` covers a column a transition changes, so its updates are heap-only (HOT)."""
    conn = await db.connect(pg_dsn)
    try:
        insert = (
            "INSERT INTO jobs (id, tenant, type, priority, state, version, attempt, max_attempts,"
            " created_at, updated_at, doc, queue)"
            " VALUES ($1, $2, 'echo', 'normal', $3, 1, 1, 1, now(), now(), '\\x7b7d', $4)"
        )
        states = ["waiting", "scheduled", "queued", "running", "succeeded", "failed", "cancelled"]
        for i, state in enumerate(states):
            await conn.execute(insert, f"J{i}", f"t{i % 2}", state, f"q{i % 3}")
        listed = await conn.fetch("SELECT id, tenant, state, queue FROM jobs_by_state ORDER BY id")
        assert [tuple(r) for r in listed] == [
            (f"J{i}", f"t{i % 2}", s, f"q{i % 3}") for i, s in enumerate(states) if s != "succeeded"
        ]
        indexed = await conn.fetch(
            "SELECT DISTINCT a.attname FROM pg_index i"
            " JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)"
            " WHERE i.indrelid = 'jobs'::regclass"
        )
        assert {r["attname"] for r in indexed} == {"id", "tenant", "type", "queue", "created_at"}
        assert (
            await conn.fetchval(  # no expression or partial index either
                "SELECT count(*) FROM pg_index WHERE indrelid = 'jobs'::regclass"
                " AND (indexprs IS NOT NULL OR indpred IS NOT NULL)"
            )
            == 0
        )
        options = "SELECT reloptions FROM pg_class WHERE oid = 'jobs'::regclass"
        assert await conn.fetchval(options) == ["fillfactor=50"]  # room for the next versions
        async with conn.transaction():
            # a version that changes nothing listed (progress) writes no new version of its row
            seen = "SELECT xmin::text, ctid::text FROM jobs_by_state WHERE id = 'J2'"
            before = tuple(cast(Record, await conn.fetchrow(seen)))
            await conn.execute("UPDATE jobs SET progress = '1', version = 2 WHERE id = 'J2'")
            assert tuple(cast(Record, await conn.fetchrow(seen))) == before
            # the triggers: a running job succeeds, a succeeded one is replayed, one is deleted
            await conn.execute("UPDATE jobs SET state = 'succeeded' WHERE id = 'J3'")
            await conn.execute("UPDATE jobs SET state = 'queued' WHERE id = 'J4'")
            await conn.execute("DELETE FROM jobs WHERE id = 'J5'")
            counted = await conn.fetchrow(
                "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables"
                " WHERE relid = 'jobs'::regclass"
            )
            assert tuple(cast(Record, counted)) == (3, 3)  # every update heap-only
        after = await conn.fetch("SELECT id, state FROM jobs_by_state ORDER BY id")
        assert [tuple(r) for r in after] == [
            ("J0", "waiting"), ("J1", "scheduled"), ("J2", "queued"), ("J4", "queued"),
            ("J6", "cancelled"),
        ]  # fmt: skip
        await conn.execute("TRUNCATE jobs CASCADE")
        assert await conn.fetchval("SELECT count(*) FROM jobs_by_state") == 0
        await conn.execute("TRUNCATE jobs, jobs_by_state CASCADE")  # both at once, as benches do
    finally:
        await conn.close()


async def test_0020_takes_a_filled_database_forward_and_its_listings_use_it(
    pg_server: LocalPostgres, empty_db: str, settings: Settings, redis: Any, redis_as_jobtier: Any
) -> None:
    """A database made by the migrations before 0020 and filled by the persister (jobs in
    every state, their history): migrate adds 0020 (and the later ones) and changes no row; the listings
    still give every job of their filters, a state jobs collect in by type or queue through
    0020's partial indexes, in the generic plans too; and what is written after is found so."""
    dsn = pg_server.dsn_for(empty_db)
    conn = await db.connect(dsn)
    try:
        async with conn.transaction():  # as migrate applies them, stopping before 0020
            await conn.execute(db.query("create_migrations_table"))
            for name, sql in db.migrations():
                if name < "0020":
                    await conn.execute(sql)
                    await conn.execute(db.query("record_migration"), name)
    finally:
        await conn.close()
    keys = Keys(settings.prefix, settings.shards)
    pool = await db.create_pool(dsn, min_size=1, max_size=2)
    try:
        await mixed_workload(redis, keys, n=150, seed=5)
        await Persister(settings.replace(database_url=dsn), redis_as_jobtier, pool, "p1").drain()
        states = {r["state"] for r in await pool.fetch("SELECT DISTINCT state FROM jobs")}
        assert {"failed", "cancelled", "succeeded"} <= states, states
        tables = ("jobs", "jobs_by_state", "job_transitions", "job_dependencies")

        async def rows() -> list[list[tuple[Any, ...]]]:
            return [
                [tuple(r) for r in await pool.fetch(f"SELECT * FROM {t} ORDER BY 1, 2")]
                for t in tables
            ]

        before = await rows()
        assert await db.migrate(dsn) == [n for n, _ in db.migrations() if n >= "0020"]
        assert await rows() == before
        await _every_listing_lists_its_jobs(pool, sorted(states))
        await _the_partial_indexes_serve(pool)
        # written after the migration: in the indexes like the rest
        await mixed_workload(redis, keys, n=60, seed=6)
        await Persister(settings.replace(database_url=dsn), redis_as_jobtier, pool, "p1").drain()
        await _every_listing_lists_its_jobs(pool, sorted(states))
        await _the_partial_indexes_serve(pool)
    finally:
        await pool.close()


async def _every_listing_lists_its_jobs(pool: db.Pool, states: list[str]) -> None:
    """Each state, alone and with a type, a queue, a tenant and a type: every page of the
    console's listing holds exactly the jobs ``jobs`` says, newest first."""
    reader = PgReader(pool)
    jobs = await pool.fetch("SELECT id, tenant, state, type, queue, created_at FROM jobs")
    for state in states:
        for more in ({}, {"type": "mail"}, {"queue": "default"}, {"tenant": "t1", "type": "echo"}):
            where = {"state": state, **more}
            expected = sorted(
                (r for r in jobs if all(r[k] == v for k, v in where.items())),
                key=lambda r: (r["created_at"], r["id"]),
                reverse=True,
            )
            listed = [decode_status(doc).id for doc in await _every_page(reader, where)]
            assert listed == [r["id"] for r in expected], where


async def _the_partial_indexes_serve(pool: db.Pool) -> None:
    """With jobs_by_state's other listing indexes out of the way (dropped in a transaction
    rolled back), the generic plans of a state jobs collect in by type or by queue read 0020's
    indexes, and those of queued jobs cannot (their rows are not in them)."""
    others = ("DROP INDEX jobs_by_state_state_idx", "DROP INDEX jobs_by_state_tenant_idx")
    partial = {"jobs_by_state_type_idx", "jobs_by_state_queue_idx"}
    for filters, index in (
        ({"state": "failed", "type": "mail"}, "jobs_by_state_type_idx"),
        ({"state": "cancelled", "queue": "default"}, "jobs_by_state_queue_idx"),
        ({"state": "queued", "type": "mail"}, None),
    ):
        sql, params = listing_sql(
            _by_state("admin_list_jobs", filters["state"]), 50, "desc", **filters
        )
        async with pool.acquire() as conn:
            plan = await generic_plan(conn, sql, params, ("seqscan", "bitmapscan", "sort"), others)
        used = _index_names(plan)
        if index is None:
            assert not used & partial, used
        else:
            assert index in used, (filters, used)


async def _every_page(reader: PgReader, filters: dict[str, Any]) -> list[bytes]:
    """The documents of every page of the console's listing for ``filters``, in order."""
    docs: list[bytes] = []
    cursor = None
    while True:
        page, cursor = await reader.admin_list_jobs(**filters, limit=7, cursor=cursor)
        docs += [doc for _, doc in page]
        if cursor is None:
            return docs


def _index_names(node: dict[str, Any]) -> set[str]:
    found = {node["Index Name"]} if "Index Name" in node else set()
    return found.union(*(_index_names(child) for child in node.get("Plans", [])))


async def test_0021_takes_an_outbox_forward_and_keys_its_new_jobs_to_their_shards(
    pg_server: LocalPostgres, empty_db: str
) -> None:
    """An outbox filled before 0021 (a job with an idempotency key, in a random shard):
    migrate adds 0021 and changes no row; the same key still names that job; a new key's
    job has its id in the shard keys.py gives the key (where the API keeps it)."""
    dsn = pg_server.dsn_for(empty_db)
    shards = 16
    conn = await db.connect(dsn)
    try:
        async with conn.transaction():
            await conn.execute(db.query("create_migrations_table"))
            for name, sql in db.migrations():
                if name < "0021":
                    await conn.execute(sql)
                    await conn.execute(db.query("record_migration"), name)
        await conn.execute(  # as a relay of then recorded it
            "INSERT INTO jobtier.outbox_config (one, shards, max_payload_bytes, max_depends_on)"
            " VALUES (true, $1, 262144, 10000)",
            shards,
        )
        old = [
            await conn.fetchval("SELECT jobtier.submit('echo', '{}', idempotency_key => $1)", k)
            for k in ("k-a", "k-b", "k-c", "k-d")
        ]
        before = await conn.fetch("SELECT * FROM jobtier.outbox ORDER BY seq")
        assert await db.migrate(dsn) == [n for n, _ in db.migrations() if n >= "0021"]
        columns = ", ".join(before[0].keys())  # the later ones' columns beside them (0023)
        after = await conn.fetch(f"SELECT {columns} FROM jobtier.outbox ORDER BY seq")
        assert after == before
        # 0023: no row was waiting for a worker of its type
        assert (
            await conn.fetchval("SELECT count(*) FROM jobtier.outbox WHERE not_before IS NULL") == 4
        )
        again = await conn.fetchval("SELECT jobtier.submit('echo', '{}', idempotency_key => 'k-a')")
        assert again == old[0]
        keys = Keys("jt", shards)
        for key in ("k-e", "order-1", "tenant/42:x~y"):
            job = await conn.fetchval(
                "SELECT jobtier.submit('echo', '{}', idempotency_key => $1)", key
            )
            assert keys.shard_of(job) == keys.shard_for("default", key), key
    finally:
        await conn.close()


async def test_0025_takes_schedules_forward_without_dates_and_checks_new_ones(
    pg_server: LocalPostgres, empty_db: str
) -> None:
    """Schedules made before 0025: migrate adds their dates' columns and changes no row; each
    reads as a schedule without dates (to_schedule), and a row whose end is not after its
    start is refused."""
    dsn = pg_server.dsn_for(empty_db)
    conn = await db.connect(dsn)
    try:
        async with conn.transaction():
            await conn.execute(db.query("create_migrations_table"))
            for name, sql in db.migrations():
                if name < "0025":
                    await conn.execute(sql)
                    await conn.execute(db.query("record_migration"), name)
        for i, (cron, interval) in enumerate([("0 3 * * *", None), (None, 60)]):
            await conn.execute(
                "INSERT INTO schedules (id, tenant, name, type, payload, cron, interval_seconds,"
                " next_fire_at) VALUES ($1, 'acme', $2, 'echo', '{\"a\": 1}', $3, $4, now())",
                f"01J{i:023d}",
                f"s{i}",
                cron,
                interval,
            )
        before = await conn.fetch("SELECT * FROM schedules ORDER BY id")
        assert await db.migrate(dsn) == [n for n, _ in db.migrations() if n >= "0025"]
        columns = ", ".join(before[0].keys())
        assert await conn.fetch(f"SELECT {columns} FROM schedules ORDER BY id") == before
        rows = await conn.fetch("SELECT * FROM schedules ORDER BY id")
        read = [to_schedule(r) for r in rows]
        assert [(s.name, s.start_at, s.end_at) for s in read] == [
            ("s0", None, None),
            ("s1", None, None),
        ]
        # a later migration's column does not stop this code reading a schedule
        await conn.execute("ALTER TABLE schedules ADD COLUMN from_a_later_migration integer")
        again = [to_schedule(r) for r in await conn.fetch("SELECT * FROM schedules ORDER BY id")]
        assert again == read
        with pytest.raises(CheckViolationError):
            await conn.execute(
                "UPDATE schedules SET start_at = now(), end_at = now() - interval '1 s'"
            )
    finally:
        await conn.close()
