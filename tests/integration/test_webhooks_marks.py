"""The tenants marked as possibly having webhook targets (``dispatch/marks.py``), on real
Redis, Postgres, a dispatcher and a receiver on loopback: entries of unmarked tenants are
acknowledged without a look-up in Postgres; marked tenants' webhooks are delivered; and a
dispatcher's start-up marks the tenants whose webhooks were made before the marks existed."""

from __future__ import annotations

from collections.abc import Callable

from jobtier.config import Settings
from jobtier.dispatch.dispatcher import Dispatcher, group_name
from jobtier.dispatch.signing import new_secret
from jobtier.model import CallbackSpec, FlowJob
from jobtier.persist.db import Pool, query
from jobtier.queue import Queue
from tests.fixtures.api import ApiServer
from tests.fixtures.engine import wait_for
from tests.fixtures.receiver import StartReceiver, delivered, deliveries, run_jobs, secret_of
from tests.flows_helpers import run_flows
from tests.tasks import registry


async def log_entries(queue: Queue, tenant: str) -> int:
    """The entries of ``tenant``'s jobs in every shard's log now."""
    found = 0
    for shard in range(queue.keys.shards):
        for _, fields in await queue.redis.xrange(queue.keys.log(shard)) or []:
            found += fields is not None and fields[b"tn"] == tenant.encode()
    return found


async def pending(queue: Queue) -> int:
    """Entries read by the dispatchers' group and not yet acknowledged."""
    total = 0
    for shard in range(queue.keys.shards):
        info = await queue.redis.xpending(queue.keys.log(shard), group_name(queue.keys))
        total += int(info["pending"])
    return total


async def is_marked(queue: Queue, tenant: str) -> bool:
    return bool(await queue.redis.hexists(queue.keys.webhook_tenants(), tenant))


async def test_an_unmarked_tenants_entries_are_acknowledged_without_postgres(
    hook_api: ApiServer, hook_settings: Settings, queue: Queue, pool: Pool
) -> None:
    async with hook_api.client("globex") as c:
        ids = [(await c.post("/v1/jobs", json={"type": "echo"})).json()["id"] for _ in range(5)]
    await run_jobs(queue)
    entries = await log_entries(queue, "globex")
    assert entries == 15  # queued, running, succeeded each
    assert not await is_marked(queue, "globex")
    d = Dispatcher(hook_settings, queue.redis, pool, "d1")
    assert await d.drain() == entries
    assert d.stats.skipped == entries
    assert d.stats.lookups == 0  # no batch asked Postgres for targets
    assert d.metrics().counters["dispatcher_entries_skipped_total"] == {"": entries}
    assert await pending(queue) == 0  # every entry acknowledged
    rows = await pool.fetchval(
        "SELECT count(*) FROM webhook_deliveries WHERE job_id = ANY($1)", ids
    )
    assert rows == 0


async def test_marked_tenants_are_delivered_beside_skipped_ones(
    hook_api: ApiServer, hook_settings: Settings, queue: Queue, pool: Pool,
    start_receiver: StartReceiver, start_dispatcher: Callable[..., Dispatcher],
) -> None:  # fmt: skip
    """acme has a subscription (the API), initech a flow job's callback (the in-process
    ``Queue.submit_flow``), globex nothing: only globex's entries are skipped."""
    receiver = await start_receiver()
    await pool.execute(query("secret_create_if_missing"), "initech", new_secret())
    producer = await Queue.connect(hook_settings, registry)
    try:
        async with hook_api.client("acme") as a, hook_api.client("globex") as g:
            r = await a.post("/v1/webhooks", json={"url": receiver.url, "events": "all"})
            assert r.status_code == 201, r.text
            assert await is_marked(queue, "acme")  # the API marks it with the subscription
            assert not await is_marked(queue, "initech")  # a secret alone is no target
            flow = await producer.submit_flow(
                [FlowJob(type="echo", callback=CallbackSpec(url=receiver.url))], tenant="initech"
            )
            (called,) = flow.ids
            assert await is_marked(queue, "initech")  # with the callback, before the submit
            subscribed = (await a.post("/v1/jobs", json={"type": "echo"})).json()["id"]
            quiet = (await g.post("/v1/jobs", json={"type": "echo"})).json()["id"]
            await run_flows(queue)
            skippable = await log_entries(queue, "globex")
            assert skippable == 3
            assert not await is_marked(queue, "globex")
            d = start_dispatcher()
            await wait_for(lambda: delivered(a, subscribed, 3))  # queued, running, succeeded
            await wait_for(lambda: d.stats.skipped == skippable)
            assert await deliveries(g, quiet) == []

            async def callback_delivered() -> bool:
                state = await pool.fetchval(
                    "SELECT state FROM webhook_deliveries WHERE job_id = $1", called
                )
                return bool(state == "delivered")

            await wait_for(callback_delivered)  # terminal only
    finally:
        await producer.close()
    assert d.stats.lookups >= 1
    assert len(receiver.requests) == 4


async def test_start_up_marks_tenants_whose_webhooks_predate_the_marks(
    hook_api: ApiServer, queue: Queue, start_receiver: StartReceiver,
    start_dispatcher: Callable[..., Dispatcher],
) -> None:  # fmt: skip
    """A deployment upgraded with webhooks in place: rows in Postgres, no marks in Redis."""
    receiver = await start_receiver()
    async with hook_api.client("acme") as a, hook_api.client("globex") as g:
        assert (await a.post("/v1/webhooks", json={"url": receiver.url})).status_code == 201
        await secret_of(g)
        r = await g.post("/v1/jobs", json={"type": "echo", "callback": {"url": receiver.url}})
        assert r.status_code == 202, r.text
        called = r.json()["id"]
        subscribed = (await a.post("/v1/jobs", json={"type": "echo"})).json()["id"]
        await run_jobs(queue)
        # as before the marks existed: the rows are there, the marks are not
        assert await queue.redis.delete(queue.keys.webhook_tenants()) == 1
        assert not await is_marked(queue, "acme") and not await is_marked(queue, "globex")
        d = start_dispatcher()
        await wait_for(lambda: delivered(a, subscribed))
        await wait_for(lambda: delivered(g, called))
    assert await is_marked(queue, "acme") and await is_marked(queue, "globex")
    assert d.stats.skipped == 0
    assert len(receiver.requests) == 2
