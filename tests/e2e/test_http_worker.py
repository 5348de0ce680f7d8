"""The HTTP worker protocol (api/worker_routes.py), black-box against a real API and Redis:
claims (and their long poll), leases, progress, log lines, outcomes, cancel notices, the
catalogue, and the fencing that refuses a stale worker's answers with a 409."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from typing import Any

import httpx
import pytest

from jobtier.api import worker_claims
from jobtier.core.model import Backoff, TaskAd
from jobtier.engine.catalog import publish
from jobtier.scheduler import Scheduler
from jobtier.store.calls import reclaim_call
from jobtier.streams.entries import parse_entries
from tests.fixtures.api import ApiServer, StartApi
from tests.fixtures.engine import Background, wait_for
from tests.fixtures.postgres import log_entries

pytestmark = pytest.mark.contract

WORKER_KEY = "wk-test"
TASK = {
    "type": "http.add",
    "queue": "default",
    "max_attempts": 2,
    "backoff": {"base": 0.01, "factor": 1, "cap": 0.01, "jitter": 0},
    "payload_schema": {
        "type": "object",
        "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
        "required": ["a", "b"],
    },
}


def worker_client(api: ApiServer, key: str = WORKER_KEY) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=api.url, headers={"authorization": f"Bearer {key}"}, timeout=30
    )


async def serve(start_api: StartApi, **overrides: Any) -> ApiServer:
    api = await start_api(worker_keys=f"other-key,{WORKER_KEY}", **overrides)
    async with worker_client(api) as w:
        r = await w.put("/v1/worker/tasks", json={"worker": "w1", "tasks": [TASK]})
        assert r.status_code == 200, r.text
    return api


async def submit(api: ApiServer, payload: Any, type: str = "http.add") -> str:
    async with api.client() as c:
        r = await c.post("/v1/jobs", json={"type": type, "payload": payload})
        assert r.status_code == 202, r.text
        job_id: str = r.json()["id"]
        return job_id


async def status(api: ApiServer, job_id: str) -> dict[str, Any]:
    async with api.client() as c:
        r = await c.get(f"/v1/jobs/{job_id}")
        assert r.status_code == 200, r.text
        doc: dict[str, Any] = r.json()
        return doc


async def claim_one(w: httpx.AsyncClient, worker: str = "w1", wait: float = 5) -> dict[str, Any]:
    r = await w.post(
        "/v1/worker/claim", json={"worker": worker, "types": ["http.add"], "wait": wait}
    )
    assert r.status_code == 200, r.text
    (job,) = r.json()["jobs"]
    return dict(job)


def lease(job: dict[str, Any], worker: str = "w1", **more: Any) -> dict[str, Any]:
    return {"worker": worker, "lease_version": job["lease_version"], **more}


async def test_a_job_runs_end_to_end_with_progress_and_log_lines(start_api: StartApi) -> None:
    api = await serve(start_api)
    job_id = await submit(api, {"a": 2, "b": 3})
    async with worker_client(api) as w:
        job = await claim_one(w)
        assert (job["id"], job["type"], job["payload"], job["attempt"]) == (
            job_id, "http.add", {"a": 2, "b": 3}, 1,
        )  # fmt: skip
        assert (await status(api, job_id))["state"] == "running"
        base = f"/v1/worker/jobs/{job_id}"
        r = await w.post(f"{base}/progress", json=lease(job, progress={"done": 1, "of": 2}))
        assert r.json() == {"cancel_requested": False, "lease_seconds": api.settings.lease_seconds}
        assert (await status(api, job_id))["progress"] == {"done": 1, "of": 2}
        r = await w.post(f"{base}/logs", json=lease(job, attempt=1, lines=["one", "two"]))
        assert r.json() == {"written": 2}
        r = await w.post(f"{base}/heartbeat", json=lease(job))
        assert r.status_code == 200 and r.json()["cancel_requested"] is False
        r = await w.post(f"{base}/complete", json=lease(job, result={"sum": 5}))
        assert r.json() == {"id": job_id, "state": "succeeded"}
    async with api.client() as c:
        result = (await c.get(f"/v1/jobs/{job_id}/result")).json()
        assert (result["state"], result["result"]) == ("succeeded", {"sum": 5})
        lines = (await c.get(f"/v1/jobs/{job_id}/logs")).json()["lines"]
        assert [(x["message"], x["attempt"]) for x in lines] == [("one", 1), ("two", 1)]


async def test_the_task_is_in_the_catalogue_and_its_schema_checks_submits(
    start_api: StartApi,
) -> None:
    api = await serve(start_api)
    async with api.client("admin") as admin:
        tasks = {t["type"]: t for t in (await admin.get("/v1/admin/tasks")).json()["tasks"]}
    ad = tasks["http.add"]
    assert (ad["queue"], ad["max_attempts"], ad["worker"]) == ("default", 2, "http:w1")
    assert ad["payload_schema"] == TASK["payload_schema"]
    async with api.client() as c:
        r = await c.post("/v1/jobs", json={"type": "http.add", "payload": {"a": 1}})
        assert r.status_code == 422 and r.json()["field"] == "payload.b"


async def test_a_stale_completion_is_refused_and_changes_nothing(start_api: StartApi) -> None:
    # a 1 s lease that nobody extends: the scheduler's reclaim (run here) requeues the job,
    # another worker claims it, and the first worker's late answers are refused
    api = await serve(start_api, lease_seconds=1)
    job_id = await submit(api, {"a": 1, "b": 1})
    queue = api.server.lifespan.state["queue"]
    shard = queue.keys.shard_of(job_id)
    async with worker_client(api) as w:
        first = await claim_one(w, "w1")

        async def requeued() -> bool:
            await queue.scripts.call_many([reclaim_call(shard, 10, 60, 60)])
            return bool((await status(api, job_id))["state"] == "queued")

        await wait_for(requeued)
        second = await claim_one(w, "w2")
        assert second["lease_version"] > first["lease_version"]
        before = await status(api, job_id)
        base = f"/v1/worker/jobs/{job_id}"
        for action, body in (
            ("complete", lease(first, result={"late": True})),
            ("fail", lease(first, error={"type": "Late", "message": "too late"})),
            ("heartbeat", lease(first, progress=0.5)),
            ("logs", lease(first, attempt=1, lines=["late"])),
            ("stopped", lease(first)),
        ):
            r = await w.post(f"{base}/{action}", json=body)
            assert r.status_code == 409, (action, r.text)
            assert r.json()["job_id"] == job_id
        after = await status(api, job_id)
        assert after == before  # same version: nothing changed
        # the worker whose lease it is still answers
        r = await w.post(f"{base}/complete", json=lease(second, "w2", result=2))
        assert r.json()["state"] == "succeeded"
    async with api.client() as c:
        assert (await c.get(f"/v1/jobs/{job_id}/logs")).json()["lines"] == []


async def test_failures_retry_by_the_backoff_then_dead_letter_with_the_traceback(
    start_api: StartApi,
) -> None:
    api = await serve(start_api)
    job_id = await submit(api, {"a": 1, "b": 2})
    trace = "Error: boom\n    at task (worker.mjs:1:1)"
    async with worker_client(api) as w:
        job = await claim_one(w)
        error = {"type": "Error", "message": "boom", "traceback": trace}
        r = await w.post(f"/v1/worker/jobs/{job_id}/fail", json=lease(job, error=error))
        assert r.json() == {"id": job_id, "state": "scheduled"}
        # the advertised backoff (10 ms): the scheduler's promote makes it ready again
        queue = api.server.lifespan.state["queue"]
        job = await _claim_after_promote(w, queue)
        assert job["attempt"] == 2
        r = await w.post(f"/v1/worker/jobs/{job_id}/fail", json=lease(job, error=error))
        assert r.json()["state"] == "failed"  # its two attempts are used
    doc = await status(api, job_id)
    assert doc["error"] == {"type": "Error", "message": "boom", "traceback": trace}


async def _claim_after_promote(w: httpx.AsyncClient, queue: Any) -> dict[str, Any]:
    from jobtier.store.calls import promote_call

    jobs: list[dict[str, Any]] = []

    async def claimed() -> bool:
        await queue.scripts.call_many([promote_call(s, 100) for s in range(queue.keys.shards)])
        r = await w.post("/v1/worker/claim", json={"worker": "w1", "types": ["http.add"]})
        jobs.extend(r.json()["jobs"])
        return bool(jobs)

    await wait_for(claimed)
    return jobs[0]


async def test_a_non_retryable_failure_dead_letters_at_once(start_api: StartApi) -> None:
    api = await serve(start_api)
    job_id = await submit(api, {"a": 1, "b": 2})
    async with worker_client(api) as w:
        job = await claim_one(w)
        body = lease(job, error={"type": "Fatal", "message": "no"}, retryable=False)
        r = await w.post(f"/v1/worker/jobs/{job_id}/fail", json=body)
        assert r.json()["state"] == "failed"
    assert (await status(api, job_id))["attempt"] == 1


async def test_a_held_attempt_is_retried_and_does_not_count(start_api: StartApi) -> None:
    """A worker that holds a job without running it (a rate limit of its own) gives the
    attempt back: the job is retried, its attempt not counted, logged as given back ('rf');
    held without a retry is refused and changes nothing."""
    api = await serve(start_api)
    job_id = await submit(api, {"a": 1, "b": 2})
    queue = api.server.lifespan.state["queue"]
    error = {"type": "RateLimited", "message": "429 from the partner"}
    async with worker_client(api) as w:
        job = await claim_one(w)
        assert job["attempt"] == 1
        body = lease(job, error=error, held=True, retryable=False)
        r = await w.post(f"/v1/worker/jobs/{job_id}/fail", json=body)
        assert r.status_code == 422 and r.json()["field"] == "held", r.text
        assert (await status(api, job_id))["state"] == "running"
        # its two attempts: held twice, it still runs twice
        for _ in range(2):
            r = await w.post(
                f"/v1/worker/jobs/{job_id}/fail", json=lease(job, error=error, held=True)
            )
            assert r.json() == {"id": job_id, "state": "scheduled"}, r.text
            job = await _claim_after_promote(w, queue)
            assert job["attempt"] == 1
        r = await w.post(f"/v1/worker/jobs/{job_id}/fail", json=lease(job, error=error))
        assert r.json()["state"] == "scheduled"  # an attempt used, one left
        job = await _claim_after_promote(w, queue)
        assert job["attempt"] == 2
    entries = []
    for shard, entry_id, fields in await log_entries(queue.redis, queue.keys):
        entries += parse_entries(shard, entry_id, fields)
    given_back = [e.refunded for e in entries if e.from_state == "running"]
    assert given_back == [True, True, False]


async def _blocked_until(queue: Any, name: str = "default") -> list[int]:
    """Each shard's end of the queue's block (ms since the epoch; 0: none)."""
    keys = queue.keys
    got = [
        await queue.redis.hget(keys.queue_counts(s), f"{name}:blocked") for s in range(keys.shards)
    ]
    return [int(v or 0) for v in got]


async def test_a_held_attempt_may_hold_its_queue_back_on_every_worker(
    start_api: StartApi,
) -> None:
    """``block_queue`` with a held attempt (a partner's 429): the job's queue starts no job for
    retry_in seconds on any shard, as after a Python task's RateLimited, and a limited queue's
    permits wait too; other queues are not held back; resume leaves it, unblock lifts it;
    without held or retry_in it is a 422 naming it, which changes nothing."""
    api = await serve(start_api)
    partner = {**TASK, "type": "http.partner", "queue": "partner-a"}
    queue = api.server.lifespan.state["queue"]
    error = {"type": "RateLimited", "message": "429 from the partner"}
    async with worker_client(api) as w, api.client("admin") as admin:
        r = await w.put("/v1/worker/tasks", json={"worker": "w1", "tasks": [TASK, partner]})
        assert r.status_code == 200, r.text
        first = await submit(api, {"a": 1, "b": 2}, type="http.partner")
        claim = {"worker": "w1", "types": ["http.partner"], "queues": ["partner-a"], "wait": 5}
        (job,) = (await w.post("/v1/worker/claim", json=claim)).json()["jobs"]
        url = f"/v1/worker/jobs/{first}/fail"
        for asked in ({}, {"held": True}, {"retry_in": 60}):
            r = await w.post(url, json=lease(job, error=error, block_queue=True, **asked))
            assert r.status_code == 422 and r.json()["field"] == "block_queue", (asked, r.text)
        assert (await status(api, first))["state"] == "running"
        assert set(await _blocked_until(queue, "partner-a")) == {0}
        # limited since the claim (HTTP workers take no job of a limited queue)
        r = await admin.put("/v1/admin/queues/partner-a/limits", json={"concurrency": 5})
        assert r.status_code == 200, r.text
        before = time.time()
        body = lease(job, error=error, held=True, block_queue=True, retry_in=60)
        r = await w.post(url, json=body)
        assert r.json() == {"id": first, "state": "scheduled"}, r.text
        after = time.time()
        ends = await _blocked_until(queue, "partner-a")  # each shard's, by its node's clock
        assert all(before * 1000 + 60_000 <= end <= after * 1000 + 60_000 for end in ends)
        permits_wait = await queue.redis.hget(queue.keys.limit("partner-a"), "blocked")
        assert before * 1000 + 60_000 <= int(permits_wait) <= after * 1000 + 60_000
        assert set(await _blocked_until(queue, "default")) == {0}  # its queue alone
        # no limit: another job of the queue is not claimed, though it is queued
        assert (await admin.put("/v1/admin/queues/partner-a/limits", json={})).status_code == 200
        second = await submit(api, {"a": 3, "b": 4}, type="http.partner")
        assert (await w.post("/v1/worker/claim", json=claim | {"wait": 0})).json()["jobs"] == []
        assert (await status(api, second))["state"] == "queued"
        # resume lifts a pause only; unblock lifts the block, and says its end: claimed
        assert (await admin.post("/v1/admin/queues/partner-a/resume")).status_code == 200
        assert await _blocked_until(queue, "partner-a") == ends
        r = await admin.post("/v1/admin/queues/partner-a/unblock")
        lifted = max(*ends, int(permits_wait)) / 1000  # the shards' ends and the permits'
        assert r.json() == {"queue": "partner-a", "blocked_until": lifted}, r.text
        assert set(await _blocked_until(queue, "partner-a")) == {0}
        (again,) = (await w.post("/v1/worker/claim", json=claim)).json()["jobs"]
        assert again["id"] == second
        r = await admin.post("/v1/admin/queues/partner-a/unblock")
        assert r.json() == {"queue": "partner-a", "blocked_until": None}, r.text


async def test_a_held_attempt_of_a_job_asked_to_cancel_says_so(start_api: StartApi) -> None:
    """A cancel request wins over a held attempt's retry; the error names the attempt that
    ran and says it was given back (not that attempt 0 failed)."""
    api = await serve(start_api)
    job_id = await submit(api, {"a": 1, "b": 2})
    async with worker_client(api) as w, api.client() as c:
        job = await claim_one(w)
        assert (await c.post(f"/v1/jobs/{job_id}/cancel")).status_code == 200
        error = {"type": "RateLimited", "message": "429 from the partner"}
        r = await w.post(
            f"/v1/worker/jobs/{job_id}/fail", json=lease(job, error=error, held=True, retry_in=1)
        )
        assert r.json() == {"id": job_id, "state": "cancelled"}, r.text
    doc = await status(api, job_id)
    assert doc["error"]["message"] == (
        "cancelled on request while running (attempt 1, which was then given back: RateLimited)"
    )


async def test_a_block_stands_whatever_became_of_the_lease(start_api: StartApi) -> None:
    """As a Python worker's RateLimited: a fail sent again after its answer was lost is
    refused (its first went through) and still blocks the queue. A job Redis does not keep
    (no queue to name), or one another worker holds, blocks nothing."""
    api = await serve(start_api)
    queue = api.server.lifespan.state["queue"]
    job_id = await submit(api, {"a": 1, "b": 2})
    error = {"type": "RateLimited", "message": "429 from the partner"}
    async with worker_client(api) as w:
        job = await claim_one(w)
        body = lease(job, error=error, held=True, block_queue=True, retry_in=60)
        missing = queue.keys.new_id(queue.keys.shard_of(job_id))  # well formed, not kept
        r = await w.post(f"/v1/worker/jobs/{missing}/fail", json=body)
        assert r.status_code == 404 and "not kept" in r.text, r.text
        r = await w.post(f"/v1/worker/jobs/{job_id}/fail", json=body | {"worker": "w2"})
        assert r.status_code == 409, r.text  # w1 holds it
        assert set(await _blocked_until(queue)) == {0}
        url = f"/v1/worker/jobs/{job_id}/fail"
        # the first send went through, its answer (and its block) lost
        r = await w.post(url, json=lease(job, error=error, held=True, retry_in=60))
        assert r.json()["state"] == "scheduled", r.text
        assert set(await _blocked_until(queue)) == {0}
        r = await w.post(url, json=body)
        assert r.status_code == 409, r.text
        assert all(end > 0 for end in await _blocked_until(queue))


async def test_a_cancel_request_reaches_the_worker_in_the_heartbeat_answer(
    start_api: StartApi,
) -> None:
    api = await serve(start_api)
    job_id = await submit(api, {"a": 1, "b": 2})
    async with worker_client(api) as w:
        job = await claim_one(w)
        async with api.client() as c:
            r = await c.post(f"/v1/jobs/{job_id}/cancel")
            assert r.json()["cancel_requested"] is True
        r = await w.post(f"/v1/worker/jobs/{job_id}/heartbeat", json=lease(job))
        assert r.json()["cancel_requested"] is True
        r = await w.post(f"/v1/worker/jobs/{job_id}/stopped", json=lease(job))
        assert r.json() == {"id": job_id, "state": "cancelled"}


async def test_a_stopped_job_without_a_cancel_goes_back_to_its_queue(start_api: StartApi) -> None:
    api = await serve(start_api)
    job_id = await submit(api, {"a": 1, "b": 2})
    async with worker_client(api) as w:
        job = await claim_one(w)
        r = await w.post(f"/v1/worker/jobs/{job_id}/stopped", json=lease(job))
        assert r.json()["state"] == "queued"
        again = await claim_one(w)
        assert again["id"] == job_id and again["attempt"] == 1  # the attempt did not count


async def test_a_waiting_claim_is_woken_by_a_submit(
    start_api: StartApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    # no safety-net look during the test: only the wake can hand the job over in time
    monkeypatch.setattr(worker_claims, "IDLE_LOOK", 3600.0)
    api = await serve(start_api)
    claims = api.server.lifespan.state["worker_claims"]
    async with worker_client(api) as w:
        body = {"worker": "w1", "types": ["http.add"], "count": 5, "wait": 30}
        waiting = asyncio.create_task(w.post("/v1/worker/claim", json=body))
        try:
            await wait_for(lambda: claims.waiting() == 1)
            job_id = await submit(api, {"a": 1, "b": 2})
            r = await asyncio.wait_for(waiting, 20)
        finally:
            waiting.cancel()
        assert [j["id"] for j in r.json()["jobs"]] == [job_id]
    assert claims.waiting() == 0


async def test_a_claim_takes_at_most_count_jobs_and_answers_empty_after_its_wait(
    start_api: StartApi,
) -> None:
    api = await serve(start_api)
    ids = {await submit(api, {"a": i, "b": i}) for i in range(7)}
    async with worker_client(api) as w:
        body = {"worker": "w1", "types": ["http.add"], "count": 4}
        first = (await w.post("/v1/worker/claim", json=body)).json()["jobs"]
        second = (await w.post("/v1/worker/claim", json=body)).json()["jobs"]
        assert len(first) == 4 and len(second) == 3
        assert {j["id"] for j in first + second} == ids
        r = await w.post("/v1/worker/claim", json={**body, "wait": 0.2})
        assert r.json()["jobs"] == []


async def test_worker_routes_need_a_worker_key(start_api: StartApi) -> None:
    api = await serve(start_api)
    body = {"worker": "w1", "types": ["http.add"]}
    async with httpx.AsyncClient(base_url=api.url) as anonymous:
        r = await anonymous.post("/v1/worker/claim", json=body)
        assert r.status_code == 401 and "www-authenticate" in r.headers
    async with api.client() as tenant:
        assert (await tenant.post("/v1/worker/claim", json=body)).status_code == 403
    async with api.client("admin") as admin:
        assert (await admin.post("/v1/worker/claim", json=body)).status_code == 403
    async with worker_client(api, "not-a-key") as stranger:
        assert (await stranger.post("/v1/worker/claim", json=body)).status_code == 401
    async with worker_client(api, "other-key") as second_key:
        assert (await second_key.post("/v1/worker/claim", json=body)).status_code == 200
    # an API with no worker keys says so, and which setting gives them
    keyless = await start_api(worker_keys="")
    async with worker_client(keyless) as w:
        r = await w.post("/v1/worker/claim", json=body)
        assert r.status_code == 401 and "JOBTIER_WORKER_KEYS" in r.json()["detail"], r.text


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"worker": "w 1", "types": ["http.add"]}, "worker"),
        ({"worker": "w1", "types": []}, "types"),
        ({"worker": "w1", "types": ["http.add"], "count": 0}, "count"),
        ({"worker": "w1", "types": ["http.add"], "wait": 3600}, "wait"),
        ({"worker": "w1", "types": ["http.add"], "queues": ["a b"]}, "queues[0]"),
        ({"worker": "w1", "types": ["http.add"], "extra": 1}, "extra"),  # unknown
    ],
)
async def test_a_bad_claim_is_a_422_naming_the_field_and_claims_nothing(
    start_api: StartApi, body: dict[str, Any], field: str | None
) -> None:
    api = await serve(start_api)
    job_id = await submit(api, {"a": 1, "b": 2})
    async with worker_client(api) as w:
        r = await w.post("/v1/worker/claim", json=body)
        assert r.status_code == 422, r.text
        assert r.json().get("field") == field
    assert (await status(api, job_id))["state"] == "queued"


async def test_bad_answers_are_refused_and_change_nothing(start_api: StartApi) -> None:
    api = await serve(start_api)
    job_id = await submit(api, {"a": 1, "b": 2})
    async with worker_client(api) as w:
        job = await claim_one(w)
        before = await status(api, job_id)
        base = f"/v1/worker/jobs/{job_id}"
        cases = [
            ("complete", {"worker": "w1", "lease_version": 0}, 422, "lease_version"),
            ("fail", lease(job, error={"message": "no type"}), 422, "error.type"),
            ("logs", lease(job, attempt=1, lines=[]), 422, "lines"),
            ("fail", lease(job, error={"type": "E"}, retry_in=10**9), 422, "retry_in"),
            (
                "complete",
                lease(job, result="x" * (api.settings.max_result_bytes + 1)),
                413,
                "result",
            ),
            ("complete", lease(job, "w2"), 409, None),  # another worker's id
            ("complete", lease(job) | {"lease_version": job["lease_version"] + 1}, 409, None),
        ]
        for action, body, code, field in cases:
            r = await w.post(f"{base}/{action}", json=body)
            assert r.status_code == code, (action, r.text)
            assert r.json().get("field") == field
        r = await w.post("/v1/worker/jobs/not-a-job/complete", json=lease(job))
        assert r.status_code == 404
        r = await w.put(
            "/v1/worker/tasks",
            json={"worker": "w1", "tasks": [{"type": "t", "payload_schema": {"type": 5}}]},
        )
        assert r.status_code == 422 and r.json()["field"] == "tasks[0].payload_schema"
    assert await status(api, job_id) == before


async def test_a_flow_jobs_claim_carries_its_dependencies_outcomes(
    start_api: StartApi, background: Background
) -> None:
    """A job that waited for others is claimed with their outcomes, in the order it named
    them (what ctx.dependencies is to a Python task): no tenant's key needed to read them."""
    api = await serve(start_api)
    background.start(Scheduler(api.server.lifespan.state["queue"].store))  # it resolves flows
    flow = {
        "jobs": [
            {"type": "http.add", "ref": "a", "payload": {"a": 1, "b": 2}},
            {"type": "http.add", "ref": "b", "payload": {"a": 3, "b": 4}},
            {"type": "http.add", "ref": "sum", "payload": {"a": 0, "b": 0}, "after": ["b", "a"]},
        ]
    }
    async with api.client() as c:
        r = await c.post("/v1/flows", json=flow)
        assert r.status_code == 202, r.text
        ids = [j["id"] for j in r.json()["jobs"]]
    async with worker_client(api) as w:
        for _ in range(2):
            job = await claim_one(w)
            assert job["dependencies"] is None  # it waited for none
            p = job["payload"]
            r = await w.post(
                f"/v1/worker/jobs/{job['id']}/complete", json=lease(job, result=p["a"] + p["b"])
            )
            assert r.status_code == 200, r.text
        last = await claim_one(w, wait=30)  # queued once the scheduler has resolved it
    assert last["id"] == ids[2]
    assert last["dependencies"] == [
        {"id": ids[1], "state": "succeeded", "result": 7, "error": None, "child": True,
         "result_url": None},
        {"id": ids[0], "state": "succeeded", "result": 3, "error": None, "child": True,
         "result_url": None},
    ]  # fmt: skip


async def test_a_claiming_worker_is_listed_live(start_api: StartApi) -> None:
    api = await serve(start_api)
    async with worker_client(api) as w:
        body = {"worker": "w9", "types": ["http.add"], "count": 3, "running": 1}
        assert (await w.post("/v1/worker/claim", json=body)).status_code == 200
    async with api.client("admin") as admin:
        workers = (await admin.get("/v1/admin/workers")).json()["workers"]
    (mine,) = [x for x in workers if x["id"] == "http:w9"]
    # its slots: the 3 free it asks to fill, and the 1 in use (was its count alone: a claim
    # for one free slot made a worker of one slot, and the scaling read 50 times too many)
    assert (mine["tasks"], mine["queues"], mine["concurrency"]) == (["http.add"], ["default"], 4)
    assert mine["running"] == 1
    # it leaves: unlisted at once, not a minute after its last claim
    async with worker_client(api) as w, api.client("admin") as admin, api.client() as tenant:
        assert (await tenant.post("/v1/worker/leave", json={"worker": "w9"})).status_code == 403
        r = await w.post("/v1/worker/leave", json={"worker": "w9 x"})
        assert r.status_code == 422 and r.json()["field"] == "worker", r.text
        workers = (await admin.get("/v1/admin/workers")).json()["workers"]
        assert [x["id"] for x in workers if x["id"] == "http:w9"] == ["http:w9"]  # unchanged
        r = await w.post("/v1/worker/leave", json={"worker": "w9"})
        assert r.status_code == 200 and r.json() == {"worker": "w9", "listed": True}, r.text
        workers = (await admin.get("/v1/admin/workers")).json()["workers"]
        assert not [x for x in workers if x["id"] == "http:w9"], workers
        r = await w.post("/v1/worker/leave", json={"worker": "w9"})
        assert r.json() == {"worker": "w9", "listed": False}, r.text
        # back again: its next claim lists it at once
        assert (await w.post("/v1/worker/claim", json={**body, "wait": 0})).status_code == 200
        workers = (await admin.get("/v1/admin/workers")).json()["workers"]
        assert [x["id"] for x in workers if x["id"] == "http:w9"] == ["http:w9"]


async def test_the_answers_match_the_document(start_api: StartApi) -> None:
    from tests.e2e.test_api_conformance import Checked

    api = await serve(start_api)
    async with api.client() as c:
        document = (await c.get("/v1/openapi.json")).json()
    check = Checked(document)
    ops = {
        (m.upper(), p) for p, item in document["paths"].items() for m in item if "/v1/worker/" in p
    }
    first, second = [await submit(api, {"a": i, "b": 1}) for i in range(2)]
    job_path = "/v1/worker/jobs/{job_id}/"
    async with worker_client(api) as w, api.client() as tenant:
        await check(w, "PUT", "/v1/worker/tasks", 200, json={"worker": "w1", "tasks": [TASK]})
        body = {"worker": "w1", "types": ["http.add"], "count": 2}
        r = await check(w, "POST", "/v1/worker/claim", 200, json=body)
        a, b = r.json()["jobs"]
        await check(tenant, "POST", "/v1/worker/claim", 403, json=body)
        await check(w, "POST", "/v1/worker/claim", 422, json={**body, "count": 0})
        for action, extra in (
            ("heartbeat", {}),
            ("progress", {"progress": 1}),
            ("logs", {"attempt": 1, "lines": ["x"]}),
        ):
            ids = {"job_id": a["id"]}
            await check(w, "POST", job_path + action, 200, ids=ids, json=lease(a, **extra))
            await check(w, "POST", job_path + action, 409, ids=ids, json=lease(a, "w2", **extra))
            await check(
                w, "POST", job_path + action, 404, ids={"job_id": "x"}, json=lease(a, **extra)
            )
        big = {"result": "x" * (api.settings.max_result_bytes + 1)}
        for ids, json in (({"job_id": a["id"]}, lease(a, **big)), ({"job_id": a["id"]}, lease(a))):
            await check(w, "POST", job_path + "complete", 413 if "result" in json else 200,
                        ids=ids, json=json)  # fmt: skip
        await check(w, "POST", job_path + "complete", 409, ids={"job_id": a["id"]}, json=lease(a))
        error = {"type": "E", "message": "m"}
        await check(w, "POST", job_path + "fail", 200, ids={"job_id": b["id"]},
                    json=lease(b, error=error, retryable=False))  # fmt: skip
        await check(w, "POST", job_path + "fail", 409, ids={"job_id": b["id"]},
                    json=lease(b, error=error))  # fmt: skip
        await check(w, "POST", job_path + "stopped", 409, ids={"job_id": b["id"]}, json=lease(b))
        many = {"worker": "w1", "jobs": [{"id": a["id"], "lease_version": a["lease_version"]}]}
        r = await check(w, "POST", "/v1/worker/complete", 200, json=many)
        assert r.json()["jobs"][0]["status"] == 409
        await check(w, "POST", "/v1/worker/complete", 422, json={"worker": "w1", "jobs": []})
        await check(w, "POST", "/v1/worker/leave", 200, json={"worker": "w1"})
        await check(w, "POST", "/v1/worker/leave", 422, json={})
    assert {first, second} == {a["id"], b["id"]}
    assert ops == {(m, t) for m, t, _ in check.seen}  # every worker route was driven


async def test_a_batch_of_completions_answers_each_job_and_refuses_the_stale_one(
    start_api: StartApi,
) -> None:
    api = await serve(start_api)
    ids = [await submit(api, {"a": i, "b": 1}) for i in range(5)]
    async with worker_client(api) as w:
        body = {"worker": "w1", "types": ["http.add"], "count": 5}
        jobs = {j["id"]: j for j in (await w.post("/v1/worker/claim", json=body)).json()["jobs"]}
        assert set(jobs) == set(ids)
        stale = ids[0]
        items = [
            {"id": i, "lease_version": jobs[i]["lease_version"] + (i == stale), "result": n}
            for n, i in enumerate(ids)
        ]
        unknown = api.server.lifespan.state["queue"].keys.new_id()
        extra = [dict(items[1]), {"id": unknown, "lease_version": 1}]  # twice; nobody's
        r = await w.post("/v1/worker/complete", json={"worker": "w1", "jobs": items + extra})
        answers = r.json()["jobs"]
        assert [a["id"] for a in answers] == [*ids, ids[1], unknown]  # in the request's order
        assert [a["status"] for a in answers] == [409, 200, 200, 200, 200, 409, 404]
        assert "lease lost" in answers[0]["detail"]
        # each refusal says what the job is now: the stale one still runs; the item given
        # twice finds the job succeeded under its own worker and attempt (as a result sent
        # again, its first reply lost, finds it); nothing of a job Redis does not keep
        now = [(a["state"], a["attempt"], a["worker"]) for a in answers]
        assert now[0] == ("running", 1, "http:w1") and now[5] == ("succeeded", 1, "http:w1")
        assert now[6] == (None, None, None)
    docs = {i: await status(api, i) for i in ids}
    assert docs[stale]["state"] == "running"  # the stale item changed nothing
    assert all(docs[i]["state"] == "succeeded" for i in ids[1:])


@pytest.mark.parametrize("bad", ["malformed", "too large"])
async def test_a_bad_item_refuses_the_whole_batch(start_api: StartApi, bad: str) -> None:
    api = await serve(start_api)
    ids = [await submit(api, {"a": i, "b": 1}) for i in range(2)]
    async with worker_client(api) as w:
        body = {"worker": "w1", "types": ["http.add"], "count": 2}
        jobs = (await w.post("/v1/worker/claim", json=body)).json()["jobs"]
        items = [{"id": j["id"], "lease_version": j["lease_version"]} for j in jobs]
        if bad == "malformed":
            items.append({"id": "nope", "lease_version": 1})
            code, field = 422, "jobs[2].id"
        else:
            items[1]["result"] = "x" * (api.settings.max_result_bytes + 1)
            code, field = 413, "jobs[1].result"
        r = await w.post("/v1/worker/complete", json={"worker": "w1", "jobs": items})
        assert (r.status_code, r.json()["field"]) == (code, field)
    assert [(await status(api, i))["state"] for i in ids] == ["running", "running"]


async def test_a_claim_whose_worker_hung_up_claims_nothing(
    start_api: StartApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a worker gone while its claim waited would leave what it claims to lease expiry
    monkeypatch.setattr(worker_claims, "IDLE_LOOK", 3600.0)
    api = await serve(start_api)
    claims = api.server.lifespan.state["worker_claims"]
    connections = api.server.server_state.connections
    async with worker_client(api) as w:
        body = {"worker": "w1", "types": ["http.add"], "wait": 30}
        waiting = asyncio.create_task(w.post("/v1/worker/claim", json=body))
        await wait_for(lambda: claims.waiting() == 1)
        open_before = len(connections)
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
    await wait_for(lambda: len(connections) < open_before)  # the server saw it go
    job_id = await submit(api, {"a": 1, "b": 2})  # wakes the claim
    await wait_for(lambda: claims.waiting() == 0)
    assert (await status(api, job_id))["state"] == "queued"


async def test_an_encrypted_queue_is_refused_to_http_workers(start_api: StartApi) -> None:
    """A claim or an advert naming an encrypted queue (JOBTIER_ENCRYPTED_QUEUES) is a 422
    naming it, and changes nothing: an HTTP claim that met one of its jobs would fail it."""
    key = "k1:" + base64.b64encode(bytes(range(32))).decode()
    api = await serve(start_api, encryption_keys=key, encrypted_queues="vault")
    async with api.client() as c:
        body = {"type": "http.add", "payload": {"a": 1, "b": 2}, "queue": "vault"}
        job_id = (await c.post("/v1/jobs", json=body)).json()["id"]
    async with worker_client(api) as w:
        claim = {"worker": "w1", "types": ["http.add"], "queues": ["default", "vault"]}
        r = await w.post("/v1/worker/claim", json=claim)
        assert r.status_code == 422 and r.json()["field"] == "queues", r.text
        assert "'vault' is an encrypted queue (JOBTIER_ENCRYPTED_QUEUES)" in r.json()["detail"]
        ad = {"worker": "w2", "tasks": [TASK, {**TASK, "type": "http.vault", "queue": "vault"}]}
        r = await w.put("/v1/worker/tasks", json=ad)
        assert r.status_code == 422 and r.json()["field"] == "tasks[1].queue", r.text
    assert (await status(api, job_id))["state"] == "queued"  # not failed, not claimed
    queue = api.server.lifespan.state["queue"]
    assert not await queue.redis.hexists(queue.keys.tasks(), "http.vault")


async def test_an_encrypted_job_fails_for_good_rather_than_reach_an_http_worker(
    start_api: StartApi,
) -> None:
    """A job of an encrypted task (``@task(encrypt=True)``, in a queue that is not encrypted)
    that an HTTP claim meets fails for good, saying so, rather than hand out ciphertext."""
    key = "k1:" + base64.b64encode(bytes(range(32))).decode()
    api = await serve(start_api, encryption_keys=key)
    state = api.server.lifespan.state
    queue = state["queue"]
    # as a Python worker of the task, gone since, left it in the catalogue
    backoff = Backoff(1.0, 2.0, 60.0, 0.0)
    ad = TaskAd(
        type="http.add", queue="default", max_attempts=3, backoff=backoff, encrypt=True,
        seen_at=time.time(), worker="vm:1:gone",
    )  # fmt: skip
    await publish(queue.redis, queue.keys, [ad])
    await state["catalog"].load()
    job_id = await submit(api, {"a": 1, "b": 2})
    async with worker_client(api) as w:
        claim = {"worker": "w1", "types": ["http.add"], "queues": ["default"]}
        r = await w.post("/v1/worker/claim", json=claim)
        assert r.json()["jobs"] == []  # no ciphertext handed out
    doc = await status(api, job_id)
    assert (doc["state"], doc["error"]["type"]) == ("failed", "jobtier.EncryptedPayload")
