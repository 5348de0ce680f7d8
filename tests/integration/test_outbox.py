"""The transactional outbox, black box: SELECT jobtier.submit(...) in an application's own
transaction on real Postgres, relayed into real Redis, run by a real worker."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import msgspec
import pytest

from jobtier import outbox
from jobtier.config import Settings
from jobtier.core.errors import JobNotFound
from jobtier.core.model import JobStatus, State
from jobtier.dev.local_postgres import LocalPostgres
from jobtier.engine.produce import Producer
from jobtier.engine.queue import Queue
from jobtier.flows.resolver import Resolver
from jobtier.persist import outbox as outbox_relay
from jobtier.persist.db import Pool
from jobtier.persist.outbox import OutboxRelay
from jobtier.persist.persister import Persister
from jobtier.persist.pg_reader import PgReader
from jobtier.store.context import Store
from tests.fixtures.engine import Background, wait_for, worker_for
from tests.tasks import registry

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
async def app(pg_dsn: str) -> AsyncIterator[asyncpg.Connection[Any]]:
    """The application's own connection: plain asyncpg, none of jobtier's codecs."""
    conn: asyncpg.Connection[Any] = await asyncpg.connect(pg_dsn)
    yield conn
    await conn.close()


@pytest.fixture
def relay(pg_settings: Settings, pg_pool: Pool, queue: Queue) -> OutboxRelay:
    """A relay checking types against the test tasks (as the persister's checks them against
    what workers advertise)."""
    return OutboxRelay(pg_settings, pg_pool, Producer(queue.store, registry, True, None))


async def prepared(relay: OutboxRelay) -> OutboxRelay:
    """The relay after its first pass: it has recorded the shard count jobtier.submit needs."""
    assert await relay.drain() == 0
    return relay


async def outbox_rows(pool: Pool) -> list[Any]:
    return await pool.fetch("SELECT id, relayed_at, error FROM jobtier.outbox ORDER BY seq")


async def redis_job_ids(queue: Queue) -> set[str]:
    """Every job hash in Redis, by id (every node of a cluster)."""
    found = set()
    async for key in queue.redis.scan_iter(match=f"{queue.keys.prefix}:*:job:*", count=500):
        found.add((key.decode() if isinstance(key, bytes) else key).rsplit(":", 1)[1])
    return found


async def read_status(pool: Pool, job_id: str) -> tuple[str, JobStatus] | None:
    """What a status read finds in Postgres for an id Redis does not hold."""
    found = await PgReader(pool).status_docs([job_id])
    if job_id not in found:
        return None
    tenant, doc = found[job_id]
    return tenant, msgspec.json.decode(doc, type=JobStatus)


async def test_submit_before_any_relay_ran_says_what_to_start(app: Any, pg_pool: Pool) -> None:
    with pytest.raises(asyncpg.ObjectNotInPrerequisiteStateError) as caught:
        await outbox.submit(app, "echo", {})
    assert "shard count" in str(caught.value) and "persister" in (caught.value.hint or "")
    assert await outbox_rows(pg_pool) == []


async def test_a_rollback_leaves_no_job(
    app: Any, relay: OutboxRelay, pg_pool: Pool, queue: Queue
) -> None:
    await prepared(relay)
    tx = app.transaction()
    await tx.start()
    job_id = await outbox.submit(app, "echo", {"order": 1})
    assert queue.keys.valid_id(job_id)
    await tx.rollback()

    assert await relay.drain() == 0
    assert await outbox_rows(pg_pool) == []
    assert await read_status(pg_pool, job_id) is None
    with pytest.raises(JobNotFound):
        await queue.status(job_id)
    assert await redis_job_ids(queue) == set()


@pytest.mark.contract
async def test_a_committed_job_reads_submitted_then_runs(
    app: Any, relay: OutboxRelay, pg_pool: Pool, queue: Queue, background: Background
) -> None:
    await prepared(relay)
    async with app.transaction():
        await app.execute("CREATE TABLE orders (id int)")  # the application's own write
        await app.execute("INSERT INTO orders VALUES (42)")
        job_id = await outbox.submit(app, "echo", {"order": 42}, priority="high", tenant="acme")

    # committed, not relayed yet: submitted (not 404), to its tenant only
    tenant, status = await read_status(pg_pool, job_id) or ("", None)
    assert tenant == "acme" and status is not None
    assert (status.id, status.state, status.type, status.priority, status.version) == (
        job_id,
        State.SUBMITTED,
        "echo",
        "high",
        0,
    )

    assert await relay.drain() == 1
    assert relay.stats.relayed == 1 and relay.stats.duplicates == 0
    assert (await queue.status(job_id, "acme")).state is State.QUEUED
    background.start(worker_for(queue, registry))

    async def done() -> bool:
        return (await queue.status(job_id)).state is State.SUCCEEDED

    await wait_for(done)
    status, result = await queue.result(job_id, "acme")
    assert result == {"order": 42} and status.priority == "high"
    ((_, relayed_at, error),) = await outbox_rows(pg_pool)
    assert relayed_at is not None and error is None
    assert await redis_job_ids(queue) == {job_id}


CRASHING_RELAY = r"""
import asyncio, os, signal, sys
from jobtier.config import Settings
from jobtier.engine.produce import Producer
from jobtier.persist.db import create_pool
from jobtier.persist.outbox import OutboxRelay
from jobtier.store.context import Store

def die(ids):
    # the crash window: the jobs are in Redis, their rows not yet marked relayed
    print("submitted", *ids, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

async def main() -> None:
    redis_url, cluster, dsn, shards = sys.argv[1:5]
    settings = Settings.from_env(
        {}, redis_url=redis_url, redis_cluster=cluster == "1", database_url=dsn,
        shards=int(shards),
    )
    store = await Store.connect(settings)
    pool = await create_pool(dsn)
    producer = Producer(store, None, False, None)
    await OutboxRelay(settings, pool, producer, after_submit=die).drain()

asyncio.run(main())
"""


@pytest.mark.contract
async def test_a_relay_killed_between_redis_submit_and_outbox_update_makes_one_job(
    app: Any, relay: OutboxRelay, pg_settings: Settings, pg_pool: Pool, queue: Queue
) -> None:
    await prepared(relay)
    async with app.transaction():
        ids = [await outbox.submit(app, "echo", {"n": n}) for n in range(3)]
        ids.append(await outbox.submit(app, "echo", {"n": 3}, idempotency_key="order-3"))

    s = pg_settings
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    args = [s.redis_url, "1" if s.redis_cluster else "0", s.database_url, str(s.shards)]
    child = subprocess.Popen(
        [sys.executable, "-c", CRASHING_RELAY, *args], stdout=subprocess.PIPE, env=env
    )
    try:
        out, _ = child.communicate(timeout=60)
    finally:
        if child.returncode is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL
    assert sorted(out.decode().split()[1:]) == sorted(ids)

    # it died in the window: every job in Redis, no row marked
    assert await redis_job_ids(queue) == set(ids)
    assert [r["relayed_at"] for r in await outbox_rows(pg_pool)] == [None] * 4
    assert await relay.pending() == 4

    # the next pass submits them again: Redis answers with the jobs it has
    assert await relay.drain() == 4
    assert relay.stats.relayed == 4 and relay.stats.duplicates == 4
    assert await relay.pending() == 0
    assert await redis_job_ids(queue) == set(ids)
    stats = await worker_for(queue, registry, burst=True).run()
    assert stats.succeeded == 4
    for n, job_id in enumerate(ids):
        status, result = await queue.result(job_id)
        assert status.state is State.SUCCEEDED and status.attempt == 1 and result == {"n": n}


async def test_what_only_the_relay_can_check_fails_the_job_with_the_reason(
    app: Any,
    relay: OutboxRelay,
    pg_settings: Settings,
    pg_pool: Pool,
    queue: Queue,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(outbox_relay, "UNKNOWN_TYPE_PATIENCE", 0.0)  # waits for no worker
    await prepared(relay)
    async with app.transaction():
        unknown = await outbox.submit(app, "no_such_task", {})
        large = await outbox.submit(app, "echo", {"text": "x" * 100})
        fine = await outbox.submit(app, "echo", {})
    # the limit lowered after the rows were written (jobtier.submit checked the old one)
    small = pg_settings.replace(max_payload_bytes=64)
    producer = Producer(Store(small, queue.redis), registry, True, None)
    relay = OutboxRelay(small, pg_pool, producer)

    assert await relay.drain() == 3
    assert relay.stats.refused == 2 and relay.stats.relayed == 1
    assert await redis_job_ids(queue) == {fine}
    for job_id, words in (
        (unknown, "no worker runs task 'no_such_task'"),
        (unknown, "s for one)"),
        (large, "payload"),
    ):
        _, status = await read_status(pg_pool, job_id) or ("", None)
        assert status is not None and status.state is State.FAILED and status.error is not None
        assert status.error.type == "Refused"
        assert "refused by the outbox relay" in status.error.message
        assert words in status.error.message
    # relayed, and no persister has written its row yet: a read that missed it in Redis (it
    # asked a moment before the relay) finds it submitted, as it was, rather than not found
    _, relayed = await read_status(pg_pool, fine) or ("", None)
    assert relayed is not None and relayed.state is State.SUBMITTED and relayed.version == 0


async def advertise(queue: Queue, *names: str) -> None:
    """Put these test tasks in the catalogue, as a worker of them would."""
    ads: dict[Any, Any] = {
        t.name: msgspec.json.encode(t.ad("tests")) for t in registry if t.name in names
    }
    assert set(ads) == set(names)
    await queue.redis.hset(queue.keys.tasks(), mapping=ads)


async def relayed_once(relay: OutboxRelay, job_ids: set[str], queue: Queue) -> None:
    """Drain until Redis holds ``job_ids`` (the catalogue looks again at most once a
    second)."""

    async def there() -> bool:
        await relay.drain()
        return job_ids <= await redis_job_ids(queue)

    await wait_for(there, timeout=30)


async def waiting_rows(pool: Pool) -> dict[str, float]:
    """id -> seconds from its submit to when it is read again, of the rows left out."""
    rows = await pool.fetch(
        "SELECT id, extract(epoch FROM not_before - created_at)::float8 AS s"
        " FROM jobtier.outbox WHERE relayed_at IS NULL AND not_before IS NOT NULL"
    )
    return {r["id"]: r["s"] for r in rows}


async def test_a_job_of_a_type_no_worker_advertised_yet_waits_for_one(
    app: Any,
    pg_settings: Settings,
    pg_pool: Pool,
    queue: Queue,
    redis_as_jobtier: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A producer deployed before its task's first worker: the relay (checking the workers'
    catalogue, as a persister's does) leaves the row out of its reads rather than refusing
    it, relays the rows after it meanwhile, and relays it once a worker has advertised the
    type: a relay started afterwards too. Its caller's transaction committed long before: a
    refusal would have lost the job."""
    caplog.set_level(logging.INFO, logger="jobtier.persist")
    await advertise(queue, "flaky")
    relay = OutboxRelay.of_persister(pg_settings, redis_as_jobtier, pg_pool)
    await prepared(relay)
    early = await outbox.submit(app, "echo", {"early": True})
    after = await outbox.submit(app, "flaky", {})
    assert await relay.drain() == 1  # the row after it
    assert after in await redis_job_ids(queue) and early not in await redis_job_ids(queue)
    assert await waiting_rows(pg_pool) == {early: outbox_relay.UNKNOWN_TYPE_PATIENCE}
    assert await relay.drain() == 0 and relay.taken == 0  # left out of the reads
    assert relay.stats.refused == 0 and relay.stats.deferred == 1
    said = [r.getMessage() for r in caplog.records if "event=outbox_job_waiting" in r.getMessage()]
    assert len(said) == 1 and early in said[0] and "type=echo" in said[0], said

    # a relay started now (a persister restarted) knows of it from Postgres
    relay = OutboxRelay.of_persister(pg_settings, redis_as_jobtier, pg_pool)
    await prepared(relay)
    await advertise(queue, "echo")
    await relayed_once(relay, {early}, queue)
    assert relay.stats.relayed == 1 and relay.stats.refused == 0
    assert await relay.pending() == 0 and await waiting_rows(pg_pool) == {}


async def test_a_type_whose_rows_all_left_is_no_longer_looked_for(
    app: Any,
    pg_settings: Settings,
    pg_pool: Pool,
    queue: Queue,
    redis_as_jobtier: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A row of a type no worker ever advertised (a typo) is refused once its patience runs
    out; the relay stops asking the catalogue for that type after its next prune (before,
    it asked at every pass for as long as it ran: a reload of the whole catalogue at each
    pass past the catalogue's miss interval). A row left out for a row it depends on is not
    waiting for a worker: a prune neither looks its type up nor releases it early."""
    await advertise(queue, "flaky")
    relay = OutboxRelay.of_persister(pg_settings, redis_as_jobtier, pg_pool)
    await prepared(relay)
    asked: list[set[str]] = []
    ensure_known = relay.producer.ensure_known

    async def noting(types: Any) -> None:
        asked.append(set(types))
        await ensure_known(types)

    monkeypatch.setattr(relay.producer, "ensure_known", noting)
    typo = await outbox.submit(app, "ecoh", {})
    waiting = await outbox.submit(app, "echo", {})  # for a worker of its type
    dependent = await outbox.submit(app, "flaky", {}, depends_on=[waiting])  # for that row
    assert await relay.drain() == 0 and relay.stats.deferred == 3
    # looked at again in a while (not a fraction of a second: within the test)
    await pg_pool.execute(
        "UPDATE jobtier.outbox SET not_before = now() + interval '1 hour' WHERE id = $1",
        dependent,
    )
    # its patience over: as if submitted long ago
    await pg_pool.execute(
        "UPDATE jobtier.outbox SET created_at = created_at - make_interval(secs => $2),"
        " not_before = now() WHERE id = $1",
        typo,
        outbox_relay.UNKNOWN_TYPE_PATIENCE + 1,
    )
    assert await relay.drain() == 1 and relay.stats.refused == 1
    asked.clear()
    await relay.drain()
    assert any("ecoh" in types for types in asked)  # still looked for: nothing said it is gone

    await relay.prune()
    asked.clear()
    deferred = relay.stats.deferred
    await relay.drain()
    assert not any("ecoh" in types for types in asked), asked
    assert not any("flaky" in types for types in asked), asked
    assert relay.stats.deferred == deferred  # the dependent row was not taken again
    # a row of the type waiting again is looked for again
    again = await outbox.submit(app, "ecoh", {})
    await relay.drain()
    await relay.prune()
    asked.clear()
    await relay.drain()
    assert any("ecoh" in types for types in asked) and again in await waiting_rows(pg_pool)


async def test_rows_left_out_do_not_hold_back_the_rows_after_them(
    app: Any, pg_settings: Settings, pg_pool: Pool, queue: Queue, redis_as_jobtier: Any
) -> None:
    """Batches of two: the first pass takes two rows that wait for a worker, the next the
    third and a row that can go, in the same drain; a row depending on a waiting row is
    left out for a second at a time, and goes once that row has."""
    await advertise(queue, "flaky")
    relay = OutboxRelay.of_persister(pg_settings, redis_as_jobtier, pg_pool)
    relay.batch_size = 2
    await prepared(relay)
    waiting = [await outbox.submit(app, "echo", {"n": n}) for n in range(3)]
    after = await outbox.submit(app, "flaky", {})
    dependent = await outbox.submit(app, "flaky", {}, depends_on=[waiting[0]])
    assert await relay.drain() == 1
    assert await redis_job_ids(queue) == {after}
    left = await waiting_rows(pg_pool)
    assert set(left) == {*waiting, dependent}
    assert left[dependent] < outbox_relay.UNKNOWN_TYPE_PATIENCE / 2  # looked at again soon

    await advertise(queue, "echo")
    await relayed_once(relay, {*waiting, dependent}, queue)
    assert relay.stats.refused == 0 and await relay.pending() == 0


async def test_arguments_sql_can_check_fail_the_callers_transaction(
    app: Any, relay: OutboxRelay, pg_pool: Pool
) -> None:
    await prepared(relay)
    bad: list[tuple[dict[str, Any], str]] = [
        ({"priority": "urgent"}, "priority"),
        ({"queue": "no spaces"}, "queue"),
        ({"tenant": "a:b"}, "tenant"),
        ({"delay": -1}, "delay"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"depends_on": ["nope"]}, "depends_on"),
        ({"idempotency_key": "has space"}, "idempotency_key"),
    ]
    for options, name in bad:
        with pytest.raises(asyncpg.InvalidParameterValueError) as caught:
            async with app.transaction():
                await outbox.submit(app, "echo", {}, **options)
        assert name in str(caught.value) and caught.value.column_name == name
    with pytest.raises(asyncpg.InvalidParameterValueError, match="type"):
        await outbox.submit(app, "bad type!", {})
    assert await outbox_rows(pg_pool) == []


async def test_an_idempotency_key_names_one_job(
    app: Any, relay: OutboxRelay, pg_pool: Pool, queue: Queue
) -> None:
    await prepared(relay)
    first = await outbox.submit(app, "echo", {"a": 1}, idempotency_key="k1")
    assert await relay.drain() == 1
    again = await outbox.submit(app, "echo", {"a": 1}, idempotency_key="k1")  # relayed already
    assert again == first and await relay.drain() == 0
    with pytest.raises(asyncpg.UniqueViolationError, match="idempotency_key"):
        await outbox.submit(app, "echo", {"a": 2}, idempotency_key="k1")
    other = await outbox.submit(app, "echo", {"a": 1}, idempotency_key="k1", tenant="t2")
    assert other != first and await relay.drain() == 1
    assert await redis_job_ids(queue) == {first, other}


async def test_a_job_may_wait_for_one_submitted_in_the_same_transaction(
    app: Any, relay: OutboxRelay, queue: Queue
) -> None:
    await prepared(relay)
    async with app.transaction():
        parent = await outbox.submit(app, "echo", {"step": 1})
        child = await outbox.submit(app, "echo", {"step": 2}, depends_on=parent)  # (one id)
    assert await relay.drain() == 2 and relay.stats.refused == 0
    assert (await queue.status(child)).state is State.WAITING
    assert (await worker_for(queue, registry, burst=True).run()).succeeded == 1
    await Resolver(queue.store).drain()  # the parent's success hands the child on
    assert (await worker_for(queue, registry, burst=True).run()).succeeded == 1
    status, result = await queue.result(child)
    assert status.state is State.SUCCEEDED and result == {"step": 2}


async def test_a_delay_counts_from_the_submit(app: Any, relay: OutboxRelay, queue: Queue) -> None:
    await prepared(relay)
    job_id = await outbox.submit(app, "echo", {}, delay=600)
    assert await relay.drain() == 1
    status = await queue.status(job_id)
    assert status.state is State.SCHEDULED and status.run_at is not None
    created = await app.fetchval("SELECT created_at FROM jobtier.outbox WHERE id = $1", job_id)
    run_at = datetime.fromisoformat(status.run_at)
    assert 599 <= (run_at - created).total_seconds() <= 601


async def test_the_psycopg_and_sqlalchemy_helpers(
    pg_dsn: str, relay: OutboxRelay, pg_pool: Pool
) -> None:
    # the extras' libraries are dev dependencies: missing, the test fails rather than skips
    import psycopg
    import sqlalchemy
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
    from sqlalchemy.orm import Session

    await prepared(relay)
    kept = []
    async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
        kept.append(await outbox.submit(conn, "echo", {"via": "psycopg async"}))
        await conn.commit()
        await outbox.submit(conn, "echo", {"via": "rolled back"})
        await conn.rollback()
    with psycopg.Connection.connect(pg_dsn) as sync_conn:
        kept.append(outbox.submit_sync(sync_conn, "echo", {"via": "psycopg"}, priority="low"))
        sync_conn.commit()

    url = pg_dsn.replace("postgresql://", "postgresql+{}://", 1)
    engine = create_async_engine(url.format("asyncpg"))
    try:
        async with AsyncSession(engine) as session:
            kept.append(await outbox.submit(session, "echo", {"via": "sqlalchemy async"}))
            await session.commit()
            await outbox.submit(session, "echo", {"via": "rolled back"})
            await session.rollback()
    finally:
        await engine.dispose()
    sync_engine = sqlalchemy.create_engine(url.format("psycopg"))
    try:
        with Session(sync_engine) as sync_session:
            kept.append(outbox.submit_sync(sync_session, "echo", {"via": "sqlalchemy"}))
            sync_session.commit()
    finally:
        sync_engine.dispose()

    assert [r["id"] for r in await outbox_rows(pg_pool)] == kept
    assert await relay.drain() == 4
    with pytest.raises(TypeError, match="asyncpg connection"):
        await outbox.submit(object(), "echo", {})
    # an option it does not take is named with the call, before anything is sent
    with pytest.raises(TypeError, match=r"outbox.submit\(\) got .* 'bogus'; it takes queue"):
        await outbox.submit(object(), "echo", {}, bogus=1)
    with pytest.raises(TypeError, match=r"outbox.submit_sync\(\) got .* 'prio'"):
        outbox.submit_sync(object(), "echo", {}, prio="high")


async def test_the_persister_runs_the_relay_and_it_can_be_turned_off(
    app: Any,
    pg_settings: Settings,
    pg_pool: Pool,
    redis: Any,
    redis_as_jobtier: Any,
    queue: Queue,
    background: Background,
) -> None:
    assert (
        Persister(pg_settings.replace(outbox_relay=False), redis_as_jobtier, pg_pool, "p0").relay
        is None
    )

    background.start(worker_for(queue, registry))  # advertises the tasks the relay checks
    persister = Persister(
        pg_settings.replace(outbox_poll_seconds=60.0), redis_as_jobtier, pg_pool, "p1"
    )
    background.start(persister)

    async def shards_recorded() -> bool:
        return bool(await pg_pool.fetchval("SELECT count(*) FROM jobtier.outbox_config") == 1)

    await wait_for(shards_recorded)
    async with app.transaction():
        job_id = await outbox.submit(app, "echo", {"via": "persister"})

    # relayed at the commit's notification (the poll is a minute), run, then written behind
    async def persisted() -> bool:
        found = await read_status(pg_pool, job_id)
        return found is not None and found[1].state is State.SUCCEEDED

    await wait_for(persisted)
    assert persister.relay is not None and persister.relay.stats.relayed == 1
    assert persister.metrics().counters["outbox_relayed_total"] == {"": 1}


async def test_jobtier_keeps_its_tables_out_of_the_schema_named_like_its_role(
    pg_pool: Pool, app: Any
) -> None:
    # the tests' role is jobtier, as in the default DSN: "$user" would be the schema jobtier,
    # first in the default search_path; 0010 gave the role a path without it
    assert await app.fetchval("SELECT current_user") == "jobtier"
    assert await app.fetchval("SELECT current_schema()") == "public"
    async with pg_pool.acquire() as conn:
        await conn.execute("CREATE TABLE made_by_jobtier (id int)")
    async with pg_pool.acquire() as conn:  # after the pool's RESET ALL too
        assert await conn.fetchval("SELECT current_schema()") == "public"
    assert await app.fetchval("SELECT to_regclass('public.made_by_jobtier')") is not None


async def test_an_application_database_submits_through_postgres_fdw(
    pg_server: LocalPostgres, pg_dsn: str, relay: OutboxRelay, pg_pool: Pool
) -> None:
    """The application's own database reaches jobtier's through postgres_fdw: an INSERT into
    the imported view jobtier.submissions is a jobtier.submit call in jobtier's database,
    committed or rolled back with the application's transaction."""
    await prepared(relay)
    where = urlsplit(pg_dsn)
    app_db = f"jt_app_{uuid.uuid4().hex[:12]}"
    pg_server.psql(f'CREATE DATABASE "{app_db}" OWNER "{pg_server.user}"')
    try:
        # what a DBA sets up once (as superuser): the wrapper, the server, the mapping
        user = pg_server.user
        pg_server.psql(
            f"""
            CREATE EXTENSION postgres_fdw;
            CREATE SERVER jobtier_db FOREIGN DATA WRAPPER postgres_fdw
                OPTIONS (host '{where.hostname}', port '{where.port}',
                         dbname '{where.path.lstrip("/")}');
            GRANT USAGE ON FOREIGN SERVER jobtier_db TO "{user}";
            CREATE USER MAPPING FOR "{user}" SERVER jobtier_db
                OPTIONS (user '{user}', password_required 'false');
            """,
            database=app_db,
        )
        conn = await asyncpg.connect(pg_server.dsn_for(app_db))
        try:
            await conn.execute(
                """
                CREATE SCHEMA jobs_remote;
                IMPORT FOREIGN SCHEMA jobtier LIMIT TO (submissions)
                    FROM SERVER jobtier_db INTO jobs_remote;
                CREATE TABLE orders (id int);
                """
            )
            insert = (
                "INSERT INTO jobs_remote.submissions (type, payload, priority) "
                "VALUES ('echo', $1::json, 'high') RETURNING id"
            )
            tx = conn.transaction()
            await tx.start()
            await conn.execute("INSERT INTO orders VALUES (1)")
            await conn.fetchval(insert, '{"order": 1}')
            await tx.rollback()
            assert await outbox_rows(pg_pool) == []

            async with conn.transaction():
                await conn.execute("INSERT INTO orders VALUES (2)")
                job_id = await conn.fetchval(insert, '{"order": 2}')
        finally:
            await conn.close()
    finally:
        pg_server.psql(f'DROP DATABASE IF EXISTS "{app_db}" WITH (FORCE)')
    assert [r["id"] for r in await outbox_rows(pg_pool)] == [job_id]
    _, status = await read_status(pg_pool, job_id) or ("", None)
    assert status is not None and status.state is State.SUBMITTED and status.priority == "high"
    assert await relay.drain() == 1


async def test_a_session_may_leave_the_notification_out(
    app: Any, relay: OutboxRelay, pg_dsn: str
) -> None:
    await prepared(relay)
    heard: list[str] = []
    second = asyncio.Event()
    listener = await asyncpg.connect(pg_dsn)

    def notified(*_: Any) -> None:
        heard.append("n")
        second.set()

    try:
        await listener.add_listener("jobtier_outbox", notified)
        await app.execute("SET jobtier.notify = off")
        quiet = await outbox.submit(app, "echo", {})
        await app.execute("RESET jobtier.notify")
        loud = await outbox.submit(app, "echo", {})
        async with asyncio.timeout(10):
            await second.wait()
        # both commits came before this query: a notification of the quiet one would have
        # been delivered before its answer
        assert await listener.fetchval("SELECT 1") == 1
        assert heard == ["n"]
    finally:
        await listener.close()
    assert quiet != loud and await relay.drain() == 2


async def test_relayed_rows_are_pruned_after_the_idempotency_ttl_refused_ones_kept(
    app: Any, pg_settings: Settings, pg_pool: Pool, queue: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(outbox_relay, "UNKNOWN_TYPE_PATIENCE", 0.0)  # refused at once
    settings = pg_settings.replace(idempotency_ttl_seconds=0, pg_job_retention_days=30)
    relay = await prepared(
        OutboxRelay(settings, pg_pool, Producer(queue.store, registry, True, None))
    )
    relayed = await outbox.submit(app, "echo", {}, idempotency_key="k")
    refused = await outbox.submit(app, "no_such_task", {})
    assert await relay.drain() == 2
    assert await relay.prune() == 1
    assert [r["id"] for r in await outbox_rows(pg_pool)] == [refused]
    # its key forgotten with its row, as Redis forgets it after the TTL
    assert await outbox.submit(app, "echo", {}, idempotency_key="k") != relayed


async def test_two_relays_share_the_rows_without_submitting_one_twice(
    app: Any, pg_settings: Settings, pg_pool: Pool, queue: Queue
) -> None:
    def relay() -> OutboxRelay:
        producer = Producer(queue.store, registry, True, None)
        return OutboxRelay(pg_settings, pg_pool, producer, batch_size=20)

    first, second = relay(), relay()
    await prepared(first)
    async with app.transaction():
        ids = await app.fetchval(
            "SELECT array_agg(jobtier.submit('echo', json_build_object('n', n)))"
            " FROM generate_series(1, 200) n"
        )
    counts = await asyncio.gather(first.drain(), second.drain())
    assert sum(counts) == 200
    assert first.stats.relayed + second.stats.relayed == 200
    assert first.stats.duplicates + second.stats.duplicates == 0
    assert await redis_job_ids(queue) == set(ids)
