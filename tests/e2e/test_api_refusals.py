"""Requests a review of the API found answered wrongly — a 500, a 503 telling the client to
retry what will never pass, a 2xx for a request that does not do what it says, a stream
that never ends — each answered now as the docs say, changing nothing it should not."""

from __future__ import annotations

import asyncio

import pytest

from jobtier.client import AsyncClient
from jobtier.engine.queue import Queue
from tests.e2e.test_api_bad_input import snapshot
from tests.e2e.test_http_worker import claim_one, lease, serve, submit, worker_client
from tests.e2e.test_sse import read_events
from tests.fixtures.api import ADMIN, ApiServer, StartApi


async def test_a_worker_key_elsewhere_is_a_403_naming_the_routes_it_serves(
    start_api: StartApi,
) -> None:
    api = await serve(start_api)
    async with worker_client(api) as w:
        for path in ("/v1/jobs/01M952RK1FKMEBM4Z7A6EPN1TV-5", "/v1/admin/queues"):
            r = await w.get(path)
            assert r.status_code == 403, r.text  # was a 401, "unknown API key"
            assert "a worker key serves the /v1/worker routes only" in r.json()["detail"]
        r = await w.get(
            "/v1/jobs/01M952RK1FKMEBM4Z7A6EPN1TV-5",
            headers={"authorization": "Bearer nobody-knows-it"},
        )
        assert r.status_code == 401


async def test_log_lines_of_another_attempt_are_refused(start_api: StartApi) -> None:
    api = await serve(start_api)
    job_id = await submit(api, {"a": 1, "b": 2})
    async with worker_client(api) as w:
        job = await claim_one(w)
        url = f"/v1/worker/jobs/{job_id}/logs"
        r = await w.post(url, json=lease(job, attempt=999, lines=["not this attempt's"]))
        assert r.status_code == 422, r.text  # was a 200, the line stamped attempt 999
        assert (r.json()["field"], r.json()["attempt"]) == ("attempt", 1)
        r = await w.post(url, json=lease(job, attempt=1, lines=["this one's"]))
        assert r.status_code == 200, r.text
    async with api.client() as c:
        lines = (await c.get(f"/v1/jobs/{job_id}/logs")).json()["lines"]
    assert [(x["attempt"], x["message"]) for x in lines] == [(1, "this one's")]


async def test_a_claim_says_how_many_jobs_at_most_its_worker_runs(start_api: StartApi) -> None:
    api = await serve(start_api)
    async with worker_client(api) as w:
        body = {"worker": "w8", "types": ["http.add"], "running": 2**64 - 1}
        r = await w.post("/v1/worker/claim", json=body)
        assert r.status_code == 422 and r.json()["field"] == "running", r.text


async def test_a_rate_period_alone_does_not_lift_the_limits(api: ApiServer) -> None:
    async with api.client("admin") as admin:
        url = "/v1/admin/queues/lq9/limits"
        assert (await admin.put(url, json={"rate": 5, "per": 10})).status_code == 200
        r = await admin.put(url, json={"per": 60})
        assert r.status_code == 422 and r.json()["field"] == "rate", r.text  # was a lift
        queues = (await admin.get("/v1/admin/queues")).json()["queues"]
    (lq9,) = [q for q in queues if q["name"] == "lq9"]
    assert lq9["limits"] == {"rate": 5, "per": 10.0}
    # the client's lift with a period (its docstring: with neither, lift) still lifts
    async with AsyncClient(api.url, ADMIN) as client:
        await client.set_queue_limits("lq9", per=60)
        limited = [q for q in await client.queues() if q.limits is not None]
    assert "lq9" not in [q.name for q in limited]  # (a queue known by its limits alone)


async def test_a_concurrency_limit_needs_its_key(api: ApiServer, queue: Queue) -> None:
    before = await snapshot(queue)
    async with api.client() as c:
        r = await c.post("/v1/jobs", json={"type": "echo", "concurrency_limit": 3})
    assert r.status_code == 422 and r.json()["field"] == "concurrency_limit", r.text
    assert await snapshot(queue) == before


async def test_a_batch_takes_the_idempotency_key_header(api: ApiServer) -> None:
    body = {"type": "echo", "items": [1, 2]}
    async with api.client() as c:
        first = await c.post("/v1/batches", json=body, headers={"idempotency-key": "bk-hdr-7"})
        again = await c.post("/v1/batches", json=body, headers={"idempotency-key": "bk-hdr-7"})
        assert first.status_code == again.status_code == 202, again.text
        assert again.json()["id"] == first.json()["id"]  # was a second batch
        differ = await c.post(
            "/v1/batches",
            json=body | {"idempotency_key": "bk-body"},
            headers={"idempotency-key": "bk-hdr-7"},
        )
        assert differ.status_code == 400 and differ.json()["field"] == "idempotency_key"


async def test_a_stream_resumed_past_the_jobs_versions_ends_with_the_job(
    api: ApiServer, queue: Queue
) -> None:
    """A Last-Event-ID above every version the job has had: the stream sends nothing the
    client says it has, and ends when the job does (it stayed open for good)."""
    async with api.client() as c:
        job = (await c.post("/v1/jobs", json={"type": "echo"})).json()
        url = f"/v1/jobs/{job['id']}/events"
        async with c.stream("GET", url, headers={"last-event-id": "999"}) as r:
            assert r.status_code == 200
            reading = asyncio.create_task(read_events(r))
            await queue.cancel(job["id"])  # version 2, terminal
            async with asyncio.timeout(30):
                events = await reading
        assert [e for e in events if "data" in e] == []


async def test_text_postgres_cannot_hold_is_a_422(hook_api: ApiServer, queue: Queue) -> None:
    before = await snapshot(queue)
    async with hook_api.client() as c:
        hook = {"url": "http://127.0.0.1:1/x", "description": "a\u0000b"}
        r = await c.post("/v1/webhooks", json=hook)
        assert r.status_code == 422 and r.json()["field"] == "description", r.text  # a 500
        assert (await c.get("/v1/webhooks")).json()["webhooks"] == []
    async with hook_api.client("admin") as admin:
        r = await admin.post("/v1/admin/breakers/mail/open", json={"reason": "a\u0000b"})
        assert r.status_code == 422 and r.json()["field"] == "reason", r.text
    assert await snapshot(queue) == before


@pytest.mark.parametrize(
    ("changes", "field", "says"),
    [
        # a folder of zones, a name too long for a file: were 503s, "try again"
        ({"timezone": "America"}, "timezone", "unknown time zone"),
        ({"timezone": "Asia/" + "x" * 300}, "timezone", "unknown time zone"),
        # every field in range, no date matching: was a 500
        ({"cron": "0 0 30 2 *"}, "cron", "never fires"),
    ],
)
async def test_a_schedule_that_can_never_work_is_a_422(
    hook_api: ApiServer, changes: dict[str, str], field: str, says: str
) -> None:
    spec = {"name": "nightly", "type": "echo", "cron": "0 3 * * *", **changes}
    async with hook_api.client() as c:
        r = await c.post("/v1/schedules", json=spec)
        assert r.status_code == 422, r.text
        assert r.json()["field"] == field and says in r.json()["detail"], r.text
        r = await c.post("/v1/schedules", json=spec | {"paused": True})
        assert r.status_code == 422, r.text
        assert (await c.get("/v1/schedules")).json()["schedules"] == []
