"""The HTTP API through a real server on a loopback port."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from jobtier.config import Settings
from jobtier.core.keys import Keys
from jobtier.core.model import State
from jobtier.dev.local_redis import LocalRedis
from jobtier.engine.queue import Queue
from jobtier.status.fastpath import StatusFastPath
from tests.fixtures.api import KEYS, ApiServer, StartApi
from tests.fixtures.engine import Background, wait_for, worker_for
from tests.tasks import registry


async def submit(client: httpx.AsyncClient, **body: object) -> dict[str, Any]:
    r = await client.post("/v1/jobs", json={"type": "echo", **body})
    assert r.status_code == 202, r.text
    return r.json()  # type: ignore[no-any-return]


async def test_submit_then_read_status_with_etag(api: ApiServer) -> None:
    async with api.client() as c:
        job = await submit(c, payload={"x": 1}, priority="high")
        assert job["state"] == "queued" and job["version"] == 1 and job["priority"] == "high"
        r = await c.get(f"/v1/jobs/{job['id']}")
        assert r.status_code == 200 and r.json() == job
        assert r.headers["etag"] == '"1"' and r.headers["content-type"] == "application/json"
        r = await c.get(f"/v1/jobs/{job['id']}", headers={"if-none-match": '"1"'})
        assert r.status_code == 304 and r.content == b"" and r.headers["etag"] == '"1"'
        r = await c.get(f"/v1/jobs/{job['id']}", headers={"if-none-match": 'W/"0", "1"'})
        assert r.status_code == 304
        r = await c.get(f"/v1/jobs/{job['id']}", headers={"if-none-match": '"0"'})
        assert r.status_code == 200


async def test_submit_with_delay_and_run_at(api: ApiServer) -> None:
    async with api.client() as c:
        delayed = await submit(c, delay=60)
        assert delayed["state"] == "scheduled" and delayed["run_at"]
        when = (datetime.now(UTC) + timedelta(days=30)).replace(microsecond=250_000)
        r = await c.post("/v1/jobs", json={"type": "echo", "run_at": when.isoformat()})
        assert r.status_code == 202 and r.json()["state"] == "scheduled"
        assert r.json()["run_at"] == when.strftime("%Y-%m-%dT%H:%M:%S.250Z")
        r = await c.post("/v1/jobs", json={"type": "echo", "run_at": "2030-01-01T00:00:00+00:00"})
        assert r.status_code == 422 and r.json()["field"] == "run_at"  # more than a year ahead


async def test_idempotency_key_header_and_body(api: ApiServer) -> None:
    async with api.client() as c:
        first = await c.post(
            "/v1/jobs", json={"type": "echo", "payload": 1}, headers={"idempotency-key": "k1"}
        )
        again = await c.post(
            "/v1/jobs", json={"type": "echo", "payload": 1, "idempotency_key": "k1"}
        )
        assert (first.status_code, again.status_code) == (202, 200)
        assert first.json()["id"] == again.json()["id"]
        conflict = await c.post(
            "/v1/jobs", json={"type": "echo", "payload": 2}, headers={"idempotency-key": "k1"}
        )
        assert conflict.status_code == 409
        problem = conflict.json()
        assert problem["type"] == "urn:jobtier:problem:idempotency-conflict"
        assert problem["job_id"] == first.json()["id"]
        assert conflict.headers["content-type"] == "application/problem+json"
        mismatch = await c.post(
            "/v1/jobs",
            json={"type": "echo", "idempotency_key": "a"},
            headers={"idempotency-key": "b"},
        )
        assert mismatch.status_code == 400


async def test_batch_submit(api: ApiServer) -> None:
    async with api.client() as c:
        await c.post(
            "/v1/jobs", json={"type": "echo", "payload": "x"}, headers={"idempotency-key": "dup"}
        )
        r = await c.post(
            "/v1/jobs/batch",
            json={"jobs": [
                {"type": "echo", "payload": 1},
                {"type": "echo", "payload": "x", "idempotency_key": "dup"},
                {"type": "echo", "payload": "y", "idempotency_key": "dup"},
                {"type": "sleep", "priority": "low", "delay": 30},
            ]},
        )  # fmt: skip
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["status"] for x in results] == [202, 200, 409, 202]
        assert results[0]["job"]["state"] == "queued" and results[3]["job"]["state"] == "scheduled"
        assert results[2]["problem"]["type"].endswith("idempotency-conflict")


async def test_cancel_result_and_worker_flow(
    api: ApiServer, queue: Queue, background: Background
) -> None:
    async with api.client() as c:
        queued = await submit(c)
        r = await c.post(f"/v1/jobs/{queued['id']}/cancel")
        assert (
            r.status_code == 200 and r.json()["state"] == "cancelled" and r.headers["etag"] == '"2"'
        )
        r = await c.post(f"/v1/jobs/{queued['id']}/cancel")
        assert r.status_code == 409 and r.json()["job"]["state"] == "cancelled"
        job = await submit(c, payload={"hello": "world"})
        r = await c.get(f"/v1/jobs/{job['id']}/result")
        assert r.status_code == 200 and r.json()["result"] is None and r.json()["state"] == "queued"
        background.start(worker_for(queue, registry))

        async def done() -> bool:
            state: str = (await c.get(f"/v1/jobs/{job['id']}")).json()["state"]
            return state == "succeeded"

        await wait_for(done)
        r = await c.get(f"/v1/jobs/{job['id']}/result")
        assert r.json()["result"] == {"hello": "world"} and r.json()["state"] == "succeeded"


async def test_the_result_of_a_job_gone_from_redis_is_not_made_up(
    api: ApiServer, queue: Queue
) -> None:
    """A finished job whose record Redis dropped (its retention over), on an API without
    Postgres: its last status may still be near-cached, but its result is not known, so the
    result read is a 404, as it is for the job then, not a document saying "no result"."""
    async with api.client() as c:
        job = await submit(c)
        assert (await c.post(f"/v1/jobs/{job['id']}/cancel")).status_code == 200
        assert (await c.get(f"/v1/jobs/{job['id']}")).json()["state"] == "cancelled"  # cached
        assert await queue.redis.delete(queue.keys.job(job["id"])) == 1
        r = await c.get(f"/v1/jobs/{job['id']}/result")
        assert r.status_code == 404, r.text


async def test_long_poll_wakes_on_change(api: ApiServer, queue: Queue) -> None:
    async with api.client() as c:
        job = await submit(c)
        etag = '"1"'
        poll = asyncio.create_task(
            c.get(f"/v1/jobs/{job['id']}?wait=20", headers={"if-none-match": etag})
        )
        await wait_for(lambda: api.reader.stats()["listeners"] == 1)  # the poll waits
        assert not poll.done()  # still waiting: nothing changed
        await queue.cancel(job["id"])
        r = await asyncio.wait_for(poll, 10)
        assert (
            r.status_code == 200 and r.json()["state"] == "cancelled" and r.headers["etag"] == '"2"'
        )
        # unchanged until the timeout: 304
        r = await c.get(f"/v1/jobs/{job['id']}?wait=0.3", headers={"if-none-match": '"2"'})
        assert r.status_code == 304
        for bad in ("-1", "abc", "1e9", "nan"):
            r = await c.get(f"/v1/jobs/{job['id']}?wait={bad}", headers={"if-none-match": '"2"'})
            assert r.status_code == 400, bad


async def test_tenants_are_isolated(api: ApiServer) -> None:
    async with api.client("acme") as acme, api.client("globex") as globex:
        job = await submit(acme)
        unknown = f"{job['id'][:-2]}-0"
        for path in (
            f"/v1/jobs/{job['id']}",
            f"/v1/jobs/{job['id']}/result",
            f"/v1/jobs/{job['id']}/events",
        ):
            theirs = await globex.get(path)
            nobody = await globex.get(path.replace(job["id"], unknown))
            assert theirs.status_code == nobody.status_code == 404
            assert theirs.json()["detail"].replace(job["id"], "ID") == nobody.json()[
                "detail"
            ].replace(unknown, "ID")
        assert (await globex.post(f"/v1/jobs/{job['id']}/cancel")).status_code == 404
        assert (await acme.get(f"/v1/jobs/{job['id']}")).json()["state"] == "queued"


async def test_auth_is_required(api: ApiServer) -> None:
    async with api.client(None) as anon, api.client("acme") as acme:
        r = await anon.get("/v1/jobs/x")
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
        r = await anon.post(
            "/v1/jobs", json={"type": "echo"}, headers={"authorization": "Bearer nope"}
        )
        assert r.status_code == 401
        assert (await anon.get("/healthz")).status_code == 200
        assert (await acme.get("/v1/admin/stats")).status_code == 403
        assert (
            await anon.get("/v1/admin/stats", headers={"authorization": "Bearer nope"})
        ).status_code == 401


async def test_admin_dead_letters_replay_and_stats(api: ApiServer, queue: Queue) -> None:
    queue.produce.tasks = registry
    async with api.client() as c, api.client("admin") as admin:
        job = await submit(c, type="fail", payload={"fatal": True})
        await worker_for(queue, registry, burst=True).run()
        r = await admin.get("/v1/admin/dead-letters")
        assert r.status_code == 200 and [j["id"] for j in r.json()["jobs"]] == [job["id"]]
        assert (await admin.get("/v1/admin/dead-letters?type=echo")).json()["jobs"] == []
        assert (await admin.get("/v1/admin/dead-letters?limit=0")).status_code == 400
        r = await admin.post(f"/v1/admin/dead-letters/{job['id']}/replay")
        assert r.status_code == 200 and r.json()["state"] == "queued" and r.json()["attempt"] == 0
        assert (await admin.post(f"/v1/admin/dead-letters/{job['id']}/replay")).status_code == 409
        await worker_for(queue, registry, burst=True).run()
        r = await admin.post("/v1/admin/dead-letters/replay", json={"type": "fail"})
        assert r.status_code == 200 and r.json()["replayed"] == [job["id"]]
        stats = (await admin.get("/v1/admin/stats")).json()
        assert stats["total"]["queued"] == 1 and stats["waiting_by_tenant"] == {"acme": 1}
        assert stats["status_reads"]["requests"] >= 0


async def test_health_ready_and_openapi(api: ApiServer) -> None:
    async with api.client(None) as c:
        assert (await c.get("/readyz")).json()["checks"]["redis"] == "ok"
        doc = (await c.get("/v1/openapi.json")).json()
        assert doc["openapi"].startswith("3.1")
    described = {(path, method.upper()) for path, item in doc["paths"].items() for method in item}
    served = {
        (route.path, method)
        for route in cast(list[Route], api.app.routes)  # resources(): one Route per path
        for method in (route.methods or ())
        if method != "HEAD"
    }
    assert described == served


async def test_unknown_route_and_method_are_problems(api: ApiServer) -> None:
    async with api.client() as c:
        r = await c.get("/v1/nothing")
        assert r.status_code == 404 and r.json()["type"] == "urn:jobtier:problem:not-found"
        r = await c.delete("/v1/jobs")
        assert r.status_code == 405 and r.json()["type"] == "urn:jobtier:problem:method-not-allowed"


async def test_job_state_visible_while_running(
    api: ApiServer, queue: Queue, background: Background
) -> None:
    background.start(worker_for(queue, registry))
    async with api.client() as c:
        job = await submit(c, type="sleep", payload={"seconds": 30})

        async def running() -> bool:
            state: str = (await c.get(f"/v1/jobs/{job['id']}")).json()["state"]
            return state == State.RUNNING

        await wait_for(running)
        r = await c.post(f"/v1/jobs/{job['id']}/cancel")
        assert r.json()["cancel_requested"] is True and r.json()["state"] == "running"


async def test_status_reads_while_redis_is_down_are_503_then_recover(
    start_api: StartApi, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The status read is answered ahead of the router (StatusFastPath); a read that
    fails there still gets the API's problem, not a bare 500."""
    own = LocalRedis(tmp_path / "redis").start()
    try:
        api = await start_api(redis_url=own.url, near_cache=False)
        async with api.client() as c:
            job = (await c.post("/v1/jobs", json={"type": "echo"})).json()
            assert (await c.get(f"/v1/jobs/{job['id']}")).status_code == 200
            own.stop()
            caplog.set_level(logging.WARNING)
            r = await c.get(f"/v1/jobs/{job['id']}")
            assert r.status_code == 503 and r.headers["retry-after"]
            assert r.headers["content-type"] == "application/problem+json"
            assert "event=backend_unavailable" in caplog.text
            # handled, not re-raised to the server as an unhandled error
            assert not [rec for rec in caplog.records if rec.name.startswith("uvicorn")]
            own.start()  # AOF on: the job is still there
            r = await c.get(f"/v1/jobs/{job['id']}")
            assert r.status_code == 200 and r.json()["id"] == job["id"]
    finally:
        own.stop()


async def test_status_fast_path_answers_as_the_route_does(
    start_api: StartApi, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``GET /v1/jobs/{id}`` answered ahead of Starlette (app.JobtierApp, StatusFastPath)
    and through the router (``status_fast_path=False``): the same status, headers and body
    for every kind of status read, and the fast path answered the ones it takes."""
    answered: list[str] = []
    answer = StatusFastPath.answer

    async def counted(
        fast: StatusFastPath, scope: Scope, receive: Receive, send: Send, *read: Any
    ) -> None:
        answered.append(scope["path"])
        await answer(fast, scope, receive, send, *read)

    monkeypatch.setattr(StatusFastPath, "answer", counted)
    fast = await start_api()
    routed = await start_api(status_fast_path=False)
    async with fast.client() as c:
        own = await submit(c)
    async with fast.client("globex") as c:
        other = await submit(c)
    unknown = Keys(settings.prefix, settings.shards).new_id(0)
    own_path = f"/v1/jobs/{own['id']}"
    key = f"Bearer {KEYS['acme']}"
    # (path, headers, whether the fast path takes it)
    reads: list[tuple[str, dict[str, str], bool]] = [
        (own_path, {}, True),
        (own_path, {"if-none-match": '"1"'}, True),
        (own_path, {"if-none-match": 'W/"0", "1"'}, True),
        (own_path, {"if-none-match": "*"}, True),
        (own_path, {"if-none-match": '"0"'}, True),
        (own_path, {"authorization": f"bearer  {KEYS['acme']}"}, True),
        (f"/v1/jobs/{other['id']}", {}, True),  # another tenant's: 404
        (f"/v1/jobs/{unknown}", {}, True),
        ("/v1/jobs/not-an-id", {}, True),
        (own_path, {"authorization": "Bearer nope"}, False),  # 401
        (own_path, {"authorization": ""}, False),
        (own_path + "?wait=0", {"if-none-match": '"1"'}, False),
        (own_path + "?wait=-1", {}, False),  # 400
        (own_path + "/", {}, False),
        ("/v1/jobs/batch", {}, False),  # 405
        ("/v1/jobs/" + "x" * 5000, {}, False),  # 414
        (own_path, {"x-big": "y" * 9000}, False),  # 431
        (own_path, {f"x-{i}": "1" for i in range(70)}, False),  # 431
    ]
    outcomes: dict[str, list[tuple[int, list[tuple[str, str]], bytes]]] = {}
    for name, api in (("fast", fast), ("routed", routed)):
        async with httpx.AsyncClient(base_url=api.url, timeout=30) as c:
            outcomes[name] = []
            for path, headers, _ in reads:
                r = await c.get(path, headers={"authorization": key, **headers})
                kept = [  # a redirect names its server's own port
                    (k, v.replace(api.url, "<api>"))
                    for k, v in r.headers.multi_items()
                    if k not in ("date", "server")
                ]
                outcomes[name].append((r.status_code, kept, r.content))
    for read, by_fast, by_router in zip(reads, outcomes["fast"], outcomes["routed"], strict=True):
        assert by_fast == by_router, read
    statuses = [status for status, _, _ in outcomes["fast"]]
    assert statuses == [200, 304, 304, 304, 200, 200, 404, 404, 404, 401, 401, 304, 400,
                        307, 405, 414, 431, 431]  # fmt: skip
    assert answered == [path for path, _, taken in reads if taken]
