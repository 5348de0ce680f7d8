"""`jobtier migrate` behind a transaction left open on a table it alters: it waits a short
while a try, lets the table's readers and writers through between tries, names who holds the
lock, and gives up after its patience having changed nothing."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from jobtier.dev.local_postgres import LocalPostgres
from jobtier.persist import db
from tests.fixtures.engine import wait_for

LAST = "0024_outbox_cancelled"  # ALTER TABLE jobtier.outbox: an exclusive lock
FROM_LAST = [name for name, _ in db.migrations() if name >= LAST]  # what migrate applies


@pytest.fixture
def before_last(pg_server: LocalPostgres) -> Iterator[str]:
    """A database with every migration before LAST applied, as migrate would have left it."""
    name = f"jt_locks_{uuid.uuid4().hex[:12]}"
    pg_server.psql(f'CREATE DATABASE "{name}" TEMPLATE template0 OWNER "{pg_server.user}"')
    dsn = pg_server.dsn_for(name)

    async def older() -> None:
        conn = await db.connect(dsn)
        try:
            async with conn.transaction():
                await conn.execute(db.query("create_migrations_table"))
                for migration, sql in db.migrations():
                    if migration < LAST:
                        await conn.execute(sql)
                        await conn.execute(db.query("record_migration"), migration)
            await conn.execute(  # as a relay records it when it starts
                "INSERT INTO jobtier.outbox_config (one, shards, max_payload_bytes, "
                "max_depends_on) VALUES (true, 16, 262144, 10000)"
            )
        finally:
            await conn.close()

    asyncio.run(older())
    yield dsn
    pg_server.psql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
async def holder(before_last: str) -> AsyncIterator[db.Connection]:
    """A session that read the outbox in a transaction it leaves open (a caller's, idle after
    its jobtier.submit): it holds a lock the migration's ALTER TABLE waits for."""
    conn = await db.connect(before_last, server_settings={"application_name": "left-open"})
    tx = conn.transaction()
    await tx.start()
    await conn.fetchval("SELECT count(*) FROM jobtier.outbox")
    try:
        yield conn
    finally:
        if not conn.is_closed():
            await conn.close()


async def _applied(dsn: str) -> list[str]:
    conn = await db.connect(dsn)
    try:
        return await db.applied_migrations(conn)
    finally:
        await conn.close()


async def test_migrate_waits_between_tries_letting_the_table_through_then_applies(
    before_last: str, holder: db.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="jobtier.persist")
    named = f"pid {holder.get_server_pid()} (idle in transaction"

    def waiting_lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "migration_waiting" in r.getMessage()]

    # a session reading another table, in a transaction as old, is no blocker of this one
    reader = await db.connect(before_last, server_settings={"application_name": "a-report"})
    await reader.execute("BEGIN; SELECT count(*) FROM jobs")
    migrating = asyncio.create_task(db.migrate(before_last, lock_timeout=0.2, patience=120))
    try:
        # who holds it, by pid, application, and the table (once a look has seen it waiting)
        await wait_for(lambda: any(named in line for line in waiting_lines()), timeout=60)
        line = next(line for line in waiting_lines() if named in line)
        assert "application 'left-open'" in line and "on outbox" in line, line
        assert "a-report" not in caplog.text
        # between tries nothing waits behind the migration: a caller's submit goes through
        # (before, the ALTER TABLE's request queued every statement on the outbox behind it
        # for as long as the holder stayed open; the bound only keeps a broken test from hanging)
        caller = await db.connect(before_last)
        try:
            async with asyncio.timeout(60):
                job = await caller.fetchval("SELECT jobtier.submit('echo', '{}')")
        finally:
            await caller.close()
        assert job
        assert not migrating.done()
        await holder.execute("COMMIT")
        assert await asyncio.wait_for(migrating, 120) == FROM_LAST
    finally:
        migrating.cancel()
        await asyncio.gather(migrating, return_exceptions=True)
        await reader.close()
    assert (await _applied(before_last))[-len(FROM_LAST) :] == FROM_LAST


async def test_migrate_gives_up_after_its_patience_changing_nothing(
    before_last: str, holder: db.Connection
) -> None:
    with pytest.raises(db.MigrationBlocked) as raised:
        await db.migrate(before_last, lock_timeout=0.5, patience=2.0)
    blockers = raised.value.blockers
    assert len(blockers) == 1 and f"pid {holder.get_server_pid()} " in blockers[0], blockers
    assert "nothing was changed" in str(raised.value)
    assert LAST not in await _applied(before_last)
    # the holder's transaction was left alone
    assert await holder.fetchval("SELECT count(*) FROM jobtier.outbox") == 0


async def test_jobtier_migrate_says_who_holds_the_lock_and_exits_1(
    before_last: str, holder: db.Connection
) -> None:
    env = {**os.environ, "JOBTIER_DATABASE_URL": before_last}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "jobtier.cli", "migrate", "--lock-timeout", "0.5",
        "--patience", "2",
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 1, (out, err)
    text = err.decode().strip().splitlines()[-1]  # after the log's event=migration_waiting
    assert text.startswith("jobtier migrate: a lock the migrations need was held"), text
    assert f"pid {holder.get_server_pid()} (idle in transaction" in text, text
    assert "pg_terminate_backend" in text
    assert LAST not in await _applied(before_last)


async def test_a_second_migrator_waits_for_the_first_whatever_lock_timeout_the_database_sets(
    before_last: str, pg_server: LocalPostgres
) -> None:
    """The wait for the migration lock is not a table's: a database whose sessions get a
    lock_timeout of 50 ms (a common production setting) cut it short, and the migrator
    holding the lock was named as the blocker to terminate."""
    name = before_last.rsplit("/", 1)[-1].split("?")[0]
    pg_server.psql(f'ALTER DATABASE "{name}" SET lock_timeout = 50')
    first = await db.connect(before_last)  # as a migrator holding the lock
    await first.execute("SELECT pg_advisory_lock($1)", db.MIGRATION_LOCK)
    migrating = asyncio.create_task(db.migrate(before_last, lock_timeout=0.5, patience=60))
    try:

        async def waited_long() -> bool:  # its wait, as Postgres sees it: 4x the setting
            seconds = await first.fetchval(
                "SELECT max(extract(epoch FROM now() - a.state_change)) FROM pg_locks l"
                " JOIN pg_stat_activity a ON a.pid = l.pid"
                " WHERE l.locktype = 'advisory' AND NOT l.granted"
            )
            return seconds is not None and seconds >= 0.2

        await wait_for(waited_long, timeout=60)
        await first.execute("SELECT pg_advisory_unlock($1)", db.MIGRATION_LOCK)
        assert await asyncio.wait_for(migrating, 60) == FROM_LAST
    finally:
        migrating.cancel()
        await asyncio.gather(migrating, return_exceptions=True)
        await first.close()
