"""Recurring schedules through the API (Postgres + Redis) and a running scheduler."""

from __future__ import annotations

import asyncio

import pytest

from jobtier.api.records import PostgresExtension
from jobtier.config import Settings
from jobtier.engine.cron import now_ms
from jobtier.engine.queue import Queue
from jobtier.persist.db import Pool
from jobtier.persist.schedule_store import ScheduleStore
from jobtier.scheduler import Scheduler
from tests.fixtures.api import ApiServer, StartApi
from tests.fixtures.engine import Background, wait_for


@pytest.fixture
async def pg_api(start_api: StartApi, pg_settings: Settings) -> ApiServer:
    return await start_api(PostgresExtension(pg_settings), database_url=pg_settings.database_url)


NIGHTLY = {
    "name": "nightly",
    "type": "echo",
    "payload": {"report": True},
    "cron": "0 3 * * *",
    "timezone": "Europe/Paris",
}


async def test_crud_and_isolation(pg_api: ApiServer) -> None:
    async with pg_api.client() as c, pg_api.client("globex") as globex:
        r = await c.post("/v1/schedules", json=NIGHTLY)
        assert r.status_code == 201, r.text
        made = r.json()
        assert made["next_fire_at"] and made["misfire"] == "fire_once" and not made["paused"]
        assert (await c.post("/v1/schedules", json=NIGHTLY)).status_code == 409  # same name
        assert (await globex.post("/v1/schedules", json=NIGHTLY)).status_code == 201  # other tenant
        sid = made["id"]
        assert (await c.get(f"/v1/schedules/{sid}")).json()["name"] == "nightly"
        assert (await globex.get(f"/v1/schedules/{sid}")).status_code == 404
        assert (await globex.delete(f"/v1/schedules/{sid}")).status_code == 404
        listed = (await c.get("/v1/schedules")).json()
        assert [s["id"] for s in listed["schedules"]] == [sid]
        paused = (await c.post(f"/v1/schedules/{sid}/pause")).json()
        assert paused["paused"] and paused["next_fire_at"] is None
        resumed = (await c.post(f"/v1/schedules/{sid}/resume")).json()
        assert not resumed["paused"] and resumed["next_fire_at"]
        assert (await c.delete(f"/v1/schedules/{sid}")).status_code == 204
        assert (await c.get(f"/v1/schedules/{sid}")).status_code == 404


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({**NIGHTLY, "cron": "0 25 * * *"}, "cron"),
        ({**NIGHTLY, "timezone": "Nowhere/Land"}, "timezone"),
        ({"name": "fast", "type": "echo", "interval": 0}, "interval"),
        ({"name": "both", "type": "echo", "interval": 5, "cron": "* * * * *"}, "cron"),
        ({"name": "neither", "type": "echo"}, "cron"),
        ({**NIGHTLY, "misfire": "sometimes"}, "misfire"),
        ({**NIGHTLY, "colour": "red"}, None),
    ],
)
async def test_bad_schedules_are_422_and_change_nothing(
    pg_api: ApiServer, body: dict[str, object], field: str | None
) -> None:
    async with pg_api.client() as c:
        r = await c.post("/v1/schedules", json=body)
        assert r.status_code == 422 and r.headers["content-type"] == "application/problem+json"
        if field:
            assert r.json()["field"] == field
        if body.get("name") == "neither":  # what to give, not "exactly one" of two not given
            assert r.json()["detail"] == "give cron (a cron expression) or interval (seconds)"
        assert (await c.get("/v1/schedules")).json()["schedules"] == []


async def test_a_schedule_fires_jobs_and_stops_when_deleted(
    pg_api: ApiServer, queue: Queue, pg_pool: Pool, background: Background
) -> None:
    scheduler = Scheduler(queue.store, schedules=ScheduleStore(pg_pool))
    background.start(scheduler)
    async with pg_api.client() as c:
        sid = (
            await c.post("/v1/schedules", json={"name": "tick", "type": "echo", "interval": 1})
        ).json()["id"]

        async def two_jobs() -> bool:
            queued: int = (await queue.admin.stats())["total"]["queued"]
            return queued >= 2

        await wait_for(two_jobs, timeout=10)
        got = (await c.get(f"/v1/schedules/{sid}")).json()
        assert got["last_fired_at"] is not None
        assert (await c.delete(f"/v1/schedules/{sid}")).status_code == 204
        after = (await queue.admin.stats())["total"]["queued"]
        # gone from Redis, where schedulers fire it, and not restored from Postgres
        assert await scheduler.cron.times([sid]) == {}
        assert await scheduler.reconcile() == 0
        # an hour on (3600 slots of it due), firing every shard creates nothing
        later = now_ms() + 3_600_000
        grace = scheduler.misfire_grace_ms
        for shard in range(queue.keys.shards):
            assert await scheduler.cron.fire_due(shard, later, grace) == (0, -1)
        assert (await queue.admin.stats())["total"]["queued"] == after  # no more firings


async def test_scheduler_restores_a_schedule_redis_lost(
    pg_api: ApiServer, queue: Queue, pg_pool: Pool
) -> None:
    async with pg_api.client() as c:
        sid = (await c.post("/v1/schedules", json=NIGHTLY)).json()["id"]
    scheduler = Scheduler(queue.store, schedules=ScheduleStore(pg_pool))
    assert await scheduler.reconcile() == 0
    await scheduler.cron.remove(sid)  # as if Redis had lost it
    assert await scheduler.reconcile() == 1
    assert sid in await scheduler.cron.times([sid])


async def test_python_client_manages_schedules(pg_api: ApiServer) -> None:
    from jobtier.client import AsyncClient, Client, Conflict, NotFound, ValidationFailed
    from jobtier.core.schedule import ScheduleSpec
    from tests.fixtures.api import KEYS

    async with AsyncClient(pg_api.url, KEYS["acme"]) as client:
        made = await client.create_schedule(
            ScheduleSpec(name="hourly", type="echo", cron="0 * * * *")
        )
        assert made.next_fire_at is not None and made.tenant == "acme"
        with pytest.raises(Conflict):
            await client.create_schedule({"name": "hourly", "type": "echo", "interval": 60})
        with pytest.raises(ValidationFailed) as bad:
            await client.create_schedule({"name": "x", "type": "echo", "cron": "nope"})
        assert bad.value.field == "cron"
        assert [s.id for s in await client.schedules()] == [made.id]
        assert (await client.pause_schedule(made.id)).paused
        assert not (await client.resume_schedule(made.id)).paused
        await client.delete_schedule(made.id)
        with pytest.raises(NotFound):
            await client.schedule(made.id)

    def sync_use() -> list[str]:
        with Client(pg_api.url, KEYS["acme"]) as client:
            client.create_schedule({"name": "sync", "type": "echo", "interval": 30})
            return [s.name for s in client.schedules()]

    assert await asyncio.to_thread(sync_use) == ["sync"]
