"""``GET /v1/jobs/{id}/explain``, its admin twin, ``Client.explain`` and ``jobtier jobs explain``
against a real API (loopback uvicorn) and Redis: a paused queue and a held concurrency key
explained, then the cause removed and the job claimed; a job only Postgres keeps."""

from __future__ import annotations

import json
import time

import msgspec
import pytest

from jobtier.api.records import PostgresExtension
from jobtier.client import AsyncClient, NotFound, ReasonCode
from jobtier.config import Settings
from jobtier.engine.queue import Queue
from jobtier.persist.db import Pool
from jobtier.persist.persister import Persister
from jobtier.store.calls import complete_call
from tests.e2e.test_admin_cli import Cli
from tests.fixtures.api import ADMIN, KEYS, ApiServer, StartApi
from tests.fixtures.engine import worker_for
from tests.tasks import registry

LEASE_MS = 30_000


async def advertise(queue: Queue) -> None:
    """A live worker of the default queue that runs echo, as worker/heartbeat.py writes it."""
    info = {"id": "w1", "pid": 1, "host": "h", "concurrency": 4, "running": 0}
    info |= {"tasks": ["echo"], "queues": ["default"], "seen_at": time.time()}
    await queue.redis.hset(queue.keys.workers(), "w1", msgspec.json.encode(info))


async def test_a_paused_queue_through_the_route_the_client_and_the_cli(
    api: ApiServer, queue: Queue
) -> None:
    await advertise(queue)
    async with AsyncClient(api.url, KEYS["acme"]) as acme, AsyncClient(api.url, ADMIN) as admin:
        job = (await acme.submit("echo", {"n": 1})).id
        await admin.pause_queue("default")
        e = await acme.explain(job)
        assert e.waiting and e.state == "queued" and e.position == 1
        assert [r.code for r in e.reasons] == [ReasonCode.QUEUE_PAUSED, ReasonCode.IN_LINE]
        assert e.reasons[0].queue == "default"
        async with api.client() as http:
            body = (await http.get(f"/v1/jobs/{job}/explain")).json()
        assert body["reasons"][0] == {
            "code": "queue_paused",
            "message": "queue 'default' is paused: nothing is claimed from it until it is resumed",
            "queue": "default",
        }
        async with api.client("admin") as http:
            seen = (await http.get(f"/v1/admin/jobs/{job}/explain")).json()
            assert (seen["id"], seen["reasons"]) == (job, body["reasons"])
        async with api.client() as http:  # a tenant's key on the admin route
            assert (await http.get(f"/v1/admin/jobs/{job}/explain")).status_code == 403
        async with AsyncClient(api.url, KEYS["globex"]) as globex:
            with pytest.raises(NotFound):
                await globex.explain(job)  # another tenant's job: as unknown
        for unknown in (queue.keys.new_id(), "not-an-id"):
            with pytest.raises(NotFound):
                await acme.explain(unknown)

        cli = Cli(api)
        code, out, err = await cli("jobs", "explain", job)
        assert code == 0, err
        assert out.splitlines()[0].startswith(f"{job}: queued, position 1")
        assert "  queue_paused: queue 'default' is paused" in out
        code, out, _ = await cli("jobs", "explain", job, "--json")
        assert code == 0 and json.loads(out)["reasons"][0]["code"] == "queue_paused"
        code, _, err = await cli("jobs", "explain", queue.keys.new_id())
        assert code == 1 and "not found" in err.lower()

        await admin.resume_queue("default")
        e = await acme.explain(job)
        assert [r.code for r in e.reasons] == [ReasonCode.IN_LINE]
        shard = queue.keys.shard_of(job)
        batch = await queue.scripts.claim(shard, "w", 10, LEASE_MS)
        assert [j.id for j in batch.jobs] == [job]  # the claimer agrees
        e = await acme.explain(job)
        assert not e.waiting and e.state == "running" and e.position is None
        assert [r.code for r in e.reasons] == [ReasonCode.NOT_WAITING]


async def test_a_held_concurrency_key_through_the_cli(api: ApiServer, queue: Queue) -> None:
    await advertise(queue)
    async with AsyncClient(api.url, KEYS["acme"]) as acme:
        first = (await acme.submit("echo", 1, concurrency_key="account-7")).id
        second = (await acme.submit("echo", 2, concurrency_key="account-7")).id
        shard = queue.keys.shard_of(first)
        batch = await queue.scripts.claim(shard, "w", 10, LEASE_MS)
        assert [j.id for j in batch.jobs] == [first]
        code, out, err = await Cli(api)("jobs", "explain", second, "--json")
        assert code == 0, err
        held = json.loads(out)["reasons"][0]
        assert held["code"] == "concurrency_key_held"
        assert (held["key"], held["running"], held["limit"], held["ahead"]) == (
            "account-7", 1, 1, 0
        )  # fmt: skip
        assert held["holders"] == [{"id": first, "state": "running"}]
        code, out, _ = await Cli(api)("jobs", "explain", second)
        assert (
            "its concurrency key 'account-7' is held: 1 of 1 places taken" in out and first in out
        )
        lease = batch.jobs[0].lease_version
        assert await queue.scripts.call(*complete_call(shard, "w", 60, [(first, lease, b"")])) == [
            0
        ]
        e = await acme.explain(second)
        assert [r.code for r in e.reasons] == [ReasonCode.IN_LINE]
        batch = await queue.scripts.claim(shard, "w", 10, LEASE_MS)
        assert [j.id for j in batch.jobs] == [second]


async def test_a_job_only_postgres_keeps_is_not_waiting(
    start_api: StartApi, pg_settings: Settings, queue: Queue, pg_pool: Pool
) -> None:
    """A job whose retention in Redis has passed: the status tier's fallback finds it finished
    (for its tenant only)."""
    api = await start_api(PostgresExtension(pg_settings), database_url=pg_settings.database_url)
    async with api.client() as c:
        job = (await c.post("/v1/jobs", json={"type": "echo", "payload": 1})).json()
    await worker_for(queue, registry, burst=True).run()
    await Persister(pg_settings, queue.redis, pg_pool, "test-persister").drain()
    await queue.redis.delete(queue.keys.job(job["id"]))  # as when its retention has passed
    async with api.client() as c, api.client("globex") as other:
        assert (await other.get(f"/v1/jobs/{job['id']}/explain")).status_code == 404
        body = (await c.get(f"/v1/jobs/{job['id']}/explain")).json()
    assert (body["state"], body["waiting"], body["position"]) == ("succeeded", False, None)
    assert [r["code"] for r in body["reasons"]] == ["not_waiting"]
    assert "only Postgres keeps it" in body["reasons"][0]["message"]


async def test_a_live_job_redis_lost_is_said_to_be_lost_not_finished(
    start_api: StartApi, pg_settings: Settings, queue: Queue, pg_pool: Pool
) -> None:
    """A queued job Postgres has and Redis lost (a restart without its data): nothing will
    run it until it is put back, which the answer says, and how."""
    api = await start_api(PostgresExtension(pg_settings), database_url=pg_settings.database_url)
    async with api.client() as c:
        job = (await c.post("/v1/jobs", json={"type": "echo", "payload": 1})).json()
    await Persister(pg_settings, queue.redis, pg_pool, "test-persister").drain()
    await queue.redis.delete(queue.keys.job(job["id"]))  # as Redis lost it
    async with api.client() as c:
        body = (await c.get(f"/v1/jobs/{job['id']}/explain")).json()
    assert body["state"] == "queued" and [r["code"] for r in body["reasons"]] == ["unknown"]
    assert "Redis lost it" in body["reasons"][0]["message"]
    assert "jobtier reconcile" in body["reasons"][0]["message"]
    assert body["reasons"][0]["queue"] == "default"
