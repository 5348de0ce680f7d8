"""Webhooks of jobs that end in the outbox, never reaching Redis (whose transition logs the
dispatchers follow): a row the relay refuses is a ``job.failed`` delivery, a row cancelled
before its relay a ``job.cancelled`` one, each made in the transaction that ends the row; on
real Redis, Postgres, the API, a dispatcher and a receiver on loopback."""

from __future__ import annotations

from collections.abc import Callable

import asyncpg
import orjson
import pytest

from jobtier import outbox
from jobtier.config import Settings
from jobtier.engine.produce import Producer
from jobtier.engine.queue import Queue
from jobtier.persist import outbox as outbox_relay
from jobtier.persist.db import Pool
from jobtier.persist.outbox import OutboxRelay
from jobtier.webhooks.deliveries import deliver_ended
from jobtier.webhooks.dispatcher import Dispatcher
from tests.fixtures.api import ApiServer
from tests.fixtures.engine import wait_for
from tests.fixtures.receiver import StartReceiver
from tests.tasks import registry


async def test_refused_and_cancelled_outbox_jobs_are_delivered(
    hook_api: ApiServer, hook_settings: Settings, queue: Queue, pool: Pool,
    start_receiver: StartReceiver, start_dispatcher: Callable[..., Dispatcher],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setattr(outbox_relay, "UNKNOWN_TYPE_PATIENCE", 0.0)  # refused at first look
    receiver = await start_receiver()
    producer = Producer(queue.store, registry, True, None)
    relay = OutboxRelay(hook_settings, pool, producer, on_ended=deliver_ended)
    assert await relay.drain() == 0  # records the shard count
    app = await asyncpg.connect(hook_settings.database_url)
    try:
        async with hook_api.client("acme") as a:
            r = await a.post("/v1/webhooks", json={"url": receiver.url})  # terminal events
            assert r.status_code == 201, r.text
            refused = await outbox.submit(app, "no_such_task", {}, tenant="acme")
            cancelled = await outbox.submit(app, "echo", {}, tenant="acme", delay=3600)
            quiet = await outbox.submit(app, "no_such_task", {}, tenant="globex")  # no target
            r = await a.post(f"/v1/jobs/{cancelled}/cancel")
            assert r.status_code == 200 and r.json()["state"] == "cancelled", r.text
            assert await relay.drain() == 2  # the refused two
    finally:
        await app.close()
    start_dispatcher()

    async def both_delivered() -> bool:
        states = await pool.fetch(
            "SELECT job_id, state FROM webhook_deliveries WHERE job_id = ANY($1)",
            [refused, cancelled, quiet],
        )
        return sorted((r["job_id"], r["state"]) for r in states) == sorted(
            [(refused, "delivered"), (cancelled, "delivered")]
        )

    await wait_for(both_delivered)
    bodies = {}
    for request in receiver.requests:
        body = orjson.loads(request.body)
        bodies[body["data"]["id"]] = body
        assert request.headers["webhook-signature"].startswith("v1,"), request.headers
    assert set(bodies) == {refused, cancelled}
    assert bodies[refused]["type"] == "job.failed"
    assert bodies[refused]["data"]["state"] == "failed"
    assert "refused by the outbox relay" in bodies[refused]["data"]["error"]["message"]
    assert bodies[cancelled]["type"] == "job.cancelled"
    assert bodies[cancelled]["data"]["state"] == "cancelled"
