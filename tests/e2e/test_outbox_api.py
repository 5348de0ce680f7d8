"""The outbox seen through the HTTP API: a job only in the outbox reads as submitted (its
tenant's only), then as Redis has it; a refused one as failed; a rolled back one is a 404."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jobtier import AsyncClient, outbox
from jobtier.api import records
from jobtier.api.records import PostgresExtension
from jobtier.config import Settings
from jobtier.engine.produce import Producer
from jobtier.engine.queue import Queue
from jobtier.persist import outbox as outbox_relay
from jobtier.persist.db import Pool
from jobtier.persist.outbox import OutboxRelay
from tests.fixtures.api import KEYS, ApiServer, StartApi
from tests.fixtures.engine import wait_for
from tests.tasks import registry


@pytest.fixture(autouse=True)
def refused_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusals here are of a type no worker runs: refused at their first look rather
    than after waiting for a worker of it (persist/outbox.py)."""
    monkeypatch.setattr(outbox_relay, "UNKNOWN_TYPE_PATIENCE", 0.0)


@pytest.fixture
async def pg_api(start_api: StartApi, pg_settings: Settings) -> ApiServer:
    return await start_api(PostgresExtension(pg_settings), database_url=pg_settings.database_url)


@pytest.fixture
async def app(pg_dsn: str) -> AsyncIterator[asyncpg.Connection[Any]]:
    conn: asyncpg.Connection[Any] = await asyncpg.connect(pg_dsn)
    yield conn
    await conn.close()


async def test_status_reads_of_outbox_jobs(
    pg_api: ApiServer, app: Any, pg_settings: Settings, pg_pool: Pool, queue: Queue
) -> None:
    relay = OutboxRelay(pg_settings, pg_pool, Producer(queue.store, registry, True, None))
    assert await relay.drain() == 0  # records the shard count
    async with app.transaction():
        job_id = await outbox.submit(app, "echo", {"n": 1}, tenant="acme")
        refused = await outbox.submit(app, "no_such_task", {}, tenant="acme")
    tx = app.transaction()
    await tx.start()
    gone = await outbox.submit(app, "echo", {"n": 2}, tenant="acme")
    await tx.rollback()

    async with pg_api.client() as c, pg_api.client("globex") as globex:
        r = await c.get(f"/v1/jobs/{job_id}")
        assert r.status_code == 200, r.text
        assert (r.json()["state"], r.json()["version"], r.json()["type"]) == (
            "submitted",
            0,
            "echo",
        )
        assert (await globex.get(f"/v1/jobs/{job_id}")).status_code == 404
        assert (await c.get(f"/v1/jobs/{gone}")).status_code == 404
        r = await c.get(f"/v1/jobs/{job_id}/result")  # no result yet, as its status says
        assert r.status_code == 200 and (r.json()["state"], r.json()["result"]) == (
            "submitted",
            None,
        )
        assert (await c.get(f"/v1/jobs/{gone}/result")).status_code == 404
        # why it has not started: the relay has not taken it (not "Redis lost it")
        r = await c.get(f"/v1/jobs/{job_id}/explain")
        assert r.status_code == 200, r.text
        (why,) = r.json()["reasons"]
        assert why["code"] == "not_relayed" and "reconcile" not in why["message"], why
        assert "outbox relay has not made it a job yet" in why["message"], why

        assert await relay.drain() == 2

        async def queued() -> bool:
            return bool((await c.get(f"/v1/jobs/{job_id}")).json()["state"] == "queued")

        await wait_for(queued)
        r = await c.get(f"/v1/jobs/{refused}")
        assert r.status_code == 200 and r.json()["state"] == "failed"
        assert r.json()["error"]["type"] == "Refused"
        assert "no worker runs task 'no_such_task'" in r.json()["error"]["message"]
        # its result reads as its status does (failed, no result), and so `jobtier jobs show`
        r = await c.get(f"/v1/jobs/{refused}/result")
        assert r.status_code == 200, r.text
        assert (r.json()["state"], r.json()["result"]) == ("failed", None)
        assert r.json()["error"]["type"] == "Refused"
        assert (await globex.get(f"/v1/jobs/{refused}/result")).status_code == 404
        async with AsyncClient(pg_api.url, KEYS["acme"]) as client:
            shown = await client.show(refused)
        assert shown.status.state == "failed" and shown.result is None and shown.lines == []


async def test_listings_refuse_the_submitted_state(pg_api: ApiServer) -> None:
    """A job only in the outbox is in no listing: the filter is refused, not always empty."""
    async with pg_api.client() as c:
        r = await c.get("/v1/jobs", params={"state": "submitted"})
        assert r.status_code == 400, r.text
        assert r.json()["field"] == "state"
        assert (await c.get("/v1/jobs", params={"state": "queued"})).status_code == 200


def backlog(text: str) -> tuple[float, float]:
    """(jobtier_outbox_pending_rows, jobtier_outbox_oldest_pending_seconds) of a /metrics."""
    found = {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("jobtier_outbox_")
    }
    return found["jobtier_outbox_pending_rows"], found["jobtier_outbox_oldest_pending_seconds"]


async def test_metrics_show_the_outbox_backlog(
    pg_api: ApiServer, app: Any, pg_settings: Settings, pg_pool: Pool, queue: Queue
) -> None:
    """Jobs submitted with SQL that no relay has taken show on /metrics, with the oldest's
    age (what the JobtierOutboxStuck alert watches); none once the relay has run."""
    relay = OutboxRelay(pg_settings, pg_pool, Producer(queue.store, registry, True, None))
    assert await relay.drain() == 0  # records the shard count
    async with pg_api.client("admin") as admin:

        async def shows(wanted: Any) -> bool:  # (read every 5 s at most, whatever the scrapes)
            rows, age = backlog((await admin.get("/metrics")).text)
            return bool(wanted(rows, age))

        assert await shows(lambda rows, age: (rows, age) == (0, 0))
        async with app.transaction():
            for n in range(3):
                await outbox.submit(app, "echo", {"n": n})
        await wait_for(lambda: shows(lambda rows, age: rows == 3 and age > 0))
        assert await relay.drain() == 3
        await wait_for(lambda: shows(lambda rows, age: (rows, age) == (0, 0)))


async def test_a_cancel_of_a_job_still_in_the_outbox_cancels_its_row(
    pg_api: ApiServer, app: Any, pg_settings: Settings, pg_pool: Pool, queue: Queue
) -> None:
    """A job submitted with SQL and not relayed yet is cancelled in the outbox: the cancel
    answers it ``cancelled`` (the tenant's, or any tenant's through the console), its status
    reads so, the relay never takes it into Redis (a row depending on it is refused, saying
    so), and a second cancel says it has finished. Any
    other change of such a job is a 409 saying it has not run. Once relayed, the cancel goes to
    Redis. A job the relay refused is said to be so (its cancel and its retry would change
    nothing)."""
    relay = OutboxRelay(pg_settings, pg_pool, Producer(queue.store, registry, True, None))
    assert await relay.drain() == 0  # records the shard count
    job_id = await outbox.submit(app, "echo", {"n": 1}, tenant="acme", delay=3600)
    by_console = await outbox.submit(app, "echo", {"n": 2}, tenant="acme")
    relayed = await outbox.submit(app, "echo", {"n": 3}, tenant="acme", delay=3600)
    refused = await outbox.submit(app, "no_such_task", {}, tenant="acme")
    dependent = await outbox.submit(app, "echo", {}, tenant="acme", depends_on=[job_id])
    async with pg_api.client() as c, pg_api.client("globex") as globex:
        # what a row not relayed yet waits for: pending until its relay binds it (was a 404)
        r = await c.get(f"/v1/jobs/{dependent}/dependencies")
        assert r.status_code == 200, r.text
        assert [(d["id"], d["state"]) for d in r.json()["dependencies"]] == [(job_id, "pending")]
        assert (await c.get(f"/v1/jobs/{job_id}/dependencies")).json()["dependencies"] == []
        assert (await globex.get(f"/v1/jobs/{dependent}/dependencies")).status_code == 404
        r = await c.post(f"/v1/jobs/{job_id}/retry")  # not failed, and it has not run
        assert r.status_code == 409 and "retry-after" not in r.headers, r.text
        assert r.json()["type"] == "urn:jobtier:problem:not-relayed-yet", r.text
        assert "has not run" in r.json()["detail"], r.text
        assert (await globex.post(f"/v1/jobs/{job_id}/cancel")).status_code == 404
        r = await c.post(f"/v1/jobs/{job_id}/cancel")
        assert r.status_code == 200, r.text
        assert (r.json()["id"], r.json()["state"]) == (job_id, "cancelled"), r.text
        async with pg_api.client("admin") as admin:  # the console's cancel, any tenant's job
            r = await admin.post(f"/v1/admin/jobs/{by_console}/cancel")
            assert r.status_code == 200 and r.json()["state"] == "cancelled", r.text
        for cancelled in (job_id, by_console):
            r = await c.get(f"/v1/jobs/{cancelled}")
            assert r.status_code == 200 and r.json()["state"] == "cancelled", r.text
            r = await c.post(f"/v1/jobs/{cancelled}/cancel")
            assert r.status_code == 409, r.text
            assert r.json()["type"] == "urn:jobtier:problem:wrong-state", r.text
            assert "has already finished (cancelled)" in r.json()["detail"], r.text
        assert await relay.drain() == 3  # the relayed and the refused rows, and one refused:
        r = await c.get(f"/v1/jobs/{dependent}")  # a row depending on a cancelled one
        assert r.json()["state"] == "failed", r.text
        assert r.json()["error"]["message"] == (
            f"refused by the outbox relay: depends_on names {job_id}, which was cancelled "
            "before its relay"
        ), r.text
        for cancelled in (job_id, by_console):
            assert not await queue.store.redis.exists(queue.store.keys.job(cancelled))
            r = await c.get(f"/v1/jobs/{cancelled}")
            assert r.status_code == 200 and r.json()["state"] == "cancelled", r.text
        r = await c.post(f"/v1/jobs/{relayed}/cancel")  # in Redis now
        assert r.status_code == 200 and r.json()["state"] == "cancelled", r.text
        assert (await queue.status(relayed)).state == "cancelled"
        for action in ("cancel", "retry"):
            r = await c.post(f"/v1/jobs/{refused}/{action}")
            assert r.status_code == 409, r.text
            assert "refused by the outbox relay and never reached Redis" in r.json()["detail"]
            assert r.json()["job"]["state"] == "failed"
        after = await outbox.submit(app, "echo", {}, tenant="acme", depends_on=[refused])
        assert await relay.drain() == 1
        r = await c.get(f"/v1/jobs/{after}")  # a row depending on a refused one
        assert r.json()["error"]["message"] == (
            f"refused by the outbox relay: depends_on names {refused}, which the relay refused"
        ), r.text


async def waits_for_the_row(pg_pool: Pool, cancels: int = 1) -> bool:
    """Whether ``cancels`` cancels wait for an outbox row's lock."""
    waiting = await pg_pool.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        " AND query LIKE '%UPDATE jobtier.outbox%cancelled_at%'"
    )
    return bool(waiting >= cancels)


@pytest.fixture
def patient(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cancel waits for a row's lock as long as a test holding it needs (a loaded machine)."""
    monkeypatch.setattr(records, "CANCEL_LOCK_MS", 600_000)


async def test_a_cancel_never_marks_a_row_a_relay_took(
    pg_api: ApiServer, app: Any, pg_settings: Settings, pg_pool: Pool, queue: Queue,
    patient: None,
) -> None:  # fmt: skip
    """A cancel of a row a relay holds (taken, its Redis submit under way) waits for it, and
    then leaves it as the relay marked it: the cancel goes to Redis, never to the row."""
    relay = OutboxRelay(pg_settings, pg_pool, Producer(queue.store, registry, True, None))
    assert await relay.drain() == 0  # records the shard count
    job_id = await outbox.submit(app, "echo", {"n": 1}, tenant="acme", delay=3600)
    tx = app.transaction()
    await tx.start()
    try:  # as a relay holds the rows it takes (outbox_take: FOR UPDATE)
        await app.execute("SELECT 1 FROM jobtier.outbox WHERE id = $1 FOR UPDATE", job_id)
        async with pg_api.client() as c:
            cancel = asyncio.create_task(c.post(f"/v1/jobs/{job_id}/cancel"))
            await wait_for(lambda: waits_for_the_row(pg_pool))
            await app.execute(
                "UPDATE jobtier.outbox SET relayed_at = clock_timestamp() WHERE id = $1", job_id
            )
            await tx.commit()
            r = await cancel
    finally:
        if app.is_in_transaction():  # neither committed nor rolled back: a failure above
            await tx.rollback()
    # the relay's Redis submit is not made here: Redis has no such job, and the cancel says so
    assert r.status_code == 404, r.text
    row = await app.fetchrow(
        "SELECT relayed_at, cancelled_at FROM jobtier.outbox WHERE id = $1", job_id
    )
    assert row["relayed_at"] is not None and row["cancelled_at"] is None, row


async def test_a_cancel_that_waited_for_a_row_that_ended_says_it_has_ended(
    pg_api: ApiServer, app: Any, pg_settings: Settings, pg_pool: Pool, queue: Queue,
    patient: None,
) -> None:  # fmt: skip
    """A cancel waiting for a row the relay then refuses answers 409 (refused), not 404; of two
    cancels of one row, one cancels it and the other says it has finished."""
    relay = OutboxRelay(pg_settings, pg_pool, Producer(queue.store, registry, True, None))
    assert await relay.drain() == 0  # records the shard count
    refused = await outbox.submit(app, "echo", {"n": 1}, tenant="acme", delay=3600)
    twice = await outbox.submit(app, "echo", {"n": 2}, tenant="acme", delay=3600)
    async with pg_api.client() as c:
        async with app.transaction():  # as a relay refusing it would
            await app.execute("SELECT 1 FROM jobtier.outbox WHERE id = $1 FOR UPDATE", refused)
            cancel = asyncio.create_task(c.post(f"/v1/jobs/{refused}/cancel"))
            await wait_for(lambda: waits_for_the_row(pg_pool))
            await app.execute(
                "UPDATE jobtier.outbox SET relayed_at = clock_timestamp(), error = 'no' "
                "WHERE id = $1",
                refused,
            )
        r = await cancel
        assert r.status_code == 409, r.text
        assert "refused by the outbox relay" in r.json()["detail"], r.text
        async with app.transaction():  # two cancels wait for the same row
            await app.execute("SELECT 1 FROM jobtier.outbox WHERE id = $1 FOR UPDATE", twice)
            both = [asyncio.create_task(c.post(f"/v1/jobs/{twice}/cancel")) for _ in range(2)]
            await wait_for(lambda: waits_for_the_row(pg_pool, 2))
        first, second = sorted([await both[0], await both[1]], key=lambda r: r.status_code)
        assert (first.status_code, first.json()["state"]) == (200, "cancelled"), first.text
        assert second.status_code == 409, second.text
        assert "has already finished (cancelled)" in second.json()["detail"], second.text


async def test_a_cancel_does_not_wait_long_for_a_relay_holding_the_row(
    pg_api: ApiServer, app: Any, pg_settings: Settings, pg_pool: Pool, queue: Queue,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A relay holding the row past the cancel's patience (its Redis frozen, say): the cancel
    answers 503 "send it again", with Retry-After (a passing condition, which clients send
    again), rather than hold an API connection, and changes nothing."""
    monkeypatch.setattr(records, "CANCEL_LOCK_MS", 100)
    relay = OutboxRelay(pg_settings, pg_pool, Producer(queue.store, registry, True, None))
    assert await relay.drain() == 0  # records the shard count
    job_id = await outbox.submit(app, "echo", {"n": 1}, tenant="acme", delay=3600)
    async with pg_api.client() as c, app.transaction():
        await app.execute("SELECT 1 FROM jobtier.outbox WHERE id = $1 FOR UPDATE", job_id)
        r = await c.post(f"/v1/jobs/{job_id}/cancel")
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert r.json()["type"] == "urn:jobtier:problem:unavailable", r.text
    assert "send the cancel again" in r.json()["detail"]
    row = await app.fetchrow(
        "SELECT relayed_at, cancelled_at FROM jobtier.outbox WHERE id = $1", job_id
    )
    assert row["relayed_at"] is None and row["cancelled_at"] is None, row
