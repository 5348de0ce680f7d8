"""A schedule's start and end dates through the API (Postgres + Redis), the clients and the
CLI, and what a running scheduler fires within them."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from jobtier.api.records import PostgresExtension
from jobtier.config import Settings
from jobtier.engine.cron import slot_job_id
from jobtier.engine.queue import Queue
from jobtier.persist.db import Pool
from jobtier.persist.schedule_store import ScheduleStore
from jobtier.scheduler import Scheduler
from tests.fixtures.api import KEYS, ApiServer, StartApi
from tests.fixtures.engine import Background, wait_for


@pytest.fixture
async def pg_api(start_api: StartApi, pg_settings: Settings) -> ApiServer:
    return await start_api(PostgresExtension(pg_settings), database_url=pg_settings.database_url)


def iso(at: datetime) -> str:
    return at.isoformat().replace("+00:00", "Z")


def ms(at: str) -> int:
    return round(datetime.fromisoformat(at).timestamp() * 1000)


def later(**span: float) -> datetime:
    """A whole second of UTC ``span`` from now."""
    return (datetime.now(UTC) + timedelta(**span)).replace(microsecond=0)


async def test_dates_bound_the_first_slot_and_are_kept(pg_api: ApiServer) -> None:
    start = later(days=3)
    async with pg_api.client() as c:
        # an interval's slots are counted from its start: the first fires at it
        r = await c.post(
            "/v1/schedules",
            json={"name": "tick", "type": "echo", "interval": 3600, "start_at": iso(start)},
        )
        assert r.status_code == 201, r.text
        made = r.json()
        assert ms(made["next_fire_at"]) == ms(made["start_at"]) == ms(iso(start))
        assert made["end_at"] is None
        # a cron's first slot at or after its start, in its zone
        body = {
            "name": "daily",
            "type": "echo",
            "cron": "0 9 * * *",
            "timezone": "Europe/Paris",
            "start_at": "2031-06-10T12:00:00+02:00",
            "end_at": "2031-06-20T00:00:00Z",
        }
        daily = (await c.post("/v1/schedules", json=body)).json()
        assert ms(daily["next_fire_at"]) == ms("2031-06-11T09:00:00+02:00")
        got = (await c.get(f"/v1/schedules/{daily['id']}")).json()
        assert (ms(got["start_at"]), ms(got["end_at"])) == (
            ms(body["start_at"]),
            ms(body["end_at"]),
        )
        # a change of its start moves the next firing; a change of its name keeps it
        moved = await c.patch(
            f"/v1/schedules/{made['id']}", json={"start_at": iso(start + timedelta(days=1))}
        )
        assert ms(moved.json()["next_fire_at"]) == ms(iso(start + timedelta(days=1)))
        renamed = (await c.patch(f"/v1/schedules/{made['id']}", json={"name": "tock"})).json()
        assert renamed["next_fire_at"] == moved.json()["next_fire_at"]
        # no start: from the next slot after now, counted from the creation as before
        cleared = (await c.patch(f"/v1/schedules/{made['id']}", json={"start_at": None})).json()
        assert cleared["start_at"] is None
        assert ms(cleared["next_fire_at"]) < ms(made["next_fire_at"])


@pytest.mark.parametrize(
    ("dates", "field", "says"),
    [
        ({"start_at": "2031-01-01T00:00:00"}, "start_at", "needs a time zone"),
        ({"end_at": "2031-01-02T00:00:00"}, "end_at", "needs a time zone"),
        (
            {"start_at": "2031-01-02T00:00:00Z", "end_at": "2031-01-01T00:00:00Z"},
            "end_at",
            "end_at must be after start_at",
        ),
        ({"end_at": "2020-01-01T00:00:00Z"}, "end_at", "would never fire"),
        # a window the cron has no slot in: 03:00 on 1 January, from February to December
        (
            {
                "cron": "0 3 1 1 *",
                "start_at": "2031-02-01T00:00:00Z",
                "end_at": "2031-12-01T00:00:00Z",
            },
            "end_at",
            "would never fire",
        ),
        ({"start_at": "1999-12-31T00:00:00Z"}, "start_at", "between 2000-01-01"),
        # its next slot would be past what a date holds (was a 500)
        ({"start_at": "9500-01-01T00:00:00Z"}, "start_at", "and 9000-01-01"),
        ({"end_at": "tomorrow"}, None, None),
    ],
)
async def test_bad_dates_are_422_and_make_nothing(
    pg_api: ApiServer, dates: dict[str, str], field: str | None, says: str | None
) -> None:
    async with pg_api.client() as c:
        body = {"name": "dated", "type": "echo", "interval": 3600, **dates}
        if "cron" in dates:
            del body["interval"]
        r = await c.post("/v1/schedules", json=body)
        assert r.status_code == 422, r.text
        if field is not None:
            assert (r.json()["field"], says in r.json()["detail"]) == (field, True), r.text
        assert (await c.get("/v1/schedules")).json()["schedules"] == []


async def test_a_change_to_bad_dates_is_422_and_changes_nothing(pg_api: ApiServer) -> None:
    async with pg_api.client() as c:
        made = (
            await c.post(
                "/v1/schedules",
                json={
                    "name": "dated",
                    "type": "echo",
                    "interval": 3600,
                    "start_at": iso(later(days=1)),
                    "end_at": iso(later(days=9)),
                },
            )
        ).json()
        for change, field in (
            ({"end_at": iso(later(hours=1))}, "end_at"),  # before its start
            ({"start_at": iso(later(days=10))}, "start_at"),  # after its end: the field sent
            ({"start_at": "2031-01-01T00:00:00"}, "start_at"),
        ):
            r = await c.patch(f"/v1/schedules/{made['id']}", json=change)
            assert (r.status_code, r.json()["field"]) == (422, field), (change, r.text)
        got = (await c.get(f"/v1/schedules/{made['id']}")).json()
        assert {k: got[k] for k in made if k != "updated_at"} == {
            k: made[k] for k in made if k != "updated_at"
        }


async def test_a_change_of_slots_that_leaves_none_is_refused_but_an_end_may_end_it(
    pg_api: ApiServer,
) -> None:
    """Checked as a create is: a new cron or start leaving no slot before the end is a 422
    naming the field sent, changing nothing; a new end_at, even one past, ends it."""
    body = {
        "name": "nightly",
        "type": "echo",
        "cron": "0 0 * * *",
        "start_at": "2031-03-01T00:00:00Z",
        "end_at": "2031-12-30T23:00:00Z",
    }
    async with pg_api.client() as c:
        made = (await c.post("/v1/schedules", json=body)).json()
        one = f"/v1/schedules/{made['id']}"
        for change, field in (
            ({"cron": "0 0 1 1 *"}, "cron"),  # 1 January: none between March and December
            ({"start_at": "2031-12-30T12:00:00Z"}, "start_at"),  # its next midnight is after
        ):
            r = await c.patch(one, json=change)
            assert (r.status_code, r.json()["field"]) == (422, field), r.text
            assert "no slot between now and its end_at" in r.json()["detail"]
        assert (await c.get(one)).json()["next_fire_at"] == made["next_fire_at"]
        ended = await c.patch(one, json={"start_at": None, "end_at": "2026-01-01T00:00:00Z"})
        assert ended.status_code == 200 and ended.json()["next_fire_at"] is None, ended.text


async def test_a_new_end_keeps_the_next_firing_it_does_not_pass(pg_api: ApiServer) -> None:
    async with pg_api.client() as c:
        made = (
            await c.post("/v1/schedules", json={"name": "h", "type": "echo", "interval": 3600})
        ).json()
        sid, nxt = made["id"], made["next_fire_at"]
        kept = (await c.patch(f"/v1/schedules/{sid}", json={"end_at": iso(later(days=2))})).json()
        assert kept["next_fire_at"] == nxt
        # an end before that slot (and after now): no slot left, it has ended
        before = datetime.fromisoformat(nxt) - timedelta(seconds=1)
        ended = (await c.patch(f"/v1/schedules/{sid}", json={"end_at": iso(before)})).json()
        assert ended["next_fire_at"] is None and not ended["paused"]


async def test_a_create_of_a_taken_name_is_a_409_even_with_no_slot_left(
    pg_api: ApiServer,
) -> None:
    """Declared in code with an end that has passed: the create is the name's 409 (not the
    window's 422), so upsert_schedule changes the schedule, which then has ended."""
    from jobtier.client import AsyncClient

    spec = {"name": "campaign", "type": "echo", "interval": 60, "end_at": iso(later(days=1))}
    past = {**spec, "end_at": iso(later(seconds=-5))}
    async with pg_api.client() as c:
        made = (await c.post("/v1/schedules", json=spec)).json()
        r = await c.post("/v1/schedules", json=past)
        assert (r.status_code, r.json()["field"]) == (409, "name"), r.text
        r = await c.post("/v1/schedules", json={**past, "name": "other"})
        assert (r.status_code, r.json()["field"]) == (422, "end_at"), r.text
    async with AsyncClient(pg_api.url, KEYS["acme"]) as client:
        again = await client.upsert_schedule(past)
    assert again.id == made["id"] and again.next_fire_at is None


async def test_reconcile_leaves_an_ended_schedule_ended(
    queue: Queue, pg_api: ApiServer, pg_pool: Pool
) -> None:
    """Its copy fired its last slot and has ended, Postgres's row not synced since (its
    next firing that slot), and the copy of another revision (a change whose commit
    failed): reconcile writes the copy again, ended, not firing that slot again."""
    scheduler = Scheduler(queue.store, schedules=ScheduleStore(pg_pool))
    end = later(seconds=3)
    async with pg_api.client() as c:
        made = (
            await c.post(
                "/v1/schedules",
                json={"name": "brief", "type": "echo", "interval": 1, "end_at": iso(end)},
            )
        ).json()
    sid, cron = made["id"], scheduler.cron
    last = ms(made["created_at"]) + 1000 * ((ms(iso(end)) - ms(made["created_at"])) // 1000)
    shard = cron.shard(sid)
    grace = scheduler.misfire_grace_ms
    for _ in range(10):  # fired slot by slot, as if on time, up to the end
        nxt = (await cron.times([sid]))[sid][0]
        if nxt is None:
            break
        await cron.fire_due(shard, nxt, grace)
    assert await cron.times([sid]) == {sid: (None, last, False)}
    row = await ScheduleStore(pg_pool).get(sid, "acme")
    assert row is not None and row.next_fire_at is not None  # not synced
    await queue.redis.hset(queue.keys.cron_def(shard, sid), "rev", "1")  # another revision
    assert await scheduler.reconcile() == 1
    assert await cron.times([sid]) == {sid: (None, last, False)}
    assert sid not in await cron.listed()


async def test_a_schedule_fires_until_its_end_then_has_ended(
    pg_api: ApiServer, queue: Queue, pg_pool: Pool, background: Background
) -> None:
    """An every-second schedule ending a few seconds on: it fires each slot up to its end
    (missed ones too: fire_all), then no more; it shows ended, in Redis and in Postgres, and
    the scheduler's reconcile does not set it firing again. A change of its end sets it firing
    again, and an end of now ends it at once."""
    scheduler = Scheduler(queue.store, schedules=ScheduleStore(pg_pool))
    end = later(seconds=5)
    async with pg_api.client() as c:
        r = await c.post(
            "/v1/schedules",
            json={
                "name": "brief",
                "type": "echo",
                "interval": 1,
                "misfire": "fire_all",
                "end_at": iso(end),
            },
        )
        assert r.status_code == 201, r.text
        made = r.json()
        sid, created = made["id"], ms(made["created_at"])
        slots = list(range(created + 1000, ms(iso(end)) + 1, 1000))
        assert len(slots) >= 3
        background.start(scheduler)

        async def ended() -> bool:
            got = (await c.get(f"/v1/schedules/{sid}")).json()
            return got["next_fire_at"] is None and got["last_fired_at"] is not None

        await wait_for(ended, timeout=30)
        fired = (await c.get(f"/v1/schedules/{sid}")).json()
        assert ms(fired["last_fired_at"]) == slots[-1] and not fired["paused"]
        jobs = [slot_job_id(queue.keys, sid, slot) for slot in slots]
        states = [(await queue.status(job)).state for job in jobs]  # one job per slot
        assert states == ["queued"] * len(slots)
        assert (await queue.admin.stats())["total"]["queued"] == len(slots)  # and no more
        assert await scheduler.reconcile() == 0
        assert await scheduler.cron.times([sid]) == {sid: (None, slots[-1], False)}
        row = await ScheduleStore(pg_pool).get(sid, "acme")
        assert row is not None and row.next_fire_at is None  # synced: ended in Postgres too
        # its end moved on: it fires again from the next slot after now
        again = (await c.patch(f"/v1/schedules/{sid}", json={"end_at": None})).json()
        assert again["next_fire_at"] is not None

        async def fired_again() -> bool:
            return bool((await queue.admin.stats())["total"]["queued"] > len(slots))

        await wait_for(fired_again, timeout=30)
        # an end of now ends it at once
        stop = await c.patch(f"/v1/schedules/{sid}", json={"end_at": iso(datetime.now(UTC))})
        assert stop.status_code == 200 and stop.json()["next_fire_at"] is None, stop.text
        assert await scheduler.cron.listed() == set()  # in no due set: nothing fires it


async def test_clients_and_cli_give_and_show_dates(pg_api: ApiServer) -> None:
    from jobtier.client import AsyncClient, Client
    from jobtier.core.schedule import ScheduleSpec
    from tests.e2e.test_admin_cli import Cli

    start, end = later(days=2), later(days=30)
    async with AsyncClient(pg_api.url, KEYS["acme"]) as client:
        made = await client.create_schedule(
            ScheduleSpec(name="dated", type="echo", interval=3600, start_at=start, end_at=end)
        )
        assert (made.start_at, made.end_at, made.next_fire_at) == (start, end, start)
        changed = await client.update_schedule(made.id, end_at=end + timedelta(days=1))
        assert changed.end_at == end + timedelta(days=1)
        # declared in code: a spec without dates has none
        again = await client.upsert_schedule({"name": "dated", "type": "echo", "interval": 3600})
        assert (again.id, again.start_at, again.end_at) == (made.id, None, None)

    def sync_use() -> Any:
        with Client(pg_api.url, KEYS["acme"]) as client:
            return client.update_schedule(made.id, start_at=start).start_at

    assert await asyncio.to_thread(sync_use) == start
    cli = Cli(pg_api)
    shown = await cli.json("schedules", "update", "dated", "--end-at", "2040-01-01T00:00:00")
    assert ms(shown["end_at"]) == ms("2040-01-01T00:00:00Z")  # UTC without an offset
    code, out, err = await cli("schedules", "show", "dated")
    assert code == 0 and "until:       2040-01-01 00:00:00" in out, err
    cleared = await cli.json("schedules", "update", "dated", "--start-at", "none")
    assert cleared["start_at"] is None and cleared["end_at"] is not None
    code, _, err = await cli("schedules", "update", "dated", "--end-at", "soon")
    assert code == 2 and "neither an ISO 8601 time" in err
    ended = await cli.json("schedules", "update", "dated", "--end-at", iso(later(seconds=-1)))
    assert ended["next_fire_at"] is None
    code, out, err = await cli("schedules", "show", "dated")
    assert code == 0 and "ended" in out, err
    code, out, err = await cli("schedules", "list")
    assert code == 0 and " ended " in out, out
