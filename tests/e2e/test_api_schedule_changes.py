"""Changing a schedule in place (PATCH) and running one now, through the API (Postgres +
Redis), and what the scheduler then fires."""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Any, cast

import pytest

from jobtier.api.records import PostgresExtension
from jobtier.config import Settings
from jobtier.core.schedule import Schedule
from jobtier.engine.cron import CronMirror, mirror_def, slot_job_id
from jobtier.engine.queue import Queue
from jobtier.persist.db import Pool
from jobtier.persist.schedule_store import ScheduleStore
from jobtier.scheduler import Scheduler
from tests.fixtures.api import KEYS, ApiServer, StartApi
from tests.fixtures.engine import wait_for


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


def ms(at: str) -> int:
    return round(datetime.fromisoformat(at).timestamp() * 1000)


async def mirrored(queue: Queue, schedule_id: str) -> dict[bytes, bytes]:
    """The schedule's copy in Redis, which the schedulers fire from."""
    mirror = CronMirror(queue.redis, queue.keys, queue.scripts)
    got = await queue.redis.hgetall(queue.keys.cron_def(mirror.shard(schedule_id), schedule_id))
    return {
        k.encode() if isinstance(k, str) else k: v.encode() if isinstance(v, str) else v
        for k, v in got.items()
    }


async def test_a_change_keeps_what_it_does_not_name(pg_api: ApiServer, queue: Queue) -> None:
    async with pg_api.client() as c:
        made = (await c.post("/v1/schedules", json=NIGHTLY)).json()
        sid = made["id"]
        r = await c.patch(f"/v1/schedules/{sid}", json={"payload": {"report": False}})
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["payload"] == {"report": False}
        # its slots did not move: the next firing is the one it had
        assert got["next_fire_at"] == made["next_fire_at"] and got["cron"] == "0 3 * * *"
        assert got["updated_at"] > made["updated_at"] and got["created_at"] == made["created_at"]
        assert (await mirrored(queue, sid))[b"payload"] == b'{"report":false}'

        # an interval replaces the cron, and its slots start anew from now
        before = ms((await c.get(f"/v1/schedules/{sid}")).json()["updated_at"])
        got = (await c.patch(f"/v1/schedules/{sid}", json={"interval": 60})).json()
        assert got["cron"] is None and got["interval"] == 60
        assert before < ms(got["next_fire_at"]) <= ms(got["updated_at"]) + 60_000
        got = (await c.patch(f"/v1/schedules/{sid}", json={"cron": "*/5 * * * *"})).json()
        assert got["interval"] is None and got["cron"] == "*/5 * * * *"
        assert ms(got["next_fire_at"]) % 300_000 == 0

        got = (
            await c.patch(
                f"/v1/schedules/{sid}",
                json={"name": "renamed", "priority": "high", "misfire": "skip", "paused": True},
            )
        ).json()
        assert (got["name"], got["priority"], got["misfire"]) == ("renamed", "high", "skip")
        assert got["paused"] and got["next_fire_at"] is None
        assert (await mirrored(queue, sid))[b"paused"] == b"1"
        shard = CronMirror(queue.redis, queue.keys, queue.scripts).shard(sid)
        assert await queue.redis.zscore(queue.keys.cron(shard), sid) is None  # not due
        got = (await c.patch(f"/v1/schedules/{sid}", json={"paused": False})).json()
        assert not got["paused"] and got["next_fire_at"] is not None
        listed = (await c.get("/v1/schedules")).json()["schedules"]
        assert [(s["id"], s["name"]) for s in listed] == [(sid, "renamed")]


@pytest.mark.parametrize(
    ("change", "status", "field"),
    [
        ({}, 422, None),
        ({"cron": "0 25 * * *"}, 422, "cron"),
        ({"cron": "* * * * *", "interval": 5}, 422, "cron"),
        ({"cron": None}, 422, "cron"),  # neither then
        ({"interval": 0}, 422, "interval"),
        ({"timezone": "Nowhere/Land"}, 422, "timezone"),
        ({"misfire": "sometimes"}, 422, "misfire"),
        ({"max_attempts": 0}, 422, "max_attempts"),
        ({"type": "no such type!"}, 422, "type"),
        ({"colour": "red"}, 422, "colour"),
        ({"name": "taken"}, 409, "name"),
    ],
)
async def test_a_bad_change_is_refused_and_changes_nothing(
    pg_api: ApiServer, queue: Queue, change: dict[str, Any], status: int, field: str | None
) -> None:
    async with pg_api.client() as c:
        sid = (await c.post("/v1/schedules", json=NIGHTLY)).json()["id"]
        await c.post("/v1/schedules", json={"name": "taken", "type": "echo", "interval": 60})
        before = (await c.get(f"/v1/schedules/{sid}")).json()
        copy = await mirrored(queue, sid)
        r = await c.patch(f"/v1/schedules/{sid}", json=change)
        assert r.status_code == status, r.text
        assert r.headers["content-type"] == "application/problem+json"
        assert r.json().get("field") == field
        assert (await c.get(f"/v1/schedules/{sid}")).json() == before
        assert await mirrored(queue, sid) == copy


async def test_a_change_redis_refuses_is_rolled_back(pg_api: ApiServer, queue: Queue) -> None:
    class Refusing(CronMirror):
        async def put(self, *args: Any, **kwargs: Any) -> None:
            raise ConnectionError("Redis refused the copy (injected)")

    state = pg_api.server.lifespan.state
    async with pg_api.client() as c:
        sid = (await c.post("/v1/schedules", json=NIGHTLY)).json()["id"]
        before = (await c.get(f"/v1/schedules/{sid}")).json()
        state["cron"] = Refusing(queue.redis, queue.keys, queue.scripts)
        r = await c.patch(f"/v1/schedules/{sid}", json={"payload": 1, "interval": 60})
        assert r.status_code >= 500
        r = await c.post(f"/v1/schedules/{sid}/pause")
        assert r.status_code >= 500
        state["cron"] = CronMirror(queue.redis, queue.keys, queue.scripts)
        assert (await c.get(f"/v1/schedules/{sid}")).json() == before  # Postgres rolled back


class Held(CronMirror):
    """Redis's copy written only once the test lets it (``go``); ``entered`` once a write
    waits."""

    def __init__(self, queue: Queue) -> None:
        super().__init__(queue.redis, queue.keys, queue.scripts)
        self.entered, self.go = asyncio.Event(), asyncio.Event()

    async def put(self, *args: Any, **kwargs: Any) -> None:
        self.entered.set()
        await self.go.wait()
        await super().put(*args, **kwargs)


async def lock_waiters(pool: Pool) -> int:
    """Postgres sessions waiting for a row lock."""
    n: int = await pool.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
    )
    return n


async def test_a_delete_during_a_change_waits_for_it(
    pg_api: ApiServer, queue: Queue, pg_pool: Pool
) -> None:
    """The delete waits for the change's lock, then removes the copy the change wrote: the
    schedule does not go on firing from Redis with no row in Postgres."""
    state = pg_api.server.lifespan.state
    async with pg_api.client() as c:
        sid = (await c.post("/v1/schedules", json=NIGHTLY)).json()["id"]
        held = state["cron"] = Held(queue)
        change = asyncio.create_task(c.patch(f"/v1/schedules/{sid}", json={"interval": 60}))
        await asyncio.wait_for(held.entered.wait(), 10)
        delete = asyncio.create_task(c.delete(f"/v1/schedules/{sid}"))
        await wait_for(lambda: _waiting(pg_pool), timeout=10)  # the delete waits for the lock
        held.go.set()
        assert (await change).status_code == 200
        assert (await delete).status_code == 204
        assert (await c.get(f"/v1/schedules/{sid}")).status_code == 404
    assert await mirrored(queue, sid) == {}
    assert sid not in await held.listed()


async def _waiting(pool: Pool) -> bool:
    return await lock_waiters(pool) > 0


async def test_a_change_behind_a_long_held_lock_is_a_503_that_changes_nothing(
    pg_api: ApiServer, pg_pool: Pool
) -> None:
    async with pg_api.client() as c:
        sid = (await c.post("/v1/schedules", json=NIGHTLY)).json()["id"]
        before = (await c.get(f"/v1/schedules/{sid}")).json()
        async with pg_pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT 1 FROM schedules WHERE id = $1 FOR UPDATE", sid)
            r = await c.patch(f"/v1/schedules/{sid}", json={"payload": 2})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert "being changed by another request" in r.json()["detail"]
        assert (await c.get(f"/v1/schedules/{sid}")).json() == before


async def test_a_change_leaves_a_next_firing_advanced_meanwhile(
    pg_api: ApiServer, queue: Queue
) -> None:
    """A change that moves no slot does not write back the next firing it read: a firing
    that advanced it meanwhile stands."""
    state = pg_api.server.lifespan.state
    async with pg_api.client() as c:
        sid = (await c.post("/v1/schedules", json=NIGHTLY)).json()["id"]
        held = state["cron"] = Held(queue)
        change = asyncio.create_task(c.patch(f"/v1/schedules/{sid}", json={"payload": 3}))
        await asyncio.wait_for(held.entered.wait(), 10)
        key = queue.keys.cron_def(held.shard(sid), sid)
        advanced = int(cast(bytes, await queue.redis.hget(key, "next"))) + 86_400_000  # fire.lua
        await queue.redis.hset(key, "next", str(advanced))
        held.go.set()
        assert (await change).status_code == 200
    copy = await mirrored(queue, sid)
    assert int(copy[b"next"]) == advanced and copy[b"payload"] == b"3"


async def test_reconcile_mends_redis_from_postgres(
    pg_api: ApiServer, queue: Queue, pg_pool: Pool
) -> None:
    """A copy of another revision (a change's Redis write that failed half-way) is written
    again from its row; a copy whose schedule Postgres no longer has is removed."""
    store = ScheduleStore(pg_pool)
    scheduler = Scheduler(queue.store, schedules=store)
    async with pg_api.client() as c:
        sid = (await c.post("/v1/schedules", json=NIGHTLY)).json()["id"]
    assert await scheduler.reconcile() == 0
    copy = await mirrored(queue, sid)
    key = queue.keys.cron_def(scheduler.cron.shard(sid), sid)
    await queue.redis.hset(key, mapping={"payload": b'"stale"', "rev": "1"})
    (row,) = [s for s, _ in await store.all() if s.id == sid]
    orphan = "01M8KK4FZ54RBHFVYBN6HBV0CZ"
    await scheduler.cron.put(orphan, mirror_def(row, 3), b"null", 10**13, False, "1")
    assert orphan in await scheduler.cron.listed()
    assert await scheduler.reconcile() == 1
    assert await mirrored(queue, sid) == copy
    assert orphan not in await scheduler.cron.listed() and await mirrored(queue, orphan) == {}
    assert await scheduler.reconcile() == 0


async def test_a_delete_while_reconcile_runs_stays_deleted(
    pg_api: ApiServer, queue: Queue, pg_pool: Pool
) -> None:
    """Reconcile read the row, then the schedule was deleted before it read Redis: it does not
    write the copy back (it would fire with no row)."""
    async with pg_api.client() as c:
        sid = (await c.post("/v1/schedules", json=NIGHTLY)).json()["id"]

        class DeletedAfterReading(ScheduleStore):
            async def all(self) -> list[tuple[Schedule, bytes]]:
                rows = await super().all()
                assert (await c.delete(f"/v1/schedules/{sid}")).status_code == 204
                return rows

        scheduler = Scheduler(queue.store, schedules=DeletedAfterReading(pg_pool))
        assert await scheduler.reconcile() == 0
    assert await mirrored(queue, sid) == {} and sid not in await scheduler.cron.listed()


async def test_reconcile_puts_a_copy_back_in_its_due_set_and_keeps_a_later_next(
    pg_api: ApiServer, queue: Queue, pg_pool: Pool
) -> None:
    scheduler = Scheduler(queue.store, schedules=ScheduleStore(pg_pool))
    async with pg_api.client() as c:
        sid = (await c.post("/v1/schedules", json=NIGHTLY)).json()["id"]
    shard = scheduler.cron.shard(sid)
    await queue.redis.zrem(queue.keys.cron(shard), sid)  # a due set written in part, before
    assert await scheduler.reconcile() == 0
    assert sid in await scheduler.cron.listed()
    # a copy of another revision whose next firing is ahead of its row's (firings since the
    # last sync), by the same slots: written again, its next firing kept
    key = queue.keys.cron_def(shard, sid)
    advanced = int(cast(bytes, await queue.redis.hget(key, "next"))) + 7 * 86_400_000
    await queue.redis.hset(key, mapping={"next": str(advanced), "rev": "1"})
    assert await scheduler.reconcile() == 1
    copy = await mirrored(queue, sid)
    assert int(copy[b"next"]) == advanced and copy[b"rev"] != b"1"
    assert await queue.redis.zscore(queue.keys.cron(shard), sid) == advanced


async def test_firing_times_copied_back_do_not_undo_a_change(
    pg_api: ApiServer, pg_pool: Pool
) -> None:
    """The scheduler's copy of firing times, read before a change, is not written over it."""
    store = ScheduleStore(pg_pool)
    async with pg_api.client() as c:
        sid = (await c.post("/v1/schedules", json=NIGHTLY)).json()["id"]
        (read,) = [s for s, _ in await store.all() if s.id == sid]
        changed = (await c.patch(f"/v1/schedules/{sid}", json={"interval": 60})).json()
    stale_next = read.next_fire_at
    await store.sync_times([(read, stale_next, None)])
    (now,) = [s for s, _ in await store.all() if s.id == sid]
    assert now.next_fire_at is not None and now.next_fire_at != stale_next
    assert now.next_fire_at == datetime.fromisoformat(changed["next_fire_at"])


async def test_changes_at_once_leave_postgres_and_redis_agreeing(
    pg_api: ApiServer, queue: Queue, pg_pool: Pool
) -> None:
    async with pg_api.client() as c:
        sid = (await c.post("/v1/schedules", json=NIGHTLY)).json()["id"]
        answers = await asyncio.gather(
            *(c.patch(f"/v1/schedules/{sid}", json={"payload": {"n": n}}) for n in range(12))
        )
        assert {r.status_code for r in answers} == {200}
    (kept,) = [s for s in await ScheduleStore(pg_pool).all() if s[0].id == sid]
    assert (await mirrored(queue, sid))[b"payload"] == kept[1].replace(b" ", b"")


async def test_the_scheduler_fires_the_changed_definition(
    pg_api: ApiServer, queue: Queue, pg_pool: Pool
) -> None:
    scheduler = Scheduler(queue.store, schedules=ScheduleStore(pg_pool))
    async with pg_api.client() as c:
        sid = (await c.post("/v1/schedules", json=NIGHTLY)).json()["id"]
        change = {"payload": {"report": "weekly"}, "priority": "critical", "max_attempts": 7}
        got = (await c.patch(f"/v1/schedules/{sid}", json=change)).json()
        slot = ms(got["next_fire_at"])
        shard = scheduler.cron.shard(sid)
        assert (await scheduler.cron.fire_due(shard, slot, scheduler.misfire_grace_ms))[0] == 1
        job_id = slot_job_id(queue.keys, sid, slot)
        job = (await c.get(f"/v1/jobs/{job_id}")).json()
    assert job["type"] == "echo" and await queue.jobs.payload(job_id) == {"report": "weekly"}
    assert (job["priority"], job["max_attempts"]) == ("critical", 7)
    assert await scheduler.reconcile() == 0  # nothing for it to restore


async def test_run_now_makes_one_job_and_leaves_the_slots(pg_api: ApiServer, queue: Queue) -> None:
    async with pg_api.client() as c, pg_api.client("globex") as globex:
        made = (await c.post("/v1/schedules", json={**NIGHTLY, "paused": True})).json()
        sid = made["id"]
        r = await c.post(f"/v1/schedules/{sid}/run")
        assert r.status_code == 202, r.text
        job = r.json()
        assert r.headers["location"] == f"/v1/jobs/{job['id']}"
        assert (job["type"], job["state"]) == ("echo", "queued")
        assert await queue.jobs.payload(job["id"]) == {"report": True}
        again = await c.post(f"/v1/schedules/{sid}/run")
        assert again.status_code == 202 and again.json()["id"] != job["id"]  # a run is a run
        keyed = [
            await c.post(f"/v1/schedules/{sid}/run", headers={"idempotency-key": "run-1"})
            for _ in range(2)
        ]
        assert [r.status_code for r in keyed] == [202, 200]
        assert keyed[0].json()["id"] == keyed[1].json()["id"]
        # the key is this schedule's: another schedule's run, or a submit, with it is another
        other = (await c.post("/v1/schedules", json={**NIGHTLY, "name": "other"})).json()
        theirs = await c.post(
            f"/v1/schedules/{other['id']}/run", headers={"idempotency-key": "run-1"}
        )
        assert theirs.status_code == 202 and theirs.json()["id"] != keyed[0].json()["id"]
        submit = {"type": "echo", "payload": {"report": True}, "idempotency_key": "run-1"}
        alone = await c.post("/v1/jobs", json=submit)
        assert alone.status_code == 202 and alone.json()["id"] != keyed[0].json()["id"]
        # a run takes no body (its job is the schedule's), nor a key it cannot scope
        body = await c.post(f"/v1/schedules/{sid}/run", json={"payload": {"x": 1}})
        assert body.status_code == 400 and "takes no body" in body.json()["detail"]
        long = await c.post(f"/v1/schedules/{sid}/run", headers={"idempotency-key": "k" * 165})
        assert long.status_code == 400 and long.json()["field"] == "idempotency_key"
        after = (await c.get(f"/v1/schedules/{sid}")).json()
        assert after == made  # still paused, never fired by a slot
        assert (await globex.post(f"/v1/schedules/{sid}/run")).status_code == 404
        missing = "01ARZ3NDEKTSV4RRFFQ69G5FAV"
        assert (await c.post(f"/v1/schedules/{missing}/run")).status_code == 404


async def test_python_clients_change_and_run_schedules(pg_api: ApiServer) -> None:
    from jobtier.client import AsyncClient, Client, Conflict, ValidationFailed
    from jobtier.core.schedule import ScheduleSpec

    async with AsyncClient(pg_api.url, KEYS["acme"]) as client:
        made = await client.create_schedule({"name": "hourly", "type": "echo", "cron": "0 * * * *"})
        await client.create_schedule({"name": "other", "type": "echo", "interval": 60})
        got = await client.update_schedule(made.id, interval=120, payload={"a": 1})
        assert (got.cron, got.interval, got.payload) == (None, 120, {"a": 1})
        with pytest.raises(Conflict):
            await client.update_schedule(made.id, name="other")
        with pytest.raises(ValidationFailed) as bad:
            await client.update_schedule(made.id, timezone="Nowhere/Land")
        assert bad.value.field == "timezone"
        # declared in code: made the first time, made the spec again after
        declared = await client.upsert_schedule(
            {"name": "declared", "type": "echo", "interval": 60}
        )
        again = await client.upsert_schedule(
            ScheduleSpec(name="declared", type="echo", cron="0 4 * * *", payload={"v": 2})
        )
        assert again.id == declared.id
        assert (again.cron, again.interval, again.payload) == ("0 4 * * *", None, {"v": 2})
        ran = await client.run_schedule(made.id, idempotency_key="once")
        assert (
            ran.created
            and (await client.run_schedule(made.id, idempotency_key="once")).id == ran.id
        )

    def sync_use() -> tuple[int | None, bool]:
        with Client(pg_api.url, KEYS["acme"]) as client:
            changed = client.update_schedule(made.id, interval=300)
            return changed.interval, client.run_schedule(made.id).created

    assert await asyncio.to_thread(sync_use) == (300, True)


async def test_the_cli_manages_schedules_by_name(pg_api: ApiServer, queue: Queue) -> None:
    from tests.e2e.test_admin_cli import Cli

    cli = Cli(pg_api)
    async with pg_api.client() as c:
        made = (await c.post("/v1/schedules", json=NIGHTLY)).json()
    sid, made_attempts = made["id"], made["max_attempts"]
    code, out, err = await cli("schedules")
    assert code == 0, err
    assert out.splitlines()[0].split()[:3] == ["ID", "NAME", "TYPE"]
    assert sid in out and "0 3 * * * (Europe/Paris)" in out
    changed = await cli.json("schedules", "update", "nightly", "--interval", "90", "--payload", "7")
    assert (changed["id"], changed["interval"], changed["cron"]) == (sid, 90, None)
    assert changed["payload"] == 7
    code, out, err = await cli("schedules", "show", sid)
    assert code == 0 and "every 90 s" in out and "payload:     7" in out, err
    ran = await cli.json("schedules", "run", "nightly", "--idempotency-key", "k1")
    code, out, _ = await cli("schedules", "run", "nightly", "--idempotency-key", "k1")
    assert code == 0 and "already submitted with this key" in out and ran["id"] in out
    assert await queue.jobs.payload(ran["id"]) == 7
    assert (await cli.json("schedules", "pause", "nightly"))["paused"] is True
    assert (await cli.json("schedules", "resume", sid))["paused"] is False
    # refusals: a name the tenant has not, nothing to change, a delete without --yes
    code, _, err = await cli("schedules", "show", "weekly")
    assert code == 1 and "schedule weekly" in err and "HTTP 404" in err
    code, _, err = await cli("schedules", "update", "nightly")
    assert code == 2 and "nothing to change" in err
    nine = await cli.json("schedules", "update", "nightly", "--max-attempts", "9")
    back = await cli.json("schedules", "update", "nightly", "--task-defaults")
    assert nine["max_attempts"] == 9 and back["max_attempts"] == made_attempts
    code, _, err = await cli("schedules", "update", "nightly", "--task-defaults", "--queue", "q")
    assert code == 2 and "not with either" in err
    code, _, err = await cli("schedules", "update", "nightly", "--timezone", "Nowhere/Land")
    assert code == 1 and "unknown time zone" in err and "HTTP 422" in err
    code, _, err = await cli("schedules", "delete", "nightly")
    assert code == 2 and "--yes" in err
    assert (await cli.json("schedules", "delete", "nightly", "--yes")) == {"deleted": sid}
    code, out, _ = await cli("schedules", "list")
    assert code == 0 and out.strip() == "no schedules"
    for name in ("a", "b"):
        async with pg_api.client() as c:
            await c.post("/v1/schedules", json={**NIGHTLY, "name": name})
    code, out, _ = await cli("schedules", "list", "--limit", "1")
    assert code == 0 and out.splitlines()[-1] == "more: --after a"
    code, out, _ = await cli("schedules", "list", "--after", "a")
    assert code == 0 and len(out.splitlines()) == 2 and " b " in out


async def test_a_tenants_schedule_changes_are_in_the_audit(pg_api: ApiServer) -> None:
    """Create, change, pause, resume, run now and delete with a tenant's key, and a refused
    change: each is an audit record of the schedule, by the tenant's key's fingerprint (never
    the key), newest first; another tenant's try at it is a 404 recorded as that tenant's."""
    async with pg_api.client() as c, pg_api.client("admin") as admin:
        sid = (await c.post("/v1/schedules", json=NIGHTLY)).json()["id"]
        assert (await c.patch(f"/v1/schedules/{sid}", json={"priority": "high"})).status_code == 200
        bad = await c.patch(f"/v1/schedules/{sid}", json={"cron": "61 * * * *"})
        assert bad.status_code == 422
        garbled = await c.patch(f"/v1/schedules/{sid}", content=b"{nope")
        assert garbled.status_code == 400
        assert (await c.post(f"/v1/schedules/{sid}/pause")).status_code == 200
        assert (await c.post(f"/v1/schedules/{sid}/resume")).status_code == 200
        ran = await c.post(f"/v1/schedules/{sid}/run")
        assert ran.status_code == 202
        async with pg_api.client("globex") as other:
            assert (await other.delete(f"/v1/schedules/{sid}")).status_code == 404
        assert (await c.delete(f"/v1/schedules/{sid}")).status_code == 204
        page = (await admin.get("/v1/admin/audit", params={"target": sid})).json()["records"]
    got = [(r["action"], r["status"], r["actor"].rsplit(":", 1)[0]) for r in reversed(page)]
    assert got == [
        ("schedule.create", 201, "tenant:acme"),
        ("schedule.change", 200, "tenant:acme"),
        ("schedule.change", 422, "tenant:acme"),
        ("schedule.change", 400, "tenant:acme"),
        ("schedule.pause", 200, "tenant:acme"),
        ("schedule.resume", 200, "tenant:acme"),
        ("schedule.run", 202, "tenant:acme"),
        ("schedule.delete", 404, "tenant:globex"),
        ("schedule.delete", 204, "tenant:acme"),
    ]
    by_action = {(r["action"], r["status"]): r["detail"] for r in page}
    assert by_action[("schedule.change", 200)] == {"name": "nightly", "fields": ["priority"]}
    assert by_action[("schedule.run", 202)] == {
        "name": "nightly",
        "job_id": ran.json()["id"],
        "created": True,
    }
    assert all(KEYS["acme"] not in r["actor"] for r in page)
