"""The tenants marked as possibly having webhook targets (``webhooks/marks.py``), on real
Redis, Postgres, a dispatcher and a receiver on loopback: entries of unmarked tenants are
acknowledged without a look-up in Postgres; marked tenants' webhooks are delivered; a
dispatcher's start-up marks the tenants whose webhooks were made before the marks existed;
and the dispatchers unmark the tenants left without a target, never one whose target is being
created (the interleavings are forced with Postgres locks, not timing)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from jobtier.config import Settings
from jobtier.core.model import CallbackSpec, FlowJob
from jobtier.engine.queue import Queue
from jobtier.persist.db import Pool, query
from jobtier.webhooks import marks
from jobtier.webhooks.deliveries import DeliveryStore
from jobtier.webhooks.dispatcher import Dispatcher
from jobtier.webhooks.signing import new_secret
from tests.fixtures.api import ApiServer
from tests.fixtures.engine import wait_for
from tests.fixtures.postgres import waiting_for_a_lock_on
from tests.fixtures.receiver import (
    StartProducer,
    StartReceiver,
    delivered,
    deliveries,
    run_jobs,
    secret_of,
)
from tests.fixtures.redis import logged
from tests.flows_helpers import run_flows


async def log_entries(queue: Queue, tenant: str) -> int:
    """The entries of ``tenant``'s jobs in every shard's log now."""
    found = 0
    for shard in range(queue.keys.shards):
        for fields in await logged(queue.redis, queue.keys.log(shard)):
            found += fields[b"tn"] == tenant.encode()
    return found


async def pending(queue: Queue) -> int:
    """Entries read by the dispatchers' group and not yet acknowledged."""
    total = 0
    for shard in range(queue.keys.shards):
        info = await queue.redis.xpending(queue.keys.log(shard), queue.keys.dispatch_group())
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
    callback_producer: StartProducer, hook_api: ApiServer, hook_settings: Settings, queue: Queue, pool: Pool,
    start_receiver: StartReceiver, start_dispatcher: Callable[..., Dispatcher],
) -> None:  # fmt: skip
    """acme has a subscription (the API), initech a flow job's callback (the in-process
    ``Queue.submit_flow``), globex nothing: only globex's entries are skipped."""
    receiver = await start_receiver()
    await pool.execute(query("secret_create_if_missing"), "initech", new_secret())
    producer = await callback_producer(hook_settings)
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


async def unmark_now(queue: Queue, pool: Pool) -> int:
    """One clean-up round over every mark, however young (``min_age`` 0)."""
    return await marks.unmark_idle(queue.redis, queue.keys, DeliveryStore(pool), 0.0)


async def test_the_dispatcher_unmarks_a_tenant_whose_last_target_is_gone(
    hook_api: ApiServer, hook_settings: Settings, queue: Queue, pool: Pool,
    start_receiver: StartReceiver, start_dispatcher: Callable[..., Dispatcher],
) -> None:  # fmt: skip
    """acme adds two subscriptions and deletes both: unmarked by the running dispatcher (its
    entries are then skipped); globex keeps one: still marked. acme subscribes again after
    the unmark, and that subscription's webhooks are delivered."""
    receiver = await start_receiver()
    d = start_dispatcher(webhook_unmark_interval_seconds=0.05)
    async with hook_api.client("acme") as a, hook_api.client("globex") as g:
        made = [await a.post("/v1/webhooks", json={"url": receiver.url}) for _ in range(2)]
        assert all(r.status_code == 201 for r in made), [r.text for r in made]
        assert (await g.post("/v1/webhooks", json={"url": receiver.url})).status_code == 201
        assert await is_marked(queue, "acme") and await is_marked(queue, "globex")
        first = made[0].json()["id"]
        assert (await a.delete(f"/v1/webhooks/{first}")).status_code == 204
        assert (await a.delete(f"/v1/webhooks/{made[1].json()['id']}")).status_code == 204
        await wait_for(lambda: not_marked(queue, "acme"))
        # the mark is gone from Redis before the dispatcher's task has the script's reply
        await wait_for(lambda: d.stats.unmarked >= 1)
        assert d.metrics().counters["dispatcher_tenants_unmarked_total"] == {"": d.stats.unmarked}
        # globex has a target: a round over every mark, however young, keeps it
        assert await unmark_now(queue, pool) == 0
        assert await is_marked(queue, "globex")
        # acme's transitions now skip the look-up
        skipped = d.stats.skipped
        (await a.post("/v1/jobs", json={"type": "echo"})).raise_for_status()
        await run_jobs(queue)
        await wait_for(lambda: d.stats.skipped >= skipped + 3)
        # subscribed again after the unmark: marked, and delivered
        again = await a.post("/v1/webhooks", json={"url": receiver.url})
        assert again.status_code == 201, again.text
        assert await is_marked(queue, "acme")
        job = (await a.post("/v1/jobs", json={"type": "echo"})).json()["id"]
        await run_jobs(queue)
        await wait_for(lambda: delivered(a, job))
    assert len(receiver.requests) == 1  # the deleted subscriptions were sent nothing


async def not_marked(queue: Queue, tenant: str) -> bool:
    return not await is_marked(queue, tenant)


async def test_a_job_callback_keeps_its_tenant_marked_until_it_is_deleted(
    callback_producer: StartProducer, hook_api: ApiServer, hook_settings: Settings, queue: Queue, pool: Pool,
    start_receiver: StartReceiver,
) -> None:  # fmt: skip
    """initech's only target is a job's callback (kept with the job: a replay may make more
    transitions); globex's only subscription is disabled (a 410): no target."""
    receiver = await start_receiver()
    await pool.execute(query("secret_create_if_missing"), "initech", new_secret())
    producer = await callback_producer(hook_settings)
    try:
        job = await producer.submit("echo", tenant="initech", callback=receiver.url)
    finally:
        await producer.close()
    async with hook_api.client("globex") as g:
        hook = (await g.post("/v1/webhooks", json={"url": receiver.url})).json()["id"]
    await pool.execute("UPDATE webhook_subscriptions SET disabled_at = now() WHERE id = $1", hook)
    assert await unmark_now(queue, pool) == 1
    assert await is_marked(queue, "initech") and not await is_marked(queue, "globex")
    # what retention does with the job's rows (the jobs_deleted trigger)
    await pool.execute("DELETE FROM webhook_job_callbacks WHERE job_id = $1", job.job_id)
    assert await unmark_now(queue, pool) == 1
    assert not await is_marked(queue, "initech")


async def test_an_unmark_crossing_a_subscriptions_creation_loses_no_delivery(
    hook_api: ApiServer, queue: Queue, pool: Pool, start_receiver: StartReceiver,
    start_dispatcher: Callable[..., Dispatcher],
) -> None:  # fmt: skip
    """The race the second mark closes: the API has marked acme and its insert waits (a lock
    the test holds); a clean-up round asks Postgres then, finds no target and removes the
    mark. Once the insert commits, the API marks again before it answers, so the job
    submitted after the answer is delivered."""
    receiver = await start_receiver()
    async with hook_api.client("acme") as a, pool.acquire() as blocker:
        tx = blocker.transaction()
        await tx.start()
        await blocker.execute("LOCK TABLE webhook_subscriptions IN EXCLUSIVE MODE")  # reads pass
        create = asyncio.create_task(a.post("/v1/webhooks", json={"url": receiver.url}))
        try:
            await wait_for(lambda: is_marked(queue, "acme"))
            await wait_for(lambda: waiting_for_a_lock_on(pool, "webhook_subscriptions"))
            assert await unmark_now(queue, pool) == 1  # the first mark is gone
            assert not await is_marked(queue, "acme")
        finally:
            await tx.commit()
        r = await create
        assert r.status_code == 201, r.text
        assert await is_marked(queue, "acme")  # the second mark
        job = (await a.post("/v1/jobs", json={"type": "echo"})).json()["id"]
        await run_jobs(queue)
        start_dispatcher()
        await wait_for(lambda: delivered(a, job))
    assert len(receiver.requests) == 1


async def test_a_mark_written_again_during_a_clean_up_round_is_kept(
    hook_api: ApiServer, queue: Queue, pool: Pool
) -> None:
    """A round reads acme's mark, then waits for Postgres (a lock the test holds); meanwhile
    the mark is written again, as a target's creation writes it: the round, told there is no
    target, removes nothing, since the mark no longer holds the value it read."""
    await marks.mark(queue.redis, queue.keys, ["acme"])
    async with pool.acquire() as blocker:
        tx = blocker.transaction()
        await tx.start()
        await blocker.execute("LOCK TABLE webhook_subscriptions IN ACCESS EXCLUSIVE MODE")
        round_ = asyncio.create_task(unmark_now(queue, pool))
        try:
            await wait_for(lambda: waiting_for_a_lock_on(pool, "webhook_subscriptions"))
            await marks.mark(queue.redis, queue.keys, ["acme"])
        finally:
            await tx.commit()
        assert await round_ == 0
    assert await is_marked(queue, "acme")
    assert await unmark_now(queue, pool) == 1  # the next round, with no target, removes it
    assert not await is_marked(queue, "acme")


async def test_an_unmark_crossing_a_callbacks_write_loses_no_delivery(
    callback_producer: StartProducer, hook_settings: Settings, queue: Queue, pool: Pool, start_receiver: StartReceiver,
    start_dispatcher: Callable[..., Dispatcher],
) -> None:  # fmt: skip
    """The same race for a job's own callback (``CallbackStore.register``, here through the
    in-process ``Queue.submit``): its first mark removed while the row waits, the second
    written before the job is submitted, and the callback delivered."""
    receiver = await start_receiver()
    await pool.execute(query("secret_create_if_missing"), "initech", new_secret())
    producer = await callback_producer(hook_settings)
    try:
        async with pool.acquire() as blocker:
            tx = blocker.transaction()
            await tx.start()
            await blocker.execute("LOCK TABLE webhook_job_callbacks IN EXCLUSIVE MODE")
            submit = asyncio.create_task(
                producer.submit("echo", tenant="initech", callback=receiver.url)
            )
            try:
                await wait_for(lambda: is_marked(queue, "initech"))
                await wait_for(lambda: waiting_for_a_lock_on(pool, "webhook_job_callbacks"))
                assert await unmark_now(queue, pool) == 1
                assert not await is_marked(queue, "initech")
                assert await log_entries(queue, "initech") == 0  # not submitted yet
            finally:
                await tx.commit()
            job = await submit
        assert await is_marked(queue, "initech")  # marked again, before the submit
        await run_jobs(queue)
        d = start_dispatcher()

        async def callback_delivered() -> bool:
            state = await pool.fetchval(
                "SELECT state FROM webhook_deliveries WHERE job_id = $1", job.job_id
            )
            return bool(state == "delivered")

        await wait_for(callback_delivered)
    finally:
        await producer.close()
    assert d.stats.skipped == 0
    assert len(receiver.requests) == 1
