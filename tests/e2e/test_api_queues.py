"""Queues over HTTP: the task catalogue at submit, typed payloads, and the admin queue routes."""

from __future__ import annotations

import asyncio
from typing import Any

from jobtier.api.records import PostgresExtension
from jobtier.config import Settings
from jobtier.core.model import QueueLimits, State
from jobtier.engine.queue import Queue
from jobtier.persist.db import Pool
from jobtier.persist.persister import Persister
from jobtier.persist.schedule_store import ScheduleStore
from jobtier.scheduler import Scheduler
from tests.fixtures.api import ADMIN, KEYS, ApiServer, StartApi
from tests.fixtures.engine import Background, wait_for, worker_for
from tests.tasks import registry


async def test_a_submit_takes_its_tasks_queue_and_attempts(api: ApiServer) -> None:
    async with api.client() as c:
        r = await c.post("/v1/jobs", json={"type": "thumbnail", "payload": {"url": "a.png"}})
        assert r.status_code == 202, r.text
        doc = r.json()
        assert doc["queue"] == "images" and doc["max_attempts"] == 5  # retries=4
        r = await c.post("/v1/jobs", json={"type": "flaky", "max_attempts": 2, "queue": "other"})
        assert (r.json()["queue"], r.json()["max_attempts"]) == ("other", 2)


async def test_an_unknown_type_is_refused_naming_the_known_ones(api: ApiServer) -> None:
    async with api.client() as c:
        r = await c.post("/v1/jobs", json={"type": "chekcsum", "payload": {}})
        assert r.status_code == 422
        problem = r.json()
        assert problem["field"] == "type" and "chekcsum" in problem["detail"]
        assert "echo" in problem["detail"] and "JOBTIER_REQUIRE_KNOWN_TYPES" in problem["detail"]
        r = await c.post("/v1/jobs/batch", json={"jobs": [{"type": "echo"}, {"type": "nope"}]})
        assert r.status_code == 422 and r.json()["field"] == "jobs[1].type"


async def test_producers_may_deploy_before_their_workers(start_api: StartApi) -> None:
    api = await start_api(require_known_types=False)
    async with api.client() as c:
        r = await c.post("/v1/jobs", json={"type": "not_yet_deployed"})
        assert r.status_code == 202 and r.json()["queue"] == "default"


async def test_a_worker_that_starts_later_is_known_at_once(
    start_api: StartApi, queue: Queue
) -> None:
    api = await start_api(advertise=False)
    async with api.client() as c:
        assert (await c.post("/v1/jobs", json={"type": "echo"})).status_code == 422
        await worker_for(queue, registry, burst=True).run()  # advertises its tasks

        async def accepted() -> bool:
            # the catalogue looks again on a miss (at most once a second), not only on its
            # periodic refresh
            return (await c.post("/v1/jobs", json={"type": "echo"})).status_code == 202

        await wait_for(accepted, timeout=10, interval=0.2)


async def test_a_payload_that_does_not_fit_the_tasks_type_is_refused(
    api: ApiServer, queue: Queue
) -> None:
    async with api.client() as c:
        for payload, field, said in [
            ({"width": 3}, "payload.url", "required, and missing"),  # the missing field named
            ({"url": 7}, "payload.url", "7 is not of type"),
            ({"url": None}, "payload.url", "null is not of type"),  # JSON's word, not Python's
            ("a string", "payload", "is not of type 'object'"),
        ]:
            r = await c.post("/v1/jobs", json={"type": "thumbnail", "payload": payload})
            assert r.status_code == 422, (payload, r.text)
            assert r.json()["field"] == field, r.json()
            assert r.json()["detail"].startswith(f"{field}: ") and said in r.json()["detail"]
            assert "None" not in r.json()["detail"]
        r = await c.post("/v1/jobs", json={"type": "thumbnail", "payload": {"url": "b.png"}})
        job_id = r.json()["id"]
    await worker_for(queue, registry, burst=True).run()
    status, result = await queue.result(job_id)
    assert status.state is State.SUCCEEDED and result == {"url": "b.png", "width": 128}


async def test_admin_queue_routes(api: ApiServer, queue: Queue) -> None:
    async with api.client("admin") as admin, api.client() as c:
        await c.post("/v1/jobs", json={"type": "thumbnail", "payload": {"url": "x"}})
        r = await admin.post("/v1/admin/queues/images/pause")
        assert r.json() == {"queue": "images", "paused": True, "known": True}
        # a name nothing has named (a typo, or a queue before its first job): paused all the
        # same, and the answer says it was not known
        r = await admin.post("/v1/admin/queues/imgaes/pause")
        assert r.json() == {"queue": "imgaes", "paused": True, "known": False}
        r = await admin.post("/v1/admin/queues/imgaes/resume")  # listed while it was paused
        assert r.json() == {"queue": "imgaes", "paused": False, "known": True}
        r = await admin.put("/v1/admin/queues/images/limits", json={"concurrency": 2, "rate": 10})
        assert r.status_code == 200 and r.json()["limits"] == {"concurrency": 2, "rate": 10}
        states: dict[str, Any] = {
            q["name"]: q for q in (await admin.get("/v1/admin/queues")).json()["queues"]
        }
        images = states["images"]
        assert images["paused"] is True and images["queued_total"] == 1
        assert images["limits"] == {"concurrency": 2, "rate": 10}
        assert images["tasks"] == ["thumbnail"] and "default" in states
        assert (await admin.put("/v1/admin/queues/images/limits", json={})).json()["limits"] is None
        assert (await admin.post("/v1/admin/queues/images/resume")).json()["paused"] is False
        bad = await admin.put("/v1/admin/queues/images/limits", json={"concurrency": 0})
        assert bad.status_code == 422 and bad.json()["field"] == "concurrency"
        assert (await admin.post("/v1/admin/queues/no:colons/pause")).status_code == 422
        tasks = {t["type"]: t for t in (await admin.get("/v1/admin/tasks")).json()["tasks"]}
        assert tasks["thumbnail"]["queue"] == "images"
        assert tasks["thumbnail"]["payload_schema"]["$ref"].endswith("Thumbnail")
        assert tasks["flaky"]["max_attempts"] == 4 and tasks["flaky"]["payload_schema"] is None
        assert (await c.get("/v1/admin/queues")).status_code == 403  # a tenant key
    assert (await queue.admin.stats())["queues"]["images"]["paused"] is False


def queue_of(api: ApiServer) -> Queue:
    q: Queue = api.server.lifespan.state["queue"]
    return q


async def test_the_python_client_manages_queues(api: ApiServer) -> None:
    from jobtier.client import AsyncClient, Client

    async with AsyncClient(api.url, ADMIN) as admin, AsyncClient(api.url, KEYS["acme"]) as c:
        sub = await c.submit("thumbnail", {"url": "z"}, concurrency_key="acct-1")
        assert sub.job.queue == "images"
        await admin.pause_queue("images")
        await admin.set_queue_limits("images", concurrency=3)
        (images,) = [q for q in await admin.queues() if q.name == "images"]
        assert images.paused and images.limits == QueueLimits(concurrency=3)
        assert images.queued_total == 1 and images.tasks == ["thumbnail"]
        await admin.set_queue_limits("images")
        await admin.resume_queue("images")
        (images,) = [q for q in await admin.queues() if q.name == "images"]
        assert not images.paused and images.limits is None
        await queue_of(api).admin.block("images", 60)  # a task's RateLimited
        (images,) = [q for q in await admin.queues() if q.name == "images"]
        assert images.blocked_until is not None
        await admin.unblock_queue("images")
        (images,) = [q for q in await admin.queues() if q.name == "images"]
        assert images.blocked_until is None
        tasks = {t.type: t for t in await admin.tasks()}
        assert tasks["thumbnail"].max_attempts == 5
    with Client(api.url, ADMIN) as sync_admin:  # the sync mirror, in a thread
        names = await asyncio.to_thread(lambda: [q.name for q in sync_admin.queues()])
    assert "images" in names


async def test_listing_by_queue_and_schedules_fire_into_their_tasks_queue(
    start_api: StartApi, pg_settings: Settings, queue: Queue, pg_pool: Pool, background: Background
) -> None:
    api = await start_api(PostgresExtension(pg_settings), database_url=pg_settings.database_url)
    async with api.client() as c:
        await c.post("/v1/jobs", json={"type": "thumbnail", "payload": {"url": "a"}})
        await c.post("/v1/jobs", json={"type": "echo"})
        await Persister(pg_settings, queue.redis, pg_pool, "p").drain()
        r = await c.get("/v1/jobs", params={"queue": "images"})
        assert [(j["type"], j["queue"]) for j in r.json()["jobs"]] == [("thumbnail", "images")]
        assert (await c.get("/v1/jobs", params={"queue": "a:b"})).status_code in (400, 422)
        r = await c.post(
            "/v1/schedules",
            json={"name": "thumbs", "type": "thumbnail", "payload": {"url": "s"}, "interval": 1},
        )
        assert r.status_code == 201, r.text
        assert (r.json()["queue"], r.json()["max_attempts"]) == ("images", 5)
        bad = await c.post(
            "/v1/schedules", json={"name": "x", "type": "nope", "payload": {}, "interval": 1}
        )
        assert bad.status_code == 422 and bad.json()["field"] == "type"
    background.start(Scheduler(queue.store, schedules=ScheduleStore(pg_pool)))

    async def fired() -> bool:
        queued: int = (
            (await queue.admin.stats())["queues"]
            .get("images", {})
            .get("queued", {})
            .get("normal", 0)
        )
        return queued >= 2

    await wait_for(fired, timeout=30)
