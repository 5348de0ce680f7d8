"""Webhooks end to end: the API, a worker, the dispatcher, a real receiver on loopback, real
Redis and Postgres. Signatures are checked with the Standard Webhooks reference verifier
(the ``standardwebhooks`` package), not with our own code."""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from standardwebhooks.webhooks import Webhook as Verifier
from standardwebhooks.webhooks import WebhookVerificationError

from jobtier.engine.queue import Queue
from jobtier.persist.db import Pool
from jobtier.store.redis import RedisClient
from jobtier.webhooks.dispatcher import Dispatcher
from tests.fixtures.api import ApiServer
from tests.fixtures.engine import wait_for
from tests.fixtures.receiver import StartReceiver, delivered, deliveries, run_jobs, secret_of
from tests.flows_helpers import run_flows


async def test_a_callback_is_signed_as_the_spec_says_and_recorded(
    hook_api: ApiServer, queue: Queue, start_receiver: StartReceiver,
    start_dispatcher: Callable[..., Dispatcher],
) -> None:  # fmt: skip
    receiver = await start_receiver()
    async with hook_api.client() as c:
        secret = await secret_of(c)
        job_id = await _echo_calling_back(c, receiver.url)
        await run_jobs(queue)
        start_dispatcher()
        await wait_for(lambda: delivered(c, job_id))
        (record,) = await deliveries(c, job_id)
    assert len(receiver.requests) == 1  # terminal only: not queued, not running
    got = receiver.requests[0]
    # the reference verifier accepts it: id, timestamp and signature over the exact body
    payload = Verifier(secret).verify(got.body, got.headers)
    assert payload["type"] == "job.succeeded"
    assert payload["data"]["id"] == job_id and payload["data"]["state"] == "succeeded"
    # and by hand, the spec's algorithm: HMAC-SHA256 of "{id}.{timestamp}.{body}", base64
    key = base64.b64decode(secret.removeprefix("whsec_"))
    signed = f"{got.headers['webhook-id']}.{got.headers['webhook-timestamp']}.".encode() + got.body
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    assert got.headers["webhook-signature"] == f"v1,{expected}"
    # a tampered body fails the reference verifier
    with pytest.raises(WebhookVerificationError):
        Verifier(secret).verify(got.body.replace(b"succeeded", b"failed"), got.headers)
    assert record["id"] == got.headers["webhook-id"]
    assert record["state"] == "delivered" and record["attempts"] == 1
    (attempt,) = record["attempt_log"]
    assert attempt["status"] == 200 and attempt["error"] is None
    assert isinstance(attempt["duration_ms"], float)  # recorded with the attempt


async def test_failed_attempts_are_retried_with_the_same_id_and_each_is_recorded(
    hook_api: ApiServer, queue: Queue, start_receiver: StartReceiver,
    start_dispatcher: Callable[..., Dispatcher],
) -> None:  # fmt: skip
    receiver = await start_receiver()
    receiver.default = [500, "stall"]  # a 500, then no answer within the time limit, then 200
    async with hook_api.client() as c:
        await secret_of(c)
        r = await c.post("/v1/jobs", json={"type": "echo", "callback": {"url": receiver.url}})
        job_id = r.json()["id"]
        await run_jobs(queue)
        start_dispatcher()
        await wait_for(lambda: delivered(c, job_id), timeout=60)
        (record,) = await deliveries(c, job_id)
    assert len(set(receiver.ids())) == 1 and len(receiver.requests) == 3
    log = record["attempt_log"]
    assert [a["attempt"] for a in log] == [1, 2, 3]
    assert log[0]["status"] == 500 and log[0]["response"] == "not now"
    assert log[1]["status"] is None and "timed out" in log[1]["error"]
    assert log[2]["status"] == 200
    assert record["attempts"] == 3 and record["last_status"] == 200


async def test_a_delivery_fails_after_the_last_retry(
    hook_api: ApiServer, queue: Queue, start_receiver: StartReceiver,
    start_dispatcher: Callable[..., Dispatcher],
) -> None:  # fmt: skip
    receiver = await start_receiver()
    receiver.default = [503] * 10
    async with hook_api.client() as c:
        await secret_of(c)
        job_id = (await c.post("/v1/jobs", json={
            "type": "echo", "callback": {"url": receiver.url},
        })).json()["id"]  # fmt: skip
        await run_jobs(queue)
        start_dispatcher()

        async def failed() -> bool:
            found = await deliveries(c, job_id)
            return bool(found) and found[0]["state"] == "failed"

        await wait_for(failed, timeout=60)
        (record,) = await deliveries(c, job_id)
    assert record["attempts"] == 4  # the first and the schedule's three retries
    assert [a["status"] for a in record["attempt_log"]] == [503] * 4
    assert len(receiver.requests) == 4


async def test_a_410_is_recorded_as_its_deliverys_attempt_and_disables_the_subscription(
    hook_api: ApiServer, queue: Queue, start_receiver: StartReceiver,
    start_dispatcher: Callable[..., Dispatcher],
) -> None:  # fmt: skip
    receiver = await start_receiver()
    receiver.default = [410]
    async with hook_api.client() as c:
        hook = (await c.post("/v1/webhooks", json={"url": receiver.url})).json()
        job_id = (await c.post("/v1/jobs", json={"type": "echo"})).json()["id"]
        await run_jobs(queue)
        start_dispatcher()

        async def disabled() -> bool:
            got = (await c.get(f"/v1/webhooks/{hook['id']}")).json()
            return got.get("disabled_at") is not None

        await wait_for(disabled, timeout=60)
        (record,) = await deliveries(c, job_id)
    assert len(receiver.requests) == 1
    # the attempt that was answered 410 is on its delivery, which failed (not cancelled)
    assert record["state"] == "failed" and record["attempts"] == 1, record
    assert [a["status"] for a in record["attempt_log"]] == [410]
    assert record["last_status"] == 410


async def test_a_subscription_sees_only_its_tenants_jobs_and_every_transition_if_asked(
    hook_api: ApiServer, queue: Queue, start_receiver: StartReceiver,
    start_dispatcher: Callable[..., Dispatcher],
) -> None:  # fmt: skip
    receiver = await start_receiver()
    async with hook_api.client("acme") as a, hook_api.client("globex") as b:
        made = await a.post("/v1/webhooks", json={"url": receiver.url, "events": "all"})
        assert made.status_code == 201, made.text
        hook = made.json()
        secret = hook["secret"]  # the tenant's first subscription made its secret: shown once
        again = (await a.post("/v1/webhooks", json={"url": receiver.url})).json()
        assert "secret" not in again
        await a.delete(f"/v1/webhooks/{again['id']}")
        mine = (await a.post("/v1/jobs", json={"type": "echo"})).json()["id"]
        theirs = (await b.post("/v1/jobs", json={"type": "echo"})).json()["id"]
        await run_jobs(queue)
        start_dispatcher()
        await wait_for(lambda: delivered(a, mine, 3))  # queued, running, succeeded
        listed = (await a.get(f"/v1/webhooks/{hook['id']}/deliveries")).json()["deliveries"]
        assert {d["job_id"] for d in listed} == {mine}
        assert (await b.get(f"/v1/webhooks/{hook['id']}/deliveries")).status_code == 404
        assert await deliveries(b, theirs) == []
    bodies = [Verifier(secret).verify(r.body, r.headers) for r in receiver.requests]
    assert {body["data"]["id"] for body in bodies} == {mine}
    assert sorted(body["type"] for body in bodies) == ["job.queued", "job.running", "job.succeeded"]


async def test_a_dependent_reports_waiting_then_its_way_out_of_it(
    hook_api: ApiServer, queue: Queue, start_receiver: StartReceiver,
    start_dispatcher: Callable[..., Dispatcher],
) -> None:  # fmt: skip
    """Flows' transitions reach the dispatcher like any other: a job with dependencies is
    submitted `waiting` (a delivery with its dependency count), then queued by the resolver;
    a dependent of a cancelled job ends cancelled, with the reason."""
    receiver = await start_receiver()
    async with hook_api.client() as c:
        secret = await secret_of(c)
        first = (await c.post("/v1/jobs", json={"type": "echo", "payload": 1})).json()["id"]
        r = await c.post("/v1/jobs", json={
            "type": "echo", "payload": 2, "depends_on": [first],
            "callback": {"url": receiver.url, "events": "all"},
        })  # fmt: skip
        assert r.status_code == 202 and r.json()["state"] == "waiting", r.text
        dependent = r.json()["id"]
        later = (await c.post("/v1/jobs", json={"type": "echo", "delay": 3600})).json()["id"]
        doomed = (await c.post("/v1/jobs", json={
            "type": "echo", "depends_on": [later], "callback": {"url": receiver.url},
        })).json()["id"]  # fmt: skip
        assert (await c.post(f"/v1/jobs/{later}/cancel")).status_code == 200
        await run_flows(queue)
        start_dispatcher()
        await wait_for(lambda: delivered(c, dependent, 4))  # waiting, queued, running, succeeded
        await wait_for(lambda: delivered(c, doomed))  # terminal only: cancelled
    bodies = [Verifier(secret).verify(r.body, r.headers) for r in receiver.requests]
    mine = sorted((b["data"]["version"], b["type"]) for b in bodies if b["data"]["id"] == dependent)
    assert [kind for _, kind in mine] == [
        "job.waiting",
        "job.queued",
        "job.running",
        "job.succeeded",
    ]
    (waiting,) = [b for b in bodies if b["type"] == "job.waiting"]
    assert waiting["data"]["dependencies"] == {"total": 1, "done": 0, "failed": 0}
    (end,) = [b for b in bodies if b["data"]["id"] == doomed]
    assert end["type"] == "job.cancelled" and end["data"]["state"] == "cancelled"
    assert end["data"]["error"]["type"] == "DependencyCancelled"


async def test_a_submits_callbacks_are_kept_only_for_the_jobs_it_made(
    hook_api: ApiServer, api: ApiServer, pool: Pool
) -> None:
    """POST /v1/jobs and /v1/jobs/batch: a refused callback, or a depends_on naming no job,
    writes no callback; an idempotent repeat keeps the first job's alone; an API without its
    Postgres part refuses a callback, naming it."""
    url = "http://127.0.0.1:9/hook"

    async def rows() -> list[tuple[str, str]]:
        found = await pool.fetch("SELECT job_id, url FROM webhook_job_callbacks ORDER BY url")
        return [(r["job_id"], r["url"]) for r in found]

    async with hook_api.client() as c:
        await secret_of(c)
        r = await c.post("/v1/jobs/batch", json={"jobs": [
            {"type": "echo", "callback": {"url": url}},
            {"type": "echo", "callback": {"url": "http://10.1.2.3/hook"}},
        ]})  # fmt: skip
        assert r.status_code == 422 and r.json()["field"] == "jobs[1].callback.url", r.text
        r = await c.post("/v1/jobs", json={
            "type": "echo", "depends_on": ["01M8PZGS1ACTCQA1ZNX74XGJ0W-3"],
            "callback": {"url": url},
        })  # fmt: skip
        assert r.status_code == 422 and r.json()["field"] == "depends_on", r.text
        assert await rows() == []
        first = await c.post("/v1/jobs", json={
            "type": "echo", "idempotency_key": "k", "callback": {"url": url + "?1"},
        })  # fmt: skip
        again = await c.post("/v1/jobs", json={
            "type": "echo", "idempotency_key": "k", "callback": {"url": url + "?2"},
        })  # fmt: skip
        assert (first.status_code, again.status_code) == (202, 200), again.text
        r = await c.post("/v1/jobs/batch", json={"jobs": [
            {"type": "echo", "idempotency_key": "k", "callback": {"url": url + "?3"}},
            {"type": "echo", "callback": {"url": url + "?4"}},
        ]})  # fmt: skip
        assert [x["status"] for x in r.json()["results"]] == [200, 202], r.text
        made = r.json()["results"][1]["job"]["id"]
    assert await rows() == [(first.json()["id"], url + "?1"), (made, url + "?4")]
    async with api.client() as bare:
        r = await bare.post("/v1/jobs", json={"type": "echo", "callback": {"url": url}})
        assert r.status_code == 422 and r.json()["field"] == "callback.url", r.text
        r = await bare.post("/v1/jobs/batch", json={"jobs": [
            {"type": "echo"}, {"type": "echo", "callback": {"url": url}},
        ]})  # fmt: skip
        assert r.status_code == 422 and r.json()["field"] == "jobs[1].callback.url", r.text


async def test_an_idle_dispatcher_waits_in_redis_and_delivers_what_comes(
    hook_api: ApiServer, queue: Queue, start_receiver: StartReceiver,
    start_dispatcher: Callable[..., Dispatcher], redis: RedisClient,
) -> None:  # fmt: skip
    """Started with nothing to read, the dispatcher is blocked in one XREADGROUP naming every
    stream (not napping between polls), and a job finished meanwhile gets its webhook."""
    receiver = await start_receiver()
    assert not await _blocked_reading(redis)
    # no taking back its own pending entries meanwhile: what it waited for is handled by it
    dispatcher = start_dispatcher(persist_claim_idle_seconds=60)
    await wait_for(lambda: _blocked_reading(redis))
    async with hook_api.client() as c:
        await secret_of(c)
        job_id = await _echo_calling_back(c, receiver.url)
        await run_jobs(queue)
        await wait_for(lambda: delivered(c, job_id))
        recorded = [record["id"] for record in await deliveries(c, job_id)]
    assert [req.headers["webhook-id"] for req in receiver.requests] == recorded
    assert dispatcher.stats.claimed == 0


async def test_a_dispatcher_whose_batch_fails_unforeseen_reads_it_again(
    hook_api: ApiServer, queue: Queue, start_receiver: StartReceiver,
    start_dispatcher: Callable[..., Dispatcher], caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """An error nobody foresaw while turning entries into deliveries (here, the first batch)
    is logged with its traceback and retried: reading goes on, and the entries read are read
    again from the dispatcher's own pending ones."""
    receiver = await start_receiver()
    dispatcher = start_dispatcher(persist_claim_idle_seconds=60)
    handle = dispatcher.handle
    failed: list[int] = []

    async def fails_once(taken: Any) -> None:
        if not failed:
            failed.append(len(taken))
            raise RuntimeError("a bug of ours")
        await handle(taken)

    dispatcher.handle = fails_once  # type: ignore[method-assign]
    async with hook_api.client() as c:
        await secret_of(c)
        job_id = await _echo_calling_back(c, receiver.url)
        await run_jobs(queue)
        await wait_for(lambda: delivered(c, job_id))
    assert failed and len(receiver.requests) == 1
    assert "event=read_failed" in caplog.text and "RuntimeError: a bug of ours" in caplog.text


async def _echo_calling_back(c: httpx.AsyncClient, url: str) -> str:
    """Submit an echo job whose callback is ``url``; its id."""
    r = await c.post(
        "/v1/jobs", json={"type": "echo", "payload": {"n": 1}, "callback": {"url": url}}
    )
    assert r.status_code == 202, r.text
    job_id: str = r.json()["id"]
    return job_id


async def _blocked_reading(redis: RedisClient) -> bool:
    """Is a client blocked in an XREADGROUP? (CLIENT LIST: ``redis`` is the test's client,
    as jobtier's user may not)"""
    clients = await redis.client_list()
    return any(c.get("cmd") == "xreadgroup" and "b" in c.get("flags", "") for c in clients)
