"""The outbox against real Postgres and Redis, where it meets the other paths: rows
jobtier.submit takes that the relay cannot make a job of (each refused alone, its job failed
with the reason, and the rows after it relayed in the same pass: before, any of them failed
the whole pass, again every few seconds, for every tenant); the Postgres fallback's read of
such rows; and an idempotency key used both by SQL and by a submit into Redis."""

from __future__ import annotations

from typing import Any

import asyncpg
import msgspec

from jobtier import outbox
from jobtier.config import Settings
from jobtier.core.model import State
from jobtier.engine.queue import Queue
from jobtier.persist.db import Pool
from jobtier.persist.pg_reader import PgReader
from tests.integration.test_outbox_relay_limits import app, relay_of, row

__all__ = ["app"]  # the fixture, used by name

DEEP = "[" * 1000 + "]" * 1000  # JSON Postgres takes; a decoder recursing through it does not


async def test_rows_the_relay_cannot_read_are_refused_alone(
    app: Any, pg_settings: Settings, pg_pool: Pool, queue: Queue
) -> None:
    relay = await relay_of(pg_settings, pg_pool, queue)
    first = await outbox.submit(app, "echo", {"n": 1})

    async def sql(payload: str, **more: str) -> str:
        args = "".join(f", {name} => '{value}'" for name, value in more.items())
        job_id: str = await app.fetchval(f"SELECT jobtier.submit('echo', $1{args})", payload)
        return job_id

    # a row of before 0022, which refuses it in jobtier.submit now
    await app.execute("ALTER TABLE jobtier.outbox DISABLE TRIGGER outbox_check")
    try:
        endless = await sql("{}", run_at="infinity")
    finally:
        await app.execute("ALTER TABLE jobtier.outbox ENABLE TRIGGER outbox_check")
    deep = await sql(DEEP)
    ancient = await sql('{"n": 2}', run_at="0001-01-01 BC")  # long past: due now
    never_late = await sql('{"n": 3}', run_at="-infinity")  # likewise
    other = await outbox.submit(app, "echo", {"n": 4}, tenant="other")
    assert await relay.drain() == 6
    assert relay.stats.refused == 2 and relay.stats.relayed == 4
    for job_id in (first, ancient, never_late, other):
        assert (await row(pg_pool, job_id))["error"] is None
        assert (await queue.status(job_id)).state is State.QUEUED
    refused = {job_id: (await row(pg_pool, job_id))["error"] for job_id in (endless, deep)}
    assert "run_at is not a time a job can have" in refused[endless], refused
    assert "payload nests arrays and objects deeper than 63 levels" in refused[deep], refused
    assert all(r.startswith("refused by the outbox relay") for r in refused.values())


async def test_a_status_read_of_outbox_rows_is_not_failed_by_one_of_them(
    app: Any, pg_settings: Settings, pg_pool: Pool, queue: Queue
) -> None:
    """The Postgres fallback reads the outbox's rows of every id it is asked at once: a row
    whose run_at no datetime holds (a date BC) read as none rather than failing the read of
    them all; and a row relayed long ago whose job neither Redis nor Postgres holds (lost)
    is not found, rather than submitted for ever."""
    await relay_of(pg_settings, pg_pool, queue)  # records what jobtier.submit reads
    fine = await outbox.submit(app, "echo", {"n": 1})
    ancient: str = await app.fetchval(
        "SELECT jobtier.submit('echo', '{}', run_at => '0001-01-01 BC')"
    )
    found = await PgReader(pg_pool).status_docs([fine, ancient])
    assert set(found) == {fine, ancient}
    assert msgspec.json.decode(found[ancient][1])["run_at"] is None
    # relayed 11 minutes ago, and its job in neither Redis nor Postgres's jobs: not found
    await pg_pool.execute(
        "UPDATE jobtier.outbox SET relayed_at = now() - interval '11 minutes' WHERE id = $1", fine
    )
    assert fine not in await PgReader(pg_pool).status_docs([fine])
    await pg_pool.execute(
        "UPDATE jobtier.outbox SET relayed_at = now() - interval '1 minute' WHERE id = $1", fine
    )
    assert fine in await PgReader(pg_pool).status_docs([fine])  # a moment ago: submitted


async def test_an_idempotency_key_names_one_job_whichever_way_it_was_submitted(
    app: Any, pg_settings: Settings, pg_pool: Pool, queue: Queue
) -> None:
    """A key used over HTTP (here the engine's submit, which the API calls) and then in SQL,
    or the other way round, names one job. Before, a `jobtier.submit` job's key record was
    in a random shard: the relay found the HTTP key one time in the shard count, and an HTTP
    submit never found the SQL one; each made a second job."""
    relay = await relay_of(pg_settings, pg_pool, queue)
    tenant = "acme"
    for i in range(12):  # over the shards: before, most keys' shards differed
        key = f"order-{i}"
        # the key's shard, as SQL now computes it, is the one the API uses
        shard = await app.fetchval(
            "SELECT jobtier.key_shard($1, $2, $3)", tenant, key, queue.keys.shards
        )
        assert shard == queue.keys.shard_for(tenant, key)
        if i % 2:  # HTTP first: the SQL job's row is refused, naming the HTTP job
            http = await queue.submit("echo", idempotency_key=key, tenant=tenant)
            sql = await outbox.submit(app, "echo", None, idempotency_key=key, tenant=tenant)
            await relay.drain()
            error = (await row(pg_pool, sql))["error"]
            assert error is not None and http.job_id in error, (key, error)
        else:  # SQL first: the HTTP submit answers with the SQL job
            sql = await outbox.submit(app, "echo", None, idempotency_key=key, tenant=tenant)
            await relay.drain()
            http = await queue.submit("echo", idempotency_key=key, tenant=tenant)
            assert http.job_id == sql, key


async def test_jobtier_submit_refuses_what_the_relay_would_refuse(
    app: Any, pg_settings: Settings, pg_pool: Pool, queue: Queue
) -> None:
    """What the API refuses in its request, jobtier.submit refuses in the caller's statement
    (since 0022), naming the argument, and writes nothing: before, each was taken, committed
    with the caller's transaction, and refused later by the relay, its job failed."""
    await relay_of(pg_settings, pg_pool, queue)  # it records the bounds jobtier.submit reads
    s = pg_settings
    foreign = queue.keys.new_id().rsplit("-", 1)[0] + f"-{s.shards}"  # one shard past the last
    cases = {
        "run_at => 'infinity'": ("run_at", "run_at is infinity"),
        f"run_at => now() + interval '{s.max_future_seconds + 3600} seconds'": (
            "run_at",
            f"further ahead than {s.max_future_seconds} s",
        ),
        f"delay => {s.max_future_seconds + 3600}": ("run_at", "JOBTIER_MAX_FUTURE_SECONDS"),
        "max_attempts => 101": ("max_attempts", "between 1 and 100"),
        f"depends_on => ARRAY['{foreign}']": ("depends_on", f"has {s.shards} shards"),
    }
    before = await app.fetchval("SELECT count(*) FROM jobtier.outbox")
    for args, (column, words) in cases.items():
        try:
            await app.fetchval(f"SELECT jobtier.submit('echo', '{{}}', {args})")
        except asyncpg.InvalidParameterValueError as exc:
            assert exc.column_name == column and words in str(exc), (args, exc)
        else:
            raise AssertionError(f"jobtier.submit took {args}")
    assert await app.fetchval("SELECT count(*) FROM jobtier.outbox") == before
    # the bounds themselves are taken, as the API takes them
    within = f"now() + interval '{s.max_future_seconds - 3600} seconds'"
    last = queue.keys.new_id().rsplit("-", 1)[0] + f"-{s.shards - 1}"
    await app.fetchval(f"SELECT jobtier.submit('echo', '{{}}', run_at => {within})")
    await app.fetchval("SELECT jobtier.submit('echo', '{}', max_attempts => 100)")
    await app.fetchval(f"SELECT jobtier.submit('echo', '{{}}', depends_on => ARRAY['{last}'])")
    assert await app.fetchval("SELECT count(*) FROM jobtier.outbox") == before + 3
