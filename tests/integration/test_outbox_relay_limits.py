"""The outbox relay against real Postgres and Redis: a row waiting for a row another relay
holds, an encrypted task without keys, the API's global admission limits, and the sizes
jobtier.submit bounds."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from jobtier import demo, outbox
from jobtier.config import Settings
from jobtier.core.model import JobSpec, State
from jobtier.engine.produce import Producer
from jobtier.engine.queue import Queue
from jobtier.metrics.snapshot import labels
from jobtier.persist.db import Pool
from jobtier.persist.outbox import OutboxRelay
from jobtier.persist.pg_reader import PgReader
from jobtier.store.context import Store
from jobtier.store.redis import RedisClient
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import TaskRegistry, task
from tests.fixtures.engine import wait_for, worker_for
from tests.fixtures.redis import on_every_server
from tests.tasks import registry


@task(encrypt=True, retries=0)
async def sealed_echo(ctx: JobContext, payload: Any) -> Any:
    return payload


@pytest.fixture
async def app(pg_dsn: str) -> AsyncIterator[asyncpg.Connection[Any]]:
    conn: asyncpg.Connection[Any] = await asyncpg.connect(pg_dsn)
    yield conn
    await conn.close()


async def relay_of(
    settings: Settings, pool: Pool, queue: Queue, tasks: Any = registry
) -> OutboxRelay:
    """A relay after its first pass (it has recorded what jobtier.submit reads)."""
    relay = OutboxRelay(settings, pool, Producer(Store(settings, queue.redis), tasks, True, None))
    assert await relay.drain() == 0
    return relay


async def row(pool: Pool, job_id: str) -> Any:
    return await pool.fetchrow("SELECT relayed_at, error FROM jobtier.outbox WHERE id = $1", job_id)


async def test_a_row_waiting_for_a_row_another_relay_holds_stays_pending(
    app: Any, pg_settings: Settings, pg_pool: Pool, queue: Queue, pg_dsn: str
) -> None:
    relay = await relay_of(pg_settings, pg_pool, queue)
    parent = await outbox.submit(app, "echo", {"step": 1})
    child = await outbox.submit(app, "echo", {"step": 2}, depends_on=[parent])
    stranger = await outbox.submit(app, "echo", {}, depends_on=[parent], tenant="other")

    other_relay = await asyncpg.connect(pg_dsn)  # holds the parent's row, as a relay's pass does
    try:
        async with other_relay.transaction():
            await other_relay.execute(
                "SELECT 1 FROM jobtier.outbox WHERE id = $1 FOR UPDATE", parent
            )
            assert await relay.drain() == 1  # the stranger's: refused, not the tenant's row
            assert relay.stats.refused == 1 and relay.stats.deferred >= 1
            child_row = await row(pg_pool, child)
            assert child_row["relayed_at"] is None and child_row["error"] is None
            assert (await row(pg_pool, stranger))["error"] is not None
    finally:
        await other_relay.close()

    await drained(relay, 2)  # (a row left for later is read again a moment later)
    assert relay.stats.refused == 1 and relay.stats.relayed == 2
    assert (await queue.status(child)).state is State.WAITING
    assert relay.metrics().counters["outbox_deferred_total"][""] >= 1


async def drained(relay: OutboxRelay, rows: int) -> None:
    """Drain until ``rows`` more rows were handled: a row left for later (its dependency
    not relayed yet) is read again a moment later (DEPENDENT_RECHECK)."""
    handled = 0

    async def done() -> bool:
        nonlocal handled
        handled += await relay.drain()
        return handled >= rows

    await wait_for(done, timeout=30)
    assert handled == rows


class SlowProducer(Producer):
    """A producer that lets another relay run a pass before each submit into Redis: the
    window in which a relay holds rows whose jobs Redis does not have yet."""

    def __init__(self, *args: Any, meanwhile: Any) -> None:
        super().__init__(*args)
        self.meanwhile = meanwhile

    async def submit_prepared(self, *args: Any, **kwargs: Any) -> Any:
        await self.meanwhile()
        return await super().submit_prepared(*args, **kwargs)


@pytest.mark.contract
async def test_two_relays_a_dependent_taken_while_the_other_holds_its_parent(
    app: Any, pg_settings: Settings, pg_pool: Pool, queue: Queue
) -> None:
    """The reviewer's case: relay 1 has locked the parent's row and not yet submitted it;
    relay 2 takes the dependent meanwhile."""
    second = await relay_of(pg_settings, pg_pool, queue)
    seen: list[int] = []

    async def second_pass() -> None:
        seen.append(await second.drain())

    producer = SlowProducer(queue.store, registry, True, None, meanwhile=second_pass)
    first = OutboxRelay(pg_settings, pg_pool, producer, batch_size=1)
    async with app.transaction():
        parent = await outbox.submit(app, "echo", {"step": 1})
        child = await outbox.submit(app, "echo", {"step": 2}, depends_on=[parent])

    assert await first.relay_once() == 1  # the parent; the second relay ran before its submit
    assert seen == [0] and second.stats.refused == 0 and second.stats.deferred == 1
    assert (await row(pg_pool, child))["relayed_at"] is None
    await drained(second, 1)
    assert second.stats.refused == 0
    assert (await queue.status(child)).state is State.WAITING


async def test_an_encrypted_task_without_keys_is_refused_alone(
    app: Any, pg_settings: Settings, pg_pool: Pool, queue: Queue
) -> None:
    tasks = TaskRegistry([demo.echo, sealed_echo])
    relay = await relay_of(pg_settings, pg_pool, queue, tasks)
    async with app.transaction():
        sealed = await outbox.submit(app, "sealed_echo", {"card": "4111"})
        after = [await outbox.submit(app, "echo", {"n": n}) for n in range(2)]

    assert await relay.drain() == 3  # not a failed pass retried for ever
    assert relay.stats.refused == 1 and relay.stats.relayed == 2
    for job_id in after:
        assert (await queue.status(job_id)).state is State.QUEUED
    found = await PgReader(pg_pool).status_docs([sealed])
    assert sealed in found
    refused = await row(pg_pool, sealed)
    assert "JOBTIER_ENCRYPTION_KEYS" in refused["error"]
    assert refused["error"].startswith("refused by the outbox relay")


@pytest.mark.contract
async def test_the_relay_pauses_past_the_waiting_cap(
    app: Any, pg_settings: Settings, pg_pool: Pool, queue: Queue
) -> None:
    await queue.submit_many([JobSpec(type="echo", payload=n) for n in range(2)])
    # its first pass records the limits jobtier.submit reads, though it takes no rows
    relay = await relay_of(pg_settings.replace(max_waiting_total=2), pg_pool, queue)
    job_id = await outbox.submit(app, "echo", {})
    assert await relay.drain() == 0
    assert await relay.pending() == 1 and (await row(pg_pool, job_id))["relayed_at"] is None
    assert relay.metrics().counters["outbox_paused_total"][labels(reason="waiting")] >= 1

    assert (await worker_for(queue, registry, burst=True).run()).succeeded == 2

    async def relayed() -> bool:  # the gate rereads the counts once a second
        return await relay.drain() == 1

    await wait_for(relayed)
    assert (await queue.status(job_id)).state is State.QUEUED


async def test_the_relay_counts_what_it_relays_between_readings(
    app: Any, pg_settings: Settings, pg_pool: Pool, queue: Queue
) -> None:
    settings = pg_settings.replace(max_waiting_total=2, outbox_batch_size=1)
    relay = await relay_of(settings, pg_pool, queue)
    async with app.transaction():
        ids = [await outbox.submit(app, "echo", {"n": n}) for n in range(3)]
    # read empty a moment ago (or read again: two waiting), the cap stops it at two
    assert await relay.drain() == 2
    assert await relay.pending() == 1 and (await row(pg_pool, ids[2]))["relayed_at"] is None


@pytest.mark.contract
async def test_the_relay_pauses_while_redis_memory_is_past_the_refuse_ratio(
    app: Any, pg_settings: Settings, pg_pool: Pool, queue: Queue, redis: RedisClient
) -> None:
    infos = await on_every_server(queue.redis, "INFO", "memory")
    # room for every write, yet used / maxmemory well past the ratio of this relay
    limit = max(int(i["used_memory"]) for i in infos) * 4
    try:
        await on_every_server(redis, "CONFIG", "SET", "maxmemory", str(limit))
        settings = pg_settings.replace(redis_memory_refuse_ratio=0.001)
        relay = await relay_of(settings, pg_pool, queue)
        job_id = await outbox.submit(app, "echo", {})
        assert await relay.drain() == 0
        assert await relay.pending() == 1
        assert relay.stats.paused.get("memory", 0) >= 1
    finally:
        await on_every_server(redis, "CONFIG", "SET", "maxmemory", "0")

    async def relayed() -> bool:
        return await relay.drain() == 1

    await wait_for(relayed)
    assert (await queue.status(job_id)).state is State.QUEUED


async def test_submit_bounds_payload_and_depends_on_to_the_recorded_limits(
    app: Any, pg_settings: Settings, pg_pool: Pool, queue: Queue
) -> None:
    await relay_of(pg_settings.replace(max_payload_bytes=64, max_flow_jobs=2), pg_pool, queue)
    ok = await outbox.submit(app, "echo", {"text": "x" * 40})
    ids = [await outbox.submit(app, "echo", {}) for _ in range(3)]
    with pytest.raises(asyncpg.InvalidParameterValueError) as caught:
        await outbox.submit(app, "echo", {"text": "x" * 100})
    assert caught.value.column_name == "payload"
    assert "JOBTIER_MAX_PAYLOAD_BYTES" in str(caught.value) and "64" in str(caught.value)
    assert caught.value.sqlstate == "22023"
    with pytest.raises(asyncpg.InvalidParameterValueError) as caught:
        await outbox.submit(app, "echo", {}, depends_on=ids)
    assert caught.value.column_name == "depends_on"
    assert "JOBTIER_MAX_FLOW_JOBS" in str(caught.value)
    assert await outbox.submit(app, "echo", {}, depends_on=ids[:2])
    count = await pg_pool.fetchval("SELECT count(*) FROM jobtier.outbox")
    assert count == 5 and ok in [
        r["id"] for r in await pg_pool.fetch("SELECT id FROM jobtier.outbox")
    ]
