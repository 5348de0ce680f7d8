"""Large results kept outside Redis (JOBTIER_RESULT_STORE=postgres): never in Redis, durable
before the success, served back byte for byte (from Redis's reference, then from Postgres's
record), followed by the client, and deleted with their job."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator
from typing import cast

import pytest

from jobtier.api.records import PostgresExtension
from jobtier.client import AsyncClient
from jobtier.config import Settings
from jobtier.core.errors import ConfigError
from jobtier.core.model import State, encode_json
from jobtier.dev.local_postgres import LocalPostgres
from jobtier.engine.queue import Queue
from jobtier.flows.resolver import Resolver
from jobtier.persist.db import Pool
from jobtier.persist.persister import Persister
from jobtier.persist.results import PostgresResultStore
from jobtier.worker import stored
from tests.fixtures.api import KEYS, ApiServer, StartApi
from tests.fixtures.engine import running, wait_for, worker_for
from tests.fixtures.postgres import postgres_processes
from tests.flows_helpers import run_flows
from tests.tasks import big_rows, registry

THRESHOLD = 1000
ROWS = 6000  # a result over 600 KB: more than two of the API's 256 KiB slices
BIG = big_rows(ROWS)


@pytest.fixture
def store_settings(pg_settings: Settings) -> Settings:
    return pg_settings.replace(result_store="postgres", result_store_threshold_bytes=THRESHOLD)


@pytest.fixture
async def store_queue(store_settings: Settings) -> AsyncIterator[Queue]:
    results = await PostgresResultStore.connect(store_settings.database_url)
    q = await Queue.connect(store_settings, results=results, catalog=False)
    yield q
    await q.close()
    await results.close()


@pytest.fixture
async def store_api(start_api: StartApi, store_settings: Settings) -> ApiServer:
    s = store_settings
    return await start_api(
        PostgresExtension(s), database_url=s.database_url, result_store=s.result_store,
        result_store_threshold_bytes=s.result_store_threshold_bytes,
    )  # fmt: skip


async def test_a_large_result_round_trips_without_sitting_in_redis(
    store_api: ApiServer, store_queue: Queue, pool: Pool, store_settings: Settings
) -> None:
    q = store_queue
    expected = encode_json(BIG)  # the bytes the worker encodes the task's result to
    assert len(expected) > 500_000
    async with store_api.client() as c:
        big = (await c.post("/v1/jobs", json={"type": "big_result", "payload": ROWS})).json()["id"]
        small = (await c.post("/v1/jobs", json={"type": "echo", "payload": [1]})).json()["id"]
        await worker_for(q, registry, burst=True).run()

        doc = (await c.get(f"/v1/jobs/{big}")).json()
        assert doc["state"] == "succeeded"
        assert doc["result_url"] == f"/v1/jobs/{big}/result/content"
        # Redis holds a reference, not the result
        held = cast(bytes | None, await q.redis.hget(q.keys.job(big), "result"))
        assert held is not None and held.startswith(b"@pg:") and len(held) < 100
        # the store had it before the success was reported (it is there now, and committed)
        stored = await pool.fetchval("SELECT data FROM result_blobs WHERE job_id = $1", big)
        assert bytes(stored) == expected

        r = await c.get(doc["result_url"])
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        assert r.content == expected  # byte for byte
        answer = (await c.get(f"/v1/jobs/{big}/result")).json()
        assert answer["result"] is None and answer["result_url"] == doc["result_url"]

        small_doc = (await c.get(f"/v1/jobs/{small}")).json()
        assert "result_url" not in small_doc  # under the threshold: in Redis, as before
        assert (await c.get(f"/v1/jobs/{small}/result/content")).content == b"[1]"

        # the client follows the link by itself
        async with AsyncClient(store_api.url, KEYS["acme"]) as client:
            assert (await client.result(big)).result == BIG
            assert (await client.result(small)).result == [1]
        assert (await q.result(big))[1] == BIG  # and so does the Python Queue

        # once Redis has forgotten the job, Postgres's record serves the same bytes
        persister = Persister(store_settings, q.redis, pool, "p1")
        await persister.drain()
        row = await pool.fetchrow("SELECT result, result_ref FROM jobs WHERE id = $1", big)
        assert row is not None
        assert row["result"] is None and row["result_ref"] == held[1:].decode()
        await q.redis.delete(q.keys.job(big))
        r = await c.get(f"/v1/jobs/{big}/result/content")
        assert r.status_code == 200 and r.content == expected
        answer = (await c.get(f"/v1/jobs/{big}/result")).json()
        assert answer["result_url"] == doc["result_url"]

        # retention: the result goes with its job
        await pool.execute("DELETE FROM jobs WHERE id = $1", big)
        assert await pool.fetchval("SELECT count(*) FROM result_blobs WHERE job_id = $1", big) == 0

        # another tenant sees none of it
        async with store_api.client("globex") as other:
            assert (await other.get(f"/v1/jobs/{small}/result/content")).status_code == 404


async def test_a_dependent_task_reads_a_stored_result_with_ctx_result(
    store_queue: Queue, store_settings: Settings
) -> None:
    """``ctx.dependencies`` and ``ctx.previous`` give a stored result as None (its link);
    ``await ctx.result(id)`` reads it from the store: in a worker that stores results itself,
    and in one that does not (through the reader it opens on JOBTIER_DATABASE_URL at start:
    its Queue was given no reader)."""
    q = store_queue
    big = (await q.submit("big_result", ROWS)).job_id
    small = (await q.submit("echo", [1])).job_id
    await worker_for(q, registry, burst=True).run()
    plain = await Queue.connect(store_settings.replace(result_store=""), catalog=False)
    try:
        for runner in (plain, q):  # a worker without a result store of its own, then with one
            dependent = (await q.submit("read_results", None, depends_on=[small, big])).job_id
            await Resolver(q.store, name="test-resolver").drain()  # its dependencies ended: queued
            assert (await q.status(dependent)).state is State.QUEUED
            stats = await worker_for(runner, registry, burst=True).run()
            assert stats.succeeded == 1
            status, out = await q.result(dependent)
            assert status.state is State.SUCCEEDED, status.error
            whole = {"rows": ROWS, "whole": True}
            assert out == {
                "by_id": {small: [1], big: whole}, "last": whole, "previous": None,
                "unknown": "KeyError",
            }  # fmt: skip
    finally:
        await plain.close()


async def test_a_result_an_attempt_stored_after_losing_its_lease_does_not_replace_the_winners(
    store_queue: Queue, pool: Pool, store_settings: Settings
) -> None:
    from jobtier.persist.results import PostgresResultStore

    store = PostgresResultStore(pool)
    winner = await store.put("job-1", 7, b'"the winner"')
    late = await store.put("job-1", 3, b'"a stale attempt"')  # written later, other token
    assert winner != late
    assert await store.get(winner) == b'"the winner"'
    assert [c async for c in store.stream(winner)] == [b'"the winner"']


async def test_a_queue_reads_stored_results_through_the_store_it_was_given(
    store_queue: Queue, store_settings: Settings, pool: Pool
) -> None:
    """The engine opens no Postgres pool of its own: a Queue given a result store reads a
    stored result through it (and None for one the store no longer holds); without one, a
    stored result is a ConfigError that says what to pass."""
    big = (await store_queue.submit("big_result", ROWS)).job_id
    await worker_for(store_queue, registry, burst=True).run()
    held = cast(bytes | None, await store_queue.redis.hget(store_queue.keys.job(big), "result"))
    assert held is not None and held.startswith(b"@")
    reader = await Queue.connect(store_settings, results=PostgresResultStore(pool), catalog=False)
    try:
        status, result = await reader.result(big)
        assert status.state == "succeeded" and result == BIG
        assert await reader.jobs.stored_result("pg:01JNOSUCHJOB000000000000000-0:1") is None
    finally:
        await reader.close()
    without = await Queue.connect(store_settings, catalog=False)
    try:
        with pytest.raises(ConfigError, match="results=PostgresResultStore"):
            await without.result(big)
    finally:
        await without.close()


async def test_a_dependencys_stored_result_reaches_its_dependent_as_its_link(
    store_api: ApiServer, store_queue: Queue, pool: Pool, store_settings: Settings
) -> None:
    """A flow hands a dependency's result to its dependent; a stored one goes as its link
    (the reference is not JSON), from Redis while it holds the dependent, then from Postgres."""
    q = store_queue
    url_of = "/v1/jobs/{}/result/content".format
    async with store_api.client() as c:
        big = (await c.post("/v1/jobs", json={"type": "big_result", "payload": ROWS})).json()["id"]
        r = await c.post("/v1/jobs", json={"type": "collect", "payload": 0, "depends_on": [big]})
        assert r.status_code == 202, r.text
        dependent = r.json()["id"]
        await run_flows(q)
        status, out = await q.result(dependent)
        assert status.state is State.SUCCEEDED  # its claim read the dependency's outcome
        assert out["dependencies"] == {big: ["succeeded", None, None]}
        (dep,) = (await c.get(f"/v1/jobs/{dependent}/dependencies")).json()["dependencies"]
        assert dep["state"] == "succeeded" and dep["result"] is None
        assert dep["result_url"] == url_of(big)
        assert (await c.get(dep["result_url"])).content == encode_json(BIG)

        # Redis forgets both jobs: Postgres's record says the same
        await Persister(store_settings, q.redis, pool, "p1").drain()
        await q.redis.delete(q.keys.job(big), q.keys.job(dependent))
        (dep,) = (await c.get(f"/v1/jobs/{dependent}/dependencies")).json()["dependencies"]
        assert dep["state"] == "succeeded" and dep["result"] is None
        assert dep["result_url"] == url_of(big)


async def ended(q: Queue, job: str) -> None:
    async def terminal() -> bool:
        return (await q.status(job)).terminal

    await wait_for(terminal, 60)


async def test_a_result_waits_for_its_store_while_postgres_is_away(
    pg_to_stop: LocalPostgres, pg_settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """The task did its work: its result waits for Postgres (the job kept, heartbeated) and
    the job succeeds once it is back. It failed at once (ResultStoreUnavailable), its work
    thrown away, dead-lettered with no retries left."""
    caplog.set_level(logging.WARNING, logger="jobtier.worker")
    settings = pg_settings.replace(
        database_url=pg_to_stop.dsn, result_store="postgres", result_store_threshold_bytes=THRESHOLD
    )
    results = await PostgresResultStore.connect(settings.database_url)
    q = await Queue.connect(settings, results=results, catalog=False)
    try:
        await asyncio.to_thread(pg_to_stop.stop, "immediate")
        job = (await q.submit("big_result", 50, max_attempts=1)).job_id
        async with running(worker_for(q, registry)):
            await wait_for(lambda: "event=result_store_waiting" in caplog.text, 60)
            assert (await q.status(job)).state is State.RUNNING
            await asyncio.to_thread(pg_to_stop.start)
            await ended(q, job)
        status, result = await q.result(job)
        assert status.state is State.SUCCEEDED and result == big_rows(50), status
    finally:
        await q.close()
        await results.close()


async def test_a_silent_result_store_is_waited_for_no_longer_than_the_patience(
    pg_to_stop: LocalPostgres, pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Postgres that answers nothing (its processes stopped) does not hold the job and its
    worker slot past the patience (here 1 s): the attempt fails as retryable."""
    monkeypatch.setattr(stored, "STORE_PATIENCE", 1.0)
    settings = pg_settings.replace(
        database_url=pg_to_stop.dsn, result_store="postgres", result_store_threshold_bytes=THRESHOLD
    )
    results = await PostgresResultStore.connect(settings.database_url)
    q = await Queue.connect(settings, results=results, catalog=False)
    await results.pool.fetchval("SELECT 1")  # a connection in the pool: the put takes it
    silent = postgres_processes(pg_to_stop)
    try:
        for pid in silent:
            os.kill(pid, signal.SIGSTOP)
        job = (await q.submit("big_result", 50, max_attempts=1)).job_id
        async with running(worker_for(q, registry)):
            await ended(q, job)
        status = await q.status(job)
        assert status.state is State.FAILED and status.error is not None, status
        assert status.error.type == "ResultStoreUnavailable", status.error
        # the put let go still holds its connection: closing (a worker's stop) ends anyway
        await asyncio.wait_for(results.close(), 30)
    finally:
        for pid in silent:
            os.kill(pid, signal.SIGCONT)
        await q.close()
        await results.close()


async def test_show_while_postgres_is_away_marks_a_stored_result_unavailable(
    pg_to_stop: LocalPostgres, pg_settings: Settings, start_api: StartApi
) -> None:
    """`jobtier jobs show` (Client.show) of a job whose result the store keeps, with the
    store's Postgres stopped: the status and log lines as Redis has them, the result and the
    history marked unavailable. It failed whole (the result's 503)."""
    s = pg_settings.replace(
        database_url=pg_to_stop.dsn, result_store="postgres", result_store_threshold_bytes=THRESHOLD
    )
    api = await start_api(
        PostgresExtension(s), database_url=s.database_url, result_store=s.result_store,
        result_store_threshold_bytes=s.result_store_threshold_bytes,
    )  # fmt: skip
    results = await PostgresResultStore.connect(s.database_url)
    q = await Queue.connect(s, results=results, catalog=False)
    try:
        job = (await q.submit("big_result", 50, tenant="acme")).job_id
        await worker_for(q, registry, burst=True).run()
        async with AsyncClient(api.url, KEYS["acme"]) as client:
            whole = await client.show(job)
            assert whole.result == big_rows(50) and whole.result_missing is None
            assert whole.history is not None
            # the result no longer kept (its store's record gone): said so, the rest shown
            await results.pool.execute("DELETE FROM result_blobs")
            gone = await client.show(job)
            assert gone.result is None and gone.history == whole.history
            assert gone.result_missing == "no longer kept in the result store"
            await asyncio.to_thread(pg_to_stop.stop, "immediate")
            away = await client.show(job)
        assert away.status == whole.status and away.lines == whole.lines
        assert away.result is None and away.history is None
        assert away.result_missing == "kept in the result store, which is away"
    finally:
        await q.close()
        await results.close()
