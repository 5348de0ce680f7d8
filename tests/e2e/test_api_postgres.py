"""The API with its Postgres part: expired jobs read from Postgres, listing, history, 503s."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from typing import cast

import asyncpg
import httpx
import pytest
from starlette.routing import Route

from jobtier.api.records import PostgresExtension
from jobtier.client import AsyncClient
from jobtier.config import Settings
from jobtier.dev.local_postgres import LocalPostgres
from jobtier.engine.queue import Queue
from jobtier.persist.db import Pool, create_pool
from jobtier.persist.persister import Persister
from tests.fixtures.api import KEYS, ApiServer, StartApi
from tests.fixtures.engine import wait_for, worker_for
from tests.fixtures.postgres import assert_pg_matches_redis, postgres_processes
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


class Readers:
    """Reads ``paths`` without pause, several at once, until stopped: every status answered,
    and that each 503 carried Retry-After."""

    def __init__(self, client: httpx.AsyncClient, paths: list[str], concurrent: int = 4) -> None:
        self.client = client
        self.paths = paths
        self.statuses: set[int] = set()
        self.answered = 0
        self._running = True
        self._tasks = [asyncio.create_task(self._run(n)) for n in range(concurrent)]

    async def _run(self, n: int) -> None:
        while self._running:
            r = await self.client.get(self.paths[n % len(self.paths)])
            self.answered += 1
            self.statuses.add(r.status_code)
            if r.status_code == 503:
                assert r.headers["retry-after"]

    async def stop(self) -> set[int]:
        self._running = False
        await asyncio.gather(*self._tasks)
        return self.statuses


async def test_postgres_stopped_under_the_api_is_a_503_not_a_500_until_it_is_back(
    start_api: StartApi, pg_settings: Settings, queue: Queue, pg_to_stop: LocalPostgres
) -> None:
    """A live Postgres stopped under a running API (``-m immediate``: a crash, connections
    reset) and started again: meanwhile Redis alone takes submits and answers what it holds,
    what only Postgres can answer is a 503 with Retry-After (never a 500), and readiness says
    why; once Postgres is back the same API answers from it again by itself, and Postgres
    holds every job as Redis does."""
    settings = pg_settings.replace(database_url=pg_to_stop.dsn)
    api = await start_api(PostgresExtension(settings), database_url=settings.database_url)
    pool = await create_pool(settings.database_url, min_size=0, max_size=2)  # the test's
    persister = Persister(settings, queue.redis, pool, "test-persister")
    readers: Readers | None = None
    try:
        async with api.client() as c:
            before = (await c.post("/v1/jobs", json={"type": "echo", "payload": 1})).json()
            await worker_for(queue, registry, burst=True).run()
            await persister.drain()
            assert [j["id"] for j in (await c.get("/v1/jobs")).json()["jobs"]] == [before["id"]]
            assert (await c.get(f"/v1/jobs/{queue.keys.new_id()}")).status_code == 404
            assert (await c.get("/readyz")).status_code == 200  # its pool holds a connection

            readers = Readers(c, ["/v1/jobs", f"/v1/jobs/{queue.keys.new_id()}"])
            await wait_for(lambda: readers.answered >= 20)  # reads in flight at the stop
            await asyncio.to_thread(pg_to_stop.stop, "immediate")
            during = await c.post("/v1/jobs", json={"type": "echo", "payload": 2})
            assert during.status_code == 202  # Redis alone takes submits
            during_id = during.json()["id"]
            assert (await c.get(f"/v1/jobs/{during_id}")).status_code == 200
            for path in (  # what only Postgres could answer
                f"/v1/jobs/{queue.keys.new_id()}",
                "/v1/jobs",
                f"/v1/jobs/{before['id']}/history",
            ):
                r = await c.get(path)
                assert r.status_code == 503 and r.headers["retry-after"], (path, r.text)
            # `jobtier jobs show`: what Redis has, the history marked unavailable (it failed whole)
            async with AsyncClient(api.url, KEYS["acme"]) as jobs:
                details = await jobs.show(during_id)
            assert details.status.id == during_id and details.history is None
            # still ready (submits and status reads go on), Postgres reported as away
            ready = await c.get("/readyz")
            assert ready.status_code == 200 and ready.json()["status"] == "degraded"
            assert ready.json()["checks"]["postgres"].startswith("unreachable")

            await asyncio.to_thread(pg_to_stop.start)

            async def answers_from_postgres() -> bool:
                return (await c.get("/v1/jobs")).status_code == 200

            await wait_for(answers_from_postgres, timeout=30)
            statuses = await readers.stop()
            assert statuses <= {200, 404, 503} and 503 in statuses, statuses
            assert (await c.get(f"/v1/jobs/{queue.keys.new_id()}")).status_code == 404
            assert (await c.get("/readyz")).status_code == 200
            await worker_for(queue, registry, burst=True).run()
            await persister.drain()
            listed = [j["id"] for j in (await c.get("/v1/jobs")).json()["jobs"]]
            assert listed == [during_id, before["id"]]
        await assert_pg_matches_redis(queue.redis, pool, queue.keys, [before["id"], during_id])
    finally:
        if readers is not None:
            await readers.stop()  # (again) on a failure: no request left running
        await pool.close()


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


async def test_readiness_waits_for_the_migrations_and_reports_a_silent_postgres(
    start_api: StartApi, pg_settings: Settings, pg_to_stop: LocalPostgres
) -> None:
    """Not ready while this jobtier's migrations are missing (a new image before `jobtier
    migrate`); ready, reported degraded, while Postgres does not answer at all (its
    processes stopped: no refusal, only silence), well within a probe's 3 s."""
    settings = pg_settings.replace(database_url=pg_to_stop.dsn)
    api = await start_api(PostgresExtension(settings), database_url=settings.database_url)
    conn = await asyncpg.connect(pg_to_stop.dsn)
    try:
        newest = await conn.fetchval("SELECT max(name) FROM schema_migrations")
        row = await conn.fetchrow("SELECT * FROM schema_migrations WHERE name = $1", newest)
        assert row is not None
        await conn.execute("DELETE FROM schema_migrations WHERE name = $1", newest)
        async with api.client() as c:
            r = await c.get("/readyz")
            assert r.status_code == 503, r.text
            assert r.json()["checks"]["postgres"].startswith("migrations not applied")
        await conn.execute(
            f"INSERT INTO schema_migrations ({', '.join(row.keys())}) VALUES "
            f"({', '.join(f'${i + 1}' for i in range(len(row)))})",
            *row.values(),
        )
        async with api.client() as c:
            assert (await c.get("/readyz")).status_code == 200
    finally:
        await conn.close()
    stopped = postgres_processes(pg_to_stop)
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    try:
        async with api.client() as c:  # (the readiness probe waited on Postgres: no answer)
            r = await c.get("/readyz")
        assert r.status_code == 200 and r.json()["status"] == "degraded", r.text
        assert r.json()["checks"]["postgres"].startswith("unreachable: no answer within")
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
