"""Job expiry through the HTTP API, the Python clients and an HTTP worker's claim
(docs/expiry.md)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from redis.asyncio import Redis

from jobtier.api import worker_claims
from jobtier.client import AsyncClient, Client, ValidationFailed
from jobtier.core.errors import InvalidRequest
from jobtier.core.keys import Keys
from tests.e2e.test_http_worker import claim_one, serve, status, worker_client
from tests.fixtures.api import KEYS, ApiServer, StartApi
from tests.fixtures.engine import wait_for
from tests.fixtures.redis import logged


def soon(seconds: float) -> str:
    return (datetime.now(UTC) + timedelta(seconds=seconds)).isoformat()


class In:
    """A time this many seconds from when the test runs (``soon``), not from when its
    cases were collected: a long run reaches them minutes later."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds


@asynccontextmanager
async def job_hash(api: ApiServer, job_id: str) -> AsyncIterator[tuple[Redis, str, str]]:
    """(a Redis client, the job's hash key, its shard's log) in the API's Redis."""
    keys = Keys(api.settings.prefix, api.settings.shards)
    redis = Redis.from_url(api.settings.redis_url)
    try:
        log = keys.log(keys.shard_of(job_id))
        yield redis, f"{log.rpartition('log')[0]}job:{job_id}", log
    finally:
        await redis.aclose()


async def hash_expiry(api: ApiServer, job_id: str) -> int | None:
    """The job's expiry as its Redis hash keeps it ('ex', ms), None for none."""
    async with job_hash(api, job_id) as (redis, key, _):
        got = await redis.hget(key, "ex")
    return None if got is None else int(got)


async def past_expiry(api: ApiServer, job_id: str) -> None:
    """Wait (for the clock, not a fixed time) until the job's expiry, which it has, passed."""
    ex = await hash_expiry(api, job_id)
    assert ex is not None

    def passed() -> bool:
        return datetime.now(UTC).timestamp() * 1000 > ex + 5  # this machine's Redis's clock

    await wait_for(passed, timeout=20)


async def test_a_submit_with_an_expiry_is_accepted_and_kept(api: ApiServer) -> None:
    async with api.client() as c:
        r = await c.post("/v1/jobs", json={"type": "echo", "expires_in": 300})
        assert r.status_code == 202, r.text
        assert r.json()["state"] == "queued"
        kept = await hash_expiry(api, r.json()["id"])
        assert kept is not None
        created = datetime.fromisoformat(r.json()["created_at"]).timestamp() * 1000
        assert 299_000 <= kept - created <= 301_000
        at = soon(3600)
        r = await c.post("/v1/jobs", json={"type": "echo", "expires_at": at})
        assert r.status_code == 202, r.text
        assert await hash_expiry(api, r.json()["id"]) == round(
            datetime.fromisoformat(at).timestamp() * 1000
        )
        jobs = [{"type": "echo", "expires_in": 60}, {"type": "echo"}]
        r = await c.post("/v1/jobs/batch", json={"jobs": jobs})
        assert r.status_code in (200, 202, 207), r.text


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"expires_in": 60, "expires_at": In(3600)}, "expires_at"),
        ({"expires_in": 0}, "expires_in"),
        ({"expires_in": "soon"}, "expires_in"),
        ({"expires_at": In(-60)}, "expires_at"),
        ({"expires_at": "2030-01-01T00:00:00"}, "expires_at"),
        ({"expires_in": 10**9}, "expires_in"),
        ({"expires_in": 30, "delay": 60}, "expires_in"),
        ({"expires_at": In(60), "run_at": In(120)}, "expires_at"),
        ({"expires_in": 60, "unique": {"key": "u"}}, "expires_in"),
    ],
)
async def test_bad_expiries_are_422s_naming_the_field(
    api: ApiServer, body: dict[str, Any], field: str
) -> None:
    body = {k: soon(v.seconds) if isinstance(v, In) else v for k, v in body.items()}
    async with api.client() as c:
        r = await c.post("/v1/jobs", json={"type": "echo", **body})
        assert r.status_code == 422, r.text
        assert r.json()["field"] == field
        r = await c.post(
            "/v1/jobs/batch", json={"jobs": [{"type": "echo"}, {"type": "echo", **body}]}
        )
        assert r.status_code == 422, r.text
        assert r.json()["field"] == f"jobs[1].{field}"
        # a flow's jobs take none: an unknown member
        flow = {"jobs": [{"ref": "a", "type": "echo", "expires_in": 60}]}
        r = await c.post("/v1/flows", json=flow)
        assert r.status_code in (400, 422), r.text


async def test_the_python_clients_send_an_expiry(api: ApiServer) -> None:
    async with AsyncClient(api.url, KEYS["acme"], retries=0) as c:
        by_seconds = await c.submit("echo", 1, expires=120)
        by_delta = await c.submit("echo", 2, expires=timedelta(minutes=2))
        at = datetime.now(UTC) + timedelta(hours=1)
        by_time = await c.submit("echo", 3, expires=at)
        with pytest.raises(ValidationFailed) as refused:
            await c.submit("echo", 4, expires=-5)
        assert refused.value.field == "expires_in"
        # JSON has no NaN nor infinity (msgspec would send null: no expiry, no delay)
        for bad in (float("nan"), float("inf")):
            with pytest.raises(InvalidRequest) as local:
                await c.submit("echo", 6, expires=bad)
            assert local.value.field == "expires_in"
            with pytest.raises(InvalidRequest) as local:
                await c.submit("echo", 6, delay=bad)
            assert local.value.field == "delay"
    for job in (by_seconds, by_delta):
        kept = await hash_expiry(api, job.id)
        created = datetime.fromisoformat(job.job.created_at).timestamp() * 1000
        assert kept is not None and 119_000 <= kept - created <= 121_000
    assert await hash_expiry(api, by_time.id) == round(at.timestamp() * 1000)

    def sync() -> str:
        with Client(api.url, KEYS["acme"], retries=0) as c:
            return c.submit("echo", 5, expires=timedelta(seconds=30)).id

    assert await hash_expiry(api, await asyncio.to_thread(sync)) is not None


async def test_an_http_workers_claim_cancels_an_expired_job_and_takes_the_next(
    start_api: StartApi,
) -> None:
    api = await serve(start_api)
    async with api.client() as c:
        r = await c.post(
            "/v1/jobs", json={"type": "http.add", "payload": {"a": 1, "b": 1}, "expires_in": 0.2}
        )
        assert r.status_code == 202, r.text
        stale = r.json()["id"]
        r = await c.post("/v1/jobs", json={"type": "http.add", "payload": {"a": 2, "b": 2}})
        fresh = r.json()["id"]
    await past_expiry(api, stale)
    async with worker_client(api) as w:
        job = await claim_one(w)
        assert job["id"] == fresh  # never the expired one
        # a claim reaches the other shard too, once the first holds nothing ready
        r = await w.post("/v1/worker/claim", json={"worker": "w1", "types": ["http.add"]})
        assert r.status_code == 200 and r.json()["jobs"] == [], r.text
    doc = await status(api, stale)
    assert doc["state"] == "cancelled" and doc["error"]["type"] == "Expired", doc
    async with job_hash(api, stale) as (redis, _, log):
        mine = [f for f in await logged(redis, log) if stale.encode() in f[b"d"]]
    assert (mine[-1][b"fr"], mine[-1][b"w"]) == (b"queued", b"expiry")
    assert b'"state":"cancelled"' in mine[-1][b"d"]


async def test_an_http_workers_claim_behind_more_expired_jobs_than_a_call_cancels(
    start_api: StartApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    """501 expired jobs, then a fresh one, on one shard (one concurrency key): a claim script
    call cancels 500 at most and answers none. The long poll asks again at once and answers
    the fresh job. (Before, it looked again only at its idle look, here an hour, or at the
    end of its wait, which is all the claim would have taken.)"""
    monkeypatch.setattr(worker_claims, "IDLE_LOOK", 3600.0)
    api = await serve(start_api)
    key = {"concurrency_key": "one", "concurrency_limit": 1000}
    stale = [
        {"type": "http.add", "payload": {"a": i, "b": 0}, "expires_in": 0.2, **key}
        for i in range(501)
    ]
    async with api.client() as c:
        r = await c.post("/v1/jobs/batch", json={"jobs": stale})
        results = r.json()["results"]
        assert r.status_code == 200 and {x["status"] for x in results} == {202}
        last = results[-1]["job"]["id"]
        r = await c.post("/v1/jobs", json={"type": "http.add", "payload": {"a": 1, "b": 1}, **key})
        assert r.status_code == 202, r.text
        fresh = r.json()["id"]
    await past_expiry(api, last)
    wait = 20.0  # (the client's own timeout: 30 s)
    async with worker_client(api) as w:
        asked = time.monotonic()
        job = await claim_one(w, wait=wait)
    assert job["id"] == fresh and time.monotonic() - asked < wait / 2
    doc = await status(api, last)
    assert doc["state"] == "cancelled" and doc["error"]["type"] == "Expired", doc


async def test_a_jobs_own_timeout_reaches_an_http_worker(start_api: StartApi) -> None:
    """``timeout`` at a submit (docs/tasks.md): kept with the job and handed to the worker
    that claims it; bad ones are 422s naming the field."""
    api = await serve(start_api)
    async with api.client() as c:
        r = await c.post(
            "/v1/jobs", json={"type": "http.add", "payload": {"a": 1, "b": 2}, "timeout": 2.5}
        )
        assert r.status_code == 202, r.text
        given = r.json()["id"]
        for bad in (0, -1, "30", True, 10**9):
            r = await c.post("/v1/jobs", json={"type": "http.add", "timeout": bad})
            assert r.status_code == 422 and r.json()["field"] == "timeout", r.text
        r = await c.post(
            "/v1/jobs",
            json={"type": "http.add", "timeout": 5, "unique": {"key": "u"}},
        )
        assert r.status_code == 422 and r.json()["field"] == "timeout", r.text
    async with worker_client(api) as w:
        job = await claim_one(w)
        assert (job["id"], job["timeout"]) == (given, 2.5)

    def sync() -> str:
        with Client(api.url, KEYS["acme"], retries=0) as c:
            return c.submit("http.add", {"a": 1, "b": 1}, timeout=timedelta(seconds=7)).id

    plain = await asyncio.to_thread(sync)
    async with worker_client(api) as w:
        job = await claim_one(w)
        assert (job["id"], job["timeout"]) == (plain, 7)
