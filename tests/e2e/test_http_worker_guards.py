"""The HTTP worker protocol's guards (api/worker_adverts.py, worker_bodies.py), against a
real API, Redis and Python worker: an HTTP advert cannot take over a live Python worker's
task nor switch its encryption or compensation off; an advertised backoff is bounded, and a
retry delay from any catalogue entry is clamped rather than a 500."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from typing import Any

import msgspec
import pytest

from jobtier.api.worker_bodies import MAX_BACKOFF_FACTOR, MAX_BACKOFF_SECONDS, retry_delay
from jobtier.config import Settings
from jobtier.core.model import Backoff, TaskAd
from jobtier.engine.catalog import publish
from jobtier.engine.queue import Queue
from jobtier.worker.registry import TaskRegistry, task
from tests.e2e.test_http_worker import TASK, claim_one, lease, serve, submit, worker_client
from tests.fixtures.api import ApiServer, StartApi
from tests.fixtures.engine import wait_for, worker_for

pytestmark = pytest.mark.contract
KEY = "k1:" + base64.b64encode(bytes(range(32))).decode()


@task(name="mixed.seal", encrypt=True, on_failure="mixed.undo")
async def seal(ctx: Any, payload: Any) -> None:
    return None


@task(name="mixed.undo")
async def undo(ctx: Any, payload: Any) -> None:
    return None


async def _entry(queue: Queue, type: str) -> TaskAd | None:
    raw = await queue.redis.hget(queue.keys.tasks(), type)
    return None if raw is None else msgspec.json.decode(raw, type=TaskAd)


async def test_an_http_advert_cannot_replace_a_live_python_workers_task(
    start_api: StartApi, settings: Settings
) -> None:
    api = await serve(start_api, encryption_keys=KEY)
    queue = await Queue.connect(settings.replace(encryption_keys=KEY), catalog=False)
    try:
        await _python_worker_then_http(api, queue)
    finally:
        await queue.close()


async def _python_worker_then_http(api: ApiServer, queue: Queue) -> None:
    worker = worker_for(queue, TaskRegistry([seal, undo]))
    running = asyncio.create_task(worker.run())
    advert = {"worker": "w1", "tasks": [{**TASK, "type": "mixed.seal", "queue": "other"}]}
    try:

        async def advertised() -> bool:
            ad = await _entry(queue, "mixed.seal")
            return ad is not None and ad.worker == worker.id

        await wait_for(advertised)
        async with worker_client(api) as w:
            r = await w.put("/v1/worker/tasks", json=advert)
        assert r.status_code == 409, r.text
        assert r.json()["field"] == "tasks[0].type" and "mixed.seal" in r.json()["detail"]
        ad = await _entry(queue, "mixed.seal")
        assert ad is not None
        assert (ad.worker, ad.encrypt, ad.on_failure, ad.queue) == (
            worker.id, True, "mixed.undo", "default",
        )  # fmt: skip
    finally:
        worker.stop()
        with contextlib.suppress(asyncio.CancelledError):
            async with asyncio.timeout(30):
                await running
    # the Python worker signed off: HTTP workers may take the type over, but an HTTP advert
    # never switches its encryption or compensation off
    async with worker_client(api) as w:
        r = await w.put("/v1/worker/tasks", json=advert)
    assert r.status_code == 200, r.text
    ad = await _entry(queue, "mixed.seal")
    assert ad is not None
    assert (ad.worker, ad.encrypt, ad.on_failure, ad.queue) == (
        "http:w1", True, "mixed.undo", "other",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("member", "value"), [("factor", 1e308), ("cap", 1e306), ("base", 1e306), ("factor", 0.5)]
)
async def test_an_advertised_backoff_out_of_bounds_is_a_422_naming_it(
    start_api: StartApi, queue: Queue, member: str, value: float
) -> None:
    api = await serve(start_api)
    before = await queue.redis.hget(queue.keys.tasks(), "http.add")
    bad = {**TASK, "backoff": {**TASK["backoff"], member: value}}  # type: ignore[dict-item]
    async with worker_client(api) as w:
        r = await w.put("/v1/worker/tasks", json={"worker": "w1", "tasks": [bad]})
    assert r.status_code == 422, r.text
    assert r.json()["field"] == f"tasks[0].backoff.{member}"
    assert await queue.redis.hget(queue.keys.tasks(), "http.add") == before


async def test_the_document_states_the_backoff_bounds(start_api: StartApi) -> None:
    api = await serve(start_api)
    async with api.client() as c:
        document = (await c.get("/v1/openapi.json")).json()
    props = document["components"]["schemas"]["RetryBackoff"]["properties"]
    assert props["factor"]["maximum"] == MAX_BACKOFF_FACTOR
    assert props["base"]["maximum"] == props["cap"]["maximum"] == MAX_BACKOFF_SECONDS


async def test_a_failure_under_a_huge_catalogued_backoff_is_retried_at_the_furthest_delay(
    start_api: StartApi, queue: Queue
) -> None:
    # an entry written before the bounds (or by a Python worker): figures past a float's range
    api = await serve(start_api)
    huge = TaskAd(
        type="http.add", queue="default", max_attempts=3,
        backoff=Backoff(1e306, 1e308, 1e306, 0.5), worker="http:old",
    )  # fmt: skip
    await publish(queue.redis, queue.keys, [msgspec.structs.replace(huge, seen_at=time.time())])
    async with worker_client(api) as w:
        # an advert reloads the API's catalogue at once (worker_routes.tasks)
        other = {"worker": "w9", "tasks": [{**TASK, "type": "http.other"}]}
        assert (await w.put("/v1/worker/tasks", json=other)).status_code == 200
        job_id = await submit(api, {"a": 1, "b": 2})
        job = await claim_one(w)
        error = {"type": "Error", "message": "boom"}
        r = await w.post(f"/v1/worker/jobs/{job_id}/fail", json=lease(job, error=error))
    assert r.status_code == 200, r.text
    assert r.json() == {"id": job_id, "state": "scheduled"}


def test_the_retry_delay_is_clamped_to_the_furthest_delay() -> None:
    most = 1000.0
    assert retry_delay(Backoff(1.0, 1e308, 1e306, 0.0), 5, most, 0.0) == most  # overflow
    assert retry_delay(Backoff(1e306, 2.0, 1e306, 1.0), 1, most, 0.999) == most
    assert retry_delay(Backoff(0.0, 1e308, 1e306, 0.0), 9, most, 0.0) == 0.0
    assert retry_delay(Backoff(1.0, 2.0, 300.0, 0.1), 3, most, 0.5) == pytest.approx(4.2)
