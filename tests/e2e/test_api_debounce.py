"""Debounce and throttle through the HTTP API and the Python clients (docs/debounce-throttle.md),
on the single Redis and on the Redis Cluster."""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Any

import pytest

from jobtier.client import (
    AsyncClient,
    Client,
    RateLimited,
    UniqueHeld,
    ValidationFailed,
    WrongState,
)
from jobtier.core.model import State
from jobtier.engine.queue import Queue
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import TaskRegistry, task
from tests.fixtures.api import ADMIN, KEYS, ApiServer
from tests.fixtures.engine import Background, wait_for, worker_for

pytestmark = pytest.mark.contract  # on the single Redis and on the Redis Cluster


async def test_debounced_submits_answer_with_the_pending_jobs_id(api: ApiServer) -> None:
    body = {"type": "echo", "debounce": {"key": "user-1", "seconds": 60, "max_wait": 300}}
    async with api.client() as c:
        first = await c.post("/v1/jobs", json={**body, "payload": 1})
        assert first.status_code == 202, first.text
        job = first.json()
        assert job["state"] == "scheduled" and job["run_at"]
        again = await c.post("/v1/jobs", json={**body, "payload": 2})
        assert again.status_code == 200, again.text
        assert again.json()["id"] == job["id"]
        assert again.headers["location"] == f"/v1/jobs/{job['id']}"
        assert again.json()["version"] == job["version"] + 1
        polled = await c.get(f"/v1/jobs/{job['id']}")
        assert polled.json() == again.json()
        # another tenant's key of the same name is its own
        async with api.client("globex") as other:
            theirs = await other.post("/v1/jobs", json=body)
            assert theirs.status_code == 202 and theirs.json()["id"] != job["id"]


async def test_a_full_throttle_key_is_a_429_with_retry_after(api: ApiServer) -> None:
    throttle = {"key": "partner", "limit": 2, "period": 120}
    async with api.client() as c:
        for _ in range(2):
            r = await c.post("/v1/jobs", json={"type": "echo", "throttle": throttle})
            assert r.status_code == 202, r.text
        r = await c.post("/v1/jobs", json={"type": "echo", "throttle": throttle})
        assert r.status_code == 429, r.text
        assert 1 <= int(r.headers["retry-after"]) <= 120
        problem = r.json()
        assert problem["type"] == "urn:jobtier:problem:throttled"
        assert problem["field"] == "throttle"
        delayed = {**throttle, "on_limit": "delay"}
        r = await c.post("/v1/jobs", json={"type": "echo", "throttle": delayed})
        assert r.status_code == 202 and r.json()["state"] == "scheduled"


async def test_racing_http_submits_of_one_debounce_key_make_one_job(api: ApiServer) -> None:
    body = {"type": "echo", "debounce": {"key": "race", "seconds": 60}}
    async with api.client() as c:
        answers = await asyncio.gather(
            *(c.post("/v1/jobs", json={**body, "payload": i}) for i in range(20))
        )
    assert sorted(r.status_code for r in answers) == [200] * 19 + [202]
    assert len({r.json()["id"] for r in answers}) == 1


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"debounce": {"key": "k", "seconds": -1}}, "debounce.seconds"),
        ({"debounce": {"key": "k"}}, "debounce.seconds"),  # missing
        ({"debounce": {"key": "k", "seconds": 5, "max_wait": 2}}, "debounce.max_wait"),
        ({"debounce": {"key": "k", "seconds": 1e12}}, "debounce.seconds"),
        ({"debounce": {"key": "k", "seconds": 5, "colour": 1}}, "debounce.colour"),  # unknown
        ({"debounce": {"key": "k", "seconds": 5}, "delay": 1}, "debounce"),
        ({"throttle": {"key": "k", "limit": 1.5, "period": 1}}, "throttle.limit"),
        ({"throttle": {"key": "k", "limit": 1, "period": 1, "on_limit": "queue"}}, "throttle.on_limit"),
        ({"throttle": {"key": "", "limit": 1, "period": 1}}, "throttle.key"),
    ],
)  # fmt: skip
async def test_bad_options_are_422s_naming_the_member(
    api: ApiServer, queue: Queue, extra: dict[str, Any], field: str
) -> None:
    async with api.client() as c:
        r = await c.post("/v1/jobs", json={"type": "echo", **extra})
        assert r.status_code == 422, r.text
        assert r.json()["field"] == field
    for shard in range(queue.keys.shards):  # nothing was submitted
        assert await queue.redis.xlen(queue.keys.log(shard)) == 0


async def test_a_batch_refuses_a_keyed_job(api: ApiServer) -> None:
    jobs = [{"type": "echo"}, {"type": "echo", "throttle": {"key": "k", "limit": 1, "period": 1}}]
    async with api.client() as c:
        r = await c.post("/v1/jobs/batch", json={"jobs": jobs})
        assert r.status_code == 422 and r.json()["field"] == "jobs[1].throttle"
        r = await c.post("/v1/jobs/batch", json={"jobs": jobs[1:]})  # alone in it too
        assert r.status_code == 422 and r.json()["field"] == "jobs[0].throttle"


async def test_the_python_clients_pass_both_options(api: ApiServer) -> None:
    async with AsyncClient(api.url, KEYS["acme"], retries=0) as c:
        first = await c.submit("echo", 1, debounce={"key": "a", "seconds": 60})
        again = await c.submit("echo", 2, debounce={"key": "a", "seconds": 60})
        assert first.created and not again.created and again.id == first.id
        once = {"key": "t", "limit": 1, "period": 60}
        assert (await c.submit("echo", throttle=once)).created
        with pytest.raises(RateLimited) as refused:
            await c.submit("echo", throttle=once)
        assert refused.value.slug == "throttled" and refused.value.retry_after
        with pytest.raises(ValidationFailed):
            await c.submit("echo", debounce={"key": "a", "seconds": 0})

    # with an idempotency key a refused submit is safe to send again: the client waits for
    # Retry-After and does
    async with AsyncClient(api.url, KEYS["acme"], retries=2, max_retry_wait=5) as c:
        short = {"key": "short", "limit": 1, "period": 2}
        sooner = await c.submit("echo", 1, throttle=short, idempotency_key="s-1")
        later = await c.submit("echo", 2, throttle=short, idempotency_key="s-2")
        assert later.created
        waited = datetime.fromisoformat(later.job.created_at) - datetime.fromisoformat(
            sooner.job.created_at
        )
        assert waited.total_seconds() >= 2  # refused first, admitted once its slot came

    def sync() -> None:
        with Client(api.url, KEYS["acme"], retries=0) as c:
            got = c.submit("echo", 3, debounce={"key": "a", "seconds": 60})
            assert not got.created and got.id == first.id

    await asyncio.to_thread(sync)


async def test_unique_submits_answer_the_keys_unfinished_job(api: ApiServer) -> None:
    body = {"type": "echo", "unique": {"key": "doc-9"}}
    async with api.client() as c:
        first = await c.post("/v1/jobs", json={**body, "payload": 1})
        assert first.status_code == 202, first.text
        job = first.json()
        again = await c.post("/v1/jobs", json={**body, "payload": 2, "priority": "high"})
        assert again.status_code == 200, again.text
        assert again.json() == job  # that job, unchanged
        assert again.headers["location"] == f"/v1/jobs/{job['id']}"
        # a cancel ends it, and frees the key
        assert (await c.post(f"/v1/jobs/{job['id']}/cancel")).status_code == 200
        third = await c.post("/v1/jobs", json={**body, "payload": 3})
        assert third.status_code == 202 and third.json()["id"] != job["id"]
        bad = await c.post("/v1/jobs", json={**body, "idempotency_key": "i"})
        assert bad.status_code == 422 and bad.json()["field"] == "unique", bad.text
    async with AsyncClient(api.url, KEYS["acme"], retries=0) as client:
        made = await client.submit("echo", 1, unique={"key": "u", "until": "started"})
        same = await client.submit("echo", 2, unique={"key": "u", "until": "started"})
        assert made.created and not same.created and same.id == made.id

    def sync() -> None:
        with Client(api.url, KEYS["acme"], retries=0) as client:
            got = client.submit("echo", 3, unique={"key": "u"})
            assert not got.created and got.id == made.id

    await asyncio.to_thread(sync)


@task(name="broken_reindex", retries=0)
async def broken_reindex(ctx: JobContext, payload: Any) -> None:
    raise RuntimeError("fails for good")


async def test_a_replay_whose_unique_key_another_job_holds_is_unique_held(
    api: ApiServer, background: Background
) -> None:
    """The tenant's retry, the admin's replay and the client name the holder (409
    unique-held, a WrongState), and change nothing."""
    queue = await Queue.connect(api.settings, catalog=False)
    try:
        background.start(worker_for(queue, TaskRegistry([broken_reindex])))
        first = await queue.submit(broken_reindex, 1, tenant="acme", unique={"key": "re"})

        async def dead() -> bool:
            return (await queue.status(first.job_id)).state is State.FAILED

        await wait_for(dead)
        await background.stop()
        second = await queue.submit(
            broken_reindex, 2, tenant="acme", delay=3600, unique={"key": "re"}
        )
        assert second.created
    finally:
        await queue.close()
    async with api.client() as c:
        r = await c.post(f"/v1/jobs/{first.job_id}/retry")
        assert r.status_code == 409, r.text
        problem = r.json()
        assert problem["type"] == "urn:jobtier:problem:unique-held"
        assert problem["holder"] == second.job_id and second.job_id in problem["detail"]
        assert problem["job"]["state"] == "failed"
    async with api.client("admin") as admin:
        r = await admin.post(f"/v1/admin/dead-letters/{first.job_id}/replay")
        assert r.status_code == 409 and r.json()["holder"] == second.job_id, r.text
        # a replay by filter passes it over, and says so
        r = await admin.post("/v1/admin/dead-letters/replay", json={"type": "broken_reindex"})
        assert r.status_code == 200, r.text
        held = {"id": first.job_id, "holder": second.job_id, "why": "unique-held"}
        assert r.json() == {"replayed": [], "count": 0, "skipped": [held]}
    async with AsyncClient(api.url, ADMIN, retries=0) as admin_client:
        got = await admin_client.replay_dead_letters(type="broken_reindex")
        assert got == [] and [(s.id, s.holder) for s in got.skipped] == [
            (first.job_id, second.job_id)
        ]
    async with AsyncClient(api.url, KEYS["acme"], retries=0) as client:
        with pytest.raises(UniqueHeld) as refused:
            await client.retry(first.job_id)
        assert refused.value.holder == second.job_id
        assert isinstance(refused.value, WrongState) and refused.value.job is not None
        assert refused.value.job.state == "failed"  # unchanged
