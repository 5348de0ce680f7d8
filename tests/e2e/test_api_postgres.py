"""The API with its Postgres part: expired jobs read from Postgres, listing, history, 503s."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import cast

import pytest
from starlette.routing import Route

from jobtier.api.records import PostgresExtension
from jobtier.config import Settings
from jobtier.engine.queue import Queue
from jobtier.persist.db import Pool
from jobtier.persist.persister import Persister
from tests.fixtures.api import ApiServer, StartApi
from tests.fixtures.engine import wait_for, worker_for
from tests.tasks import registry


@pytest.fixture
async def pg_api(start_api: StartApi, pg_settings: Settings) -> ApiServer:
    return await start_api(PostgresExtension(pg_settings), database_url=pg_settings.database_url)


@pytest.fixture
async def persister(pg_settings: Settings, queue: Queue, pg_pool: Pool) -> AsyncIterator[Persister]:
    yield Persister(pg_settings, queue.redis, pg_pool, "test-persister")


async def test_status_and_result_of_a_job_redis_no_longer_holds(
    pg_api: ApiServer,
    start_api: StartApi,
    pg_settings: Settings,
    queue: Queue,
    persister: Persister,
) -> None:
    async with pg_api.client() as c:
        job = (await c.post("/v1/jobs", json={"type": "echo", "payload": {"keep": "me"}})).json()
        await worker_for(queue, registry, burst=True).run()
        await persister.drain()
        final = (await c.get(f"/v1/jobs/{job['id']}")).json()
    assert final["state"] == "succeeded"
    await queue.redis.delete(queue.keys.job(job["id"]))  # as when its retention has passed
    # a second server: its near cache is empty, so only Postgres can answer
    fresh = await start_api(PostgresExtension(pg_settings), database_url=pg_settings.database_url)
    async with fresh.client("globex") as other:
        assert (await other.get(f"/v1/jobs/{job['id']}")).status_code == 404
    async with fresh.client() as c, fresh.client("admin") as admin:
        r = await c.get(f"/v1/jobs/{job['id']}")
        assert (
            r.status_code == 200
            and r.json() == final
            and r.headers["etag"] == f'"{final["version"]}"'
        )
        r = await c.get(f"/v1/jobs/{job['id']}/result")
        assert r.json()["result"] == {"keep": "me"} and r.json()["state"] == "succeeded"
        reads = (await admin.get("/v1/admin/stats")).json()["status_reads"]
        assert reads["fallback_loads"] >= 1


async def test_listing_and_history(pg_api: ApiServer, queue: Queue, persister: Persister) -> None:
    async with pg_api.client() as c, pg_api.client("globex") as globex:
        ids = [
            (await c.post("/v1/jobs", json={"type": "echo", "payload": i})).json()["id"]
            for i in range(7)
        ]
        await globex.post("/v1/jobs", json={"type": "echo"})
        failing = (
            await c.post("/v1/jobs", json={"type": "fail", "payload": {"fatal": True}})
        ).json()
        await worker_for(queue, registry, burst=True).run()
        await persister.drain()
        page = (await c.get("/v1/jobs?limit=5")).json()
        assert len(page["jobs"]) == 5 and page["next_cursor"]
        assert set(page["lag"]) == {"transitions", "seconds"}
        rest = (await c.get(f"/v1/jobs?limit=5&cursor={page['next_cursor']}")).json()
        listed = [j["id"] for j in page["jobs"] + rest["jobs"]]
        assert sorted(listed) == sorted([*ids, failing["id"]]) and rest["next_cursor"] is None
        failed = (await c.get("/v1/jobs?state=failed")).json()["jobs"]
        assert [j["id"] for j in failed] == [failing["id"]]
        assert (await c.get("/v1/jobs?type=fail")).json()["jobs"][0]["id"] == failing["id"]
        history = (await c.get(f"/v1/jobs/{failing['id']}/history")).json()
        assert [(t["from_state"], t["to_state"]) for t in history["transitions"]] == [
            (None, "queued"),
            ("queued", "running"),
            ("running", "failed"),
        ]
        assert (await globex.get(f"/v1/jobs/{failing['id']}/history")).status_code == 404
        for bad in (
            "limit=0",
            "limit=x",
            "state=done",
            "cursor=garbage",
            "created_after=yesterday",
            "colour=red",
        ):
            r = await c.get(f"/v1/jobs?{bad}")
            assert r.status_code == 400, bad
            assert r.headers["content-type"] == "application/problem+json"


async def test_postgres_down_is_a_503_not_a_500(
    start_api: StartApi, pg_settings: Settings, queue: Queue
) -> None:
    down = pg_settings.replace(database_url="postgresql://nobody@127.0.0.1:1/none")
    api = await start_api(PostgresExtension(down), database_url=down.database_url)
    async with api.client() as c:
        job = (await c.post("/v1/jobs", json={"type": "echo"})).json()  # Redis alone takes submits
        assert (await c.get(f"/v1/jobs/{job['id']}")).status_code == 200
        r = await c.get(f"/v1/jobs/{queue.keys.new_id()}")  # not in Redis: only Postgres could say
        assert r.status_code == 503 and r.headers["retry-after"]
        assert (await c.get("/v1/jobs")).status_code == 503
        ready = await c.get("/readyz")
        assert ready.status_code == 503 and ready.json()["checks"]["postgres"].startswith(
            "unreachable"
        )


async def test_openapi_describes_the_postgres_routes_too(pg_api: ApiServer) -> None:
    async with pg_api.client(None) as c:
        doc = (await c.get("/v1/openapi.json")).json()
    described = {(p, m.upper()) for p, item in doc["paths"].items() for m in item}
    served = {
        (route.path, method)
        for route in cast(list[Route], pg_api.app.routes)  # resources(): one Route per path
        for method in (route.methods or ())
        if method != "HEAD"
    }
    assert described == served


async def test_write_behind_lag_past_its_limit_turns_submits_away(
    start_api: StartApi, pg_settings: Settings, queue: Queue, persister: Persister
) -> None:
    api = await start_api(
        PostgresExtension(pg_settings), database_url=pg_settings.database_url, persist_max_lag=5
    )
    async with api.client() as c:
        for _ in range(6):  # six transitions wait for Postgres (no persister runs yet)
            assert (await c.post("/v1/jobs", json={"type": "echo"})).status_code == 202

        async def refused() -> bool:
            r = await c.post("/v1/jobs", json={"type": "echo"})
            return r.status_code == 503

        await wait_for(refused, timeout=10)  # once the lag is measured again (each second)
        r = await c.post("/v1/jobs", json={"type": "echo"})
        assert (
            r.status_code == 503 and r.headers["retry-after"] and "Postgres" in r.json()["detail"]
        )
        await persister.drain()  # the write-behind catches up

        async def accepted() -> bool:
            return (await c.post("/v1/jobs", json={"type": "echo"})).status_code == 202

        await wait_for(accepted, timeout=10)
