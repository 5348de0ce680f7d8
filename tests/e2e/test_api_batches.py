"""Batches over HTTP and through both Python clients: submit, read, cancel, retry; refusals
are problem documents naming the member and create nothing; the callback job's webhook is
delivered once every child has finished (real Postgres, dispatcher and receiver)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable

import pytest

from jobtier.client import AsyncClient, Client, NotFound, ValidationFailed
from jobtier.core.batch_model import BatchCallback
from jobtier.engine.queue import Queue
from jobtier.flows.resolver import Resolver
from jobtier.webhooks.dispatcher import Dispatcher
from tests.fixtures.api import KEYS, ApiServer
from tests.fixtures.engine import wait_for, worker_for
from tests.fixtures.receiver import StartReceiver, delivered, secret_of
from tests.tasks import registry


async def run_all(queue: Queue) -> None:
    resolver = Resolver(queue.store, name="test-resolver")
    for _ in range(50):
        stats = await worker_for(queue, registry, burst=True).run()
        if not await resolver.drain() and not stats.claimed:
            return
    raise AssertionError("batches still moving")


async def test_a_batch_over_http(api: ApiServer, queue: Queue) -> None:
    async with api.client() as c:
        body = {
            "type": "echo",
            "items": list(range(50)),
            "chunk_size": 5,
            "callback": {"type": "collect", "payload": "done"},
        }
        r = await c.post("/v1/batches", json=body)
        assert r.status_code == 202, r.text
        batch = r.json()
        assert r.headers["location"] == f"/v1/batches/{batch['id']}"
        assert (batch["state"], batch["total"], batch["pending"]) == ("running", 10, 10)
        await run_all(queue)
        done = (await c.get(f"/v1/batches/{batch['id']}")).json()
        assert (done["state"], done["succeeded"], done["pending"]) == ("finished", 10, 0)
        result = (await c.get(f"/v1/jobs/{done['callback_job']}/result")).json()["result"]
        assert result["payload"] == {"batch_id": batch["id"], "total": 10, "succeeded": 10,
                                     "failed": 0, "cancelled": 0, "payload": "done"}  # fmt: skip
        # another tenant's batch is unknown to it, and so is a malformed id
        async with api.client("globex") as other:
            assert (await other.get(f"/v1/batches/{batch['id']}")).status_code == 404
            r = await other.post(f"/v1/batches/{batch['id']}/cancel")
            assert r.status_code == 404
        assert (await c.get("/v1/batches/not-an-id")).status_code == 404


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        ({"type": "echo", "items": []}, 422, "items"),
        ({"type": "echo", "items": [1], "chunk_size": 0}, 422, "chunk_size"),
        ({"type": "nope", "items": [1]}, 422, "type"),
        ({"type": "echo", "items": [1], "priority": "urgent"}, 422, "priority"),
        (
            {"type": "echo", "items": [1], "callback": {"type": "echo", "webhook": {"url": 1}}},
            422,
            "callback.webhook.url",
        ),
        ({"type": "echo", "items": [1], "callback": {"type": "nope"}}, 422, "callback.type"),
        # an unknown member at the top: named in field too (msgspec names it in its message)
        ({"type": "echo", "items": [1], "extra": 1}, 422, "extra"),
        ({"type": "echo", "items": list(range(100_001))}, 413, "items"),
        # a typed task (thumbnail: url required): the item named, the first as any other
        ({"type": "thumbnail", "items": [{"width": 3}, {"url": "b"}]}, 422, "items"),
        ({"type": "thumbnail", "items": [{"url": "a"}, {"width": 3}]}, 422, "items"),
        # chunk_size makes every child's payload {offset, items}, which it cannot take
        ({"type": "thumbnail", "items": [{"url": "a"}], "chunk_size": 1}, 422, "chunk_size"),
        # a chunk too large is a size, said as one (not a payload type's refusal)
        ({"type": "echo", "items": ["x" * 200_000] * 2, "chunk_size": 2}, 413, "items"),
    ],
)
async def test_a_bad_batch_is_refused_naming_the_member(
    api: ApiServer, queue: Queue, body: dict[str, object], status: int, field: str | None
) -> None:
    async with api.client() as c:
        r = await c.post("/v1/batches", json=body)
    assert r.status_code == status, r.text
    assert r.json().get("field") == field, r.text
    assert field is not None or "`extra`" in r.json()["detail"]
    if body["type"] == "thumbnail":  # said of what was sent
        detail = r.json()["detail"]
        if field == "items":
            assert re.match(r"items\[[01]\]: payload\.url: required", detail), detail
        else:
            assert '"offset"' in detail and "leave chunk_size out" in detail, detail
    assert [k async for k in queue.redis.scan_iter(match="*batch:*")] == []
    assert (await queue.admin.stats())["total"]["queued"] == 0


async def test_the_clients_cancel_and_retry(api: ApiServer, queue: Queue) -> None:
    async with AsyncClient(api.url, KEYS["acme"]) as jobs:
        b = await jobs.submit_batch("echo", [1, 2, 3], callback=BatchCallback(type="collect"))
        cancelled = await jobs.cancel_batch(b.id)
        assert (cancelled.changed, cancelled.batch.cancelled) == (3, 3)
        assert (await jobs.retry_batch(b.id)).changed == 0  # nothing failed
        with pytest.raises(ValidationFailed):
            await jobs.submit_batch("echo", [])
        with pytest.raises(NotFound):
            await jobs.batch(queue.keys.new_id())

    def blocking() -> None:
        with Client(api.url, KEYS["acme"]) as jobs:
            b = jobs.submit_batch("echo", list(range(10)), chunk_size=4)
            assert (b.total, jobs.batch(b.id).pending) == (3, 3)
            assert jobs.cancel_batch(b.id).changed == 3

    await asyncio.to_thread(blocking)


async def test_the_callback_jobs_webhook_comes_when_the_batch_has_finished(
    hook_api: ApiServer,
    queue: Queue,
    start_receiver: StartReceiver,
    start_dispatcher: Callable[..., Dispatcher],
) -> None:
    receiver = await start_receiver()
    async with hook_api.client() as c:
        await secret_of(c)
        body = {
            "type": "echo",
            "items": [1, 2, 3],
            "callback": {"type": "collect", "webhook": {"url": receiver.url}},
        }
        r = await c.post("/v1/batches", json=body)
        assert r.status_code == 202, r.text
        batch_id = r.json()["id"]
        await run_all(queue)
        done = (await c.get(f"/v1/batches/{batch_id}")).json()
        callback = done["callback_job"]
        assert callback is not None
        start_dispatcher()
        await wait_for(lambda: delivered(c, callback))
    (got,) = receiver.requests
    assert b'"job.succeeded"' in got.body and callback.encode() in got.body
