"""The numbered migrations produce exactly schema.sql; migrate is idempotent and race-free."""

from __future__ import annotations

import asyncio
import re
import subprocess
import uuid
from collections.abc import Iterator
from typing import cast

import pytest
from asyncpg import Record

from jobtier.dev.local_postgres import SUPERUSER, LocalPostgres
from jobtier.persist import db


@pytest.fixture
def empty_db(pg_server: LocalPostgres) -> Iterator[str]:
    """A database with no schema at all (from template0)."""
    name = f"jt_empty_{uuid.uuid4().hex[:12]}"
    pg_server.psql(f'CREATE DATABASE "{name}" TEMPLATE template0 OWNER "{pg_server.user}"')
    yield name
    pg_server.psql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def schema_dump(server: LocalPostgres, database: str) -> str:
    out = subprocess.run(
        [
            str(server.bin_dir / "pg_dump"), "--schema-only", "--no-owner", "--no-privileges",
            "--exclude-table=schema_migrations", "-h", "127.0.0.1", "-p", str(server.port),
            "-U", SUPERUSER, database,
        ],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    # drop comments, blank lines and the random key of \restrict (newer pg_dump): nothing
    # else differs between two databases with the same schema
    lines = [
        ln
        for ln in out.splitlines()
        if ln.strip() and not ln.startswith(("--", "\\restrict", "\\unrestrict"))
    ]
    return "\n".join(lines)


async def test_migrations_produce_exactly_the_schema(
    pg_server: LocalPostgres, empty_db: str
) -> None:
    # the session's template database was built by migrate(); build another from schema.sql
    conn = await db.connect(pg_server.dsn_for(empty_db))
    try:
        await conn.execute(db.schema_sql())
    finally:
        await conn.close()
    from_schema = schema_dump(pg_server, empty_db)
    from_migrations = schema_dump(pg_server, "jobtier_template")
    assert "CREATE TABLE public.jobs" in from_schema
    assert "CREATE INDEX jobs_by_state_tenant_idx" in from_schema
    assert from_migrations == from_schema


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


async def test_0009_lists_the_jobs_not_succeeded_and_indexes_no_state(
    pg_server: LocalPostgres, empty_db: str
) -> None:
    """A deployment with jobs in every state before 0009: afterwards jobs_by_state holds those
    not succeeded, and no index of `jobs` covers a column a transition changes (so updates
    can be heap-only); from then on the triggers keep it in step."""
    dsn = pg_server.dsn_for(empty_db)
    known = db.migrations()
    (at,) = [i for i, (name, _) in enumerate(known) if name.startswith("0009_")]
    # writers wait from its first statement: no batch commits between the copy and the triggers
    sql = known[at][1]
    assert sql.index("LOCK TABLE jobs IN SHARE ROW EXCLUSIVE MODE;") < sql.index("INSERT INTO")
    conn = await db.connect(dsn)
    try:
        async with conn.transaction():
            for _, sql in known[:at]:
                await conn.execute(sql)
        insert = (
            "INSERT INTO jobs (id, tenant, type, priority, state, version, attempt, max_attempts,"
            " created_at, updated_at, doc, queue)"
            " VALUES ($1, $2, 'echo', 'normal', $3, 1, 1, 1, now(), now(), '\\x7b7d', $4)"
        )
        states = ["waiting", "scheduled", "queued", "running", "succeeded", "failed", "cancelled"]
        for i, state in enumerate(states):
            await conn.execute(insert, f"J{i}", f"t{i % 2}", state, f"q{i % 3}")
        async with conn.transaction():
            await conn.execute(known[at][1])
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
        # a version that changes nothing listed (progress) writes no new version of its row
        seen = "SELECT xmin::text, ctid::text FROM jobs_by_state WHERE id = 'J2'"
        before = tuple(cast(Record, await conn.fetchrow(seen)))
        await conn.execute("UPDATE jobs SET progress = '1', version = 2 WHERE id = 'J2'")
        assert tuple(cast(Record, await conn.fetchrow(seen))) == before
        # the triggers from now on: a running job succeeds, a succeeded one is replayed
        await conn.execute("UPDATE jobs SET state = 'succeeded' WHERE id = 'J3'")
        await conn.execute("UPDATE jobs SET state = 'queued' WHERE id = 'J4'")
        await conn.execute("DELETE FROM jobs WHERE id = 'J5'")
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
