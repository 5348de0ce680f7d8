"""The jobs of a flow with their own callbacks: POST /v1/flows, the Python clients and the
in-process ``Queue.submit_flow``, end to end on real Redis, Postgres, a dispatcher and a
receiver on loopback; and a refused flow writes no callback."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest
from standardwebhooks.webhooks import Webhook as Verifier

from jobtier.client import AsyncClient, Client, ValidationFailed
from jobtier.config import Settings
from jobtier.core.errors import InvalidRequest
from jobtier.core.model import CallbackSpec, FlowJob
from jobtier.engine.queue import Queue
from jobtier.flows import fan_in
from jobtier.persist.db import Pool
from jobtier.webhooks.callbacks import SecretMissing
from jobtier.webhooks.dispatcher import Dispatcher
from tests.fixtures.api import KEYS, ApiServer
from tests.fixtures.engine import wait_for
from tests.fixtures.receiver import StartProducer, StartReceiver, delivered, deliveries, secret_of
from tests.flows_helpers import run_flows

REFUSED = "http://10.1.2.3/hook"  # a private address: the address policy refuses it


async def callback_rows(pool: Pool) -> list[tuple[str, str, str]]:
    rows = await pool.fetch("SELECT job_id, url, events FROM webhook_job_callbacks ORDER BY url")
    return [(r["job_id"], r["url"], r["events"]) for r in rows]


async def test_a_flows_parent_and_child_each_get_their_terminal_webhook_once(
    hook_api: ApiServer, queue: Queue, pool: Pool, start_receiver: StartReceiver,
    start_dispatcher: Callable[..., Dispatcher],
) -> None:  # fmt: skip
    receiver = await start_receiver()
    async with hook_api.client() as c:
        secret = await secret_of(c)
        r = await c.post("/v1/flows", json={"jobs": [
            {"type": "echo", "payload": "a", "ref": "a",
             "callback": {"url": receiver.url + "?child=a"}},
            {"type": "echo", "payload": "b", "ref": "b"},
            {"type": "collect", "after": ["a", "b"], "callback": {"url": receiver.url}},
        ]})  # fmt: skip
        assert r.status_code == 202, r.text
        child_a, child_b, parent = (job["id"] for job in r.json()["jobs"])
        # stored under the ids the jobs got, so the dispatcher finds them
        assert sorted(await callback_rows(pool)) == sorted([
            (child_a, receiver.url + "?child=a", "terminal"),
            (parent, receiver.url, "terminal"),
        ])  # fmt: skip
        await run_flows(queue)
        start_dispatcher()
        await wait_for(lambda: delivered(c, child_a))
        await wait_for(lambda: delivered(c, parent))
        assert await deliveries(c, child_b) == []  # it named no callback
    # one request each (terminal only: not waiting, queued or running), both signed
    assert len(receiver.requests) == 2
    bodies = {}
    for got in receiver.requests:
        body = Verifier(secret).verify(got.body, got.headers)  # the reference verifier
        bodies[body["data"]["id"]] = body
    assert set(bodies) == {child_a, parent}
    for job_id in (child_a, parent):
        assert bodies[job_id]["type"] == "job.succeeded"
        assert bodies[job_id]["data"]["state"] == "succeeded"
    assert bodies[parent]["data"]["dependencies"] == {"total": 2, "done": 2, "failed": 0}
    assert len(set(receiver.ids())) == 2


async def test_a_refused_flow_writes_no_callback(
    hook_api: ApiServer, queue: Queue, pool: Pool, start_receiver: StartReceiver
) -> None:
    receiver = await start_receiver()
    good = {"url": receiver.url}
    async with hook_api.client() as c:
        # a tenant without a signing secret: 409, nothing submitted or written
        r = await c.post("/v1/flows", json={"jobs": [{"type": "echo", "callback": good}]})
        assert r.status_code == 409 and r.json()["type"].endswith("webhook-secret-missing")
        await secret_of(c)
        # one child's URL refused: the parent's and the other child's are not written either
        r = await c.post("/v1/flows", json={"jobs": [
            {"type": "echo", "ref": "a", "callback": good},
            {"type": "echo", "ref": "b", "callback": {"url": REFUSED}},
            {"type": "collect", "after": ["a", "b"], "callback": good},
        ]})  # fmt: skip
        assert r.status_code == 422, r.text
        assert r.json()["field"] == "jobs[1].callback.url" and "refused" in r.json()["detail"]
        assert (await c.post("/v1/flows", json={"jobs": [
            {"type": "echo", "callback": {"url": receiver.url, "events": "some"}},
        ]})).json()["field"] == "jobs[0].callback.events"  # fmt: skip
        assert await callback_rows(pool) == []
        assert [key async for key in queue.redis.scan_iter(match="*:job:*")] == []
        # refused after the callbacks were written (the key names another flow): deleted
        first = await c.post("/v1/flows", json={"jobs": [{"type": "echo", "payload": 1}]},
                             headers={"idempotency-key": "k1"})  # fmt: skip
        assert first.status_code == 202, first.text
        r = await c.post("/v1/flows", json={"jobs": [{"type": "echo", "payload": 2,
                                                       "callback": good}]},
                         headers={"idempotency-key": "k1"})  # fmt: skip
        assert r.status_code == 409 and r.json()["type"].endswith("idempotency-conflict")
        assert await callback_rows(pool) == []
        # a repeat of a flow answers with its jobs: the first submit's callbacks stay, the
        # repeat's (written under ids no job got) are deleted
        flow = {"jobs": [{"type": "echo", "payload": 3, "callback": good}]}
        made = await c.post("/v1/flows", json=flow, headers={"idempotency-key": "k2"})
        (job,) = made.json()["jobs"]
        again = await c.post(
            "/v1/flows",
            json={"jobs": [{**flow["jobs"][0], "callback": {"url": REFUSED[:-4]}}]},
            headers={"idempotency-key": "k2"},
        )
        assert again.status_code == 422  # the callback is checked whatever the key
        again = await c.post(
            "/v1/flows",
            json={"jobs": [{**flow["jobs"][0], "callback": {"url": receiver.url + "?2"}}]},
            headers={"idempotency-key": "k2"},
        )
        assert again.status_code == 200 and again.json()["jobs"][0]["id"] == job["id"]
    assert await callback_rows(pool) == [(job["id"], receiver.url, "terminal")]


async def test_the_clients_send_a_flows_callbacks(
    hook_api: ApiServer, pool: Pool, start_receiver: StartReceiver
) -> None:
    receiver = await start_receiver()
    async with hook_api.client() as c:
        await secret_of(c)
    flow = fan_in(
        FlowJob(type="collect", callback=CallbackSpec(url=receiver.url, events="all")),
        [FlowJob(type="echo", payload=1)],
    )
    async with AsyncClient(hook_api.url, KEYS["acme"]) as client:
        made = await client.submit_flow(flow)
        with pytest.raises(ValidationFailed):
            await client.submit_flow([{"type": "echo", "callback": REFUSED}])

    def sync_side() -> list[str]:
        with Client(hook_api.url, KEYS["acme"]) as sync_client:
            # a mapping's callback may be a bare URL, as submit's
            return sync_client.submit_flow([{"type": "echo", "callback": receiver.url}]).ids

    (sync_id,) = await asyncio.to_thread(sync_side)
    assert sorted(await callback_rows(pool)) == sorted([
        (made.ids[-1], receiver.url, "all"), (sync_id, receiver.url, "terminal"),
    ])  # fmt: skip


async def test_queue_submit_flow_writes_callbacks_the_dispatcher_delivers(
    callback_producer: StartProducer, hook_api: ApiServer, hook_settings: Settings, queue: Queue, pool: Pool,
    start_receiver: StartReceiver, start_dispatcher: Callable[..., Dispatcher],
) -> None:  # fmt: skip
    receiver = await start_receiver()
    hook = CallbackSpec(url=receiver.url)
    producer = await callback_producer(hook_settings)
    try:
        with pytest.raises(SecretMissing):
            await producer.submit_flow([FlowJob(type="echo", callback=hook)], tenant="acme")
        async with hook_api.client() as c:
            secret = await secret_of(c)
            with pytest.raises(InvalidRequest) as refused:
                await producer.submit_flow(
                    [FlowJob(type="echo", callback=hook),
                     FlowJob(type="echo", callback=CallbackSpec(url=REFUSED))],
                    tenant="acme",
                )  # fmt: skip
            assert refused.value.field == "jobs[1].callback.url"
            assert await callback_rows(pool) == []
            made = await producer.submit_flow(
                fan_in(FlowJob(type="collect", callback=hook), [FlowJob(type="echo", payload=7)]),
                tenant="acme",
            )
            child, parent = (job.job_id for job in made.jobs)
            await run_flows(queue)
            start_dispatcher()
            await wait_for(lambda: delivered(c, parent))
            assert await deliveries(c, child) == []
    finally:
        await producer.close()
    (got,) = receiver.requests
    body = Verifier(secret).verify(got.body, got.headers)
    assert body["type"] == "job.succeeded" and body["data"]["id"] == parent
    assert body["data"]["dependencies"] == {"total": 1, "done": 1, "failed": 0}


async def test_a_flow_with_a_callback_needs_the_apis_postgres_part(api: ApiServer) -> None:
    async with httpx.AsyncClient(base_url=api.url, headers={
        "authorization": f"Bearer {KEYS['acme']}"}) as c:  # fmt: skip
        r = await c.post("/v1/flows", json={"jobs": [
            {"type": "echo"}, {"type": "echo", "callback": {"url": "https://example.com/h"}},
        ]})  # fmt: skip
    assert r.status_code == 422 and r.json()["field"] == "jobs[1].callback.url", r.text
