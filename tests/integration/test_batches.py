"""Batches on the real scripts, on the single Redis and the Redis Cluster (``contract``):
counts kept where children finish, the callback job once all have, chunking, cancel, retry
of failed children, hand-offs applied twice, refused batches, and plain jobs left as they
were."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, cast

import pytest

from jobtier.config import Settings
from jobtier.core.batch_model import BatchCallback, BatchNotFound, BatchSpec, BatchStatus
from jobtier.core.errors import Code, InvalidRequest
from jobtier.core.model import State
from jobtier.engine.queue import Queue
from jobtier.flows import batches as store_batches
from jobtier.flows.resolver import Resolver
from jobtier.store.calls import reclaim_call
from tests.batch_tasks import registry
from tests.fixtures.engine import wait_for, worker_for

pytestmark = pytest.mark.contract


@pytest.fixture
async def bq(settings: Settings) -> AsyncIterator[Queue]:
    q = await Queue.connect(settings, registry)
    yield q
    await q.close()


async def run_all(queue: Queue, rounds: int = 50) -> None:
    """Burst workers and resolver passes in turn until neither finds anything to do."""
    resolver = Resolver(queue.store, name="test-resolver")
    for _ in range(rounds):
        stats = await worker_for(queue, registry, burst=True).run()
        moved = await resolver.drain()
        if not moved and not stats.claimed:
            return
    raise AssertionError(f"batches still moving after {rounds} rounds")


async def children(queue: Queue, batch_id: str) -> list[str]:
    """The batch's children's ids (derived from its id: flows/batches.py)."""
    total = (await queue.batches.status(batch_id)).total
    return store_batches.child_ids(queue.keys, batch_id, total)


def counts(b: BatchStatus) -> tuple[int, int, int, int]:
    return b.pending, b.succeeded, b.failed, b.cancelled


async def test_a_batch_runs_its_children_and_then_its_callback(bq: Queue) -> None:
    items = [{"n": i} for i in range(300)]
    b = await bq.submit_batch(
        "part", items, callback=BatchCallback(type="summary", payload={"report": "to-me"})
    )
    assert (b.state, b.total, counts(b)) == ("running", 300, (300, 0, 0, 0))
    ids = await children(bq, b.id)
    assert len(ids) == 300
    # spread over the shards (several Cluster nodes), each child a plain queued job
    assert len({bq.keys.shard_of(i) for i in ids}) > 1
    assert (await bq.status(ids[0])).state is State.QUEUED

    await run_all(bq)
    done = await bq.batches.status(b.id)
    assert (done.state, counts(done)) == ("finished", (0, 300, 0, 0))
    assert done.finished_at_ms is not None and done.callback_job is not None
    status, result = await bq.result(done.callback_job)
    assert status.state is State.SUCCEEDED
    assert result == {
        "batch_id": b.id,
        "total": 300,
        "succeeded": 300,
        "failed": 0,
        "cancelled": 0,
        "payload": {"report": "to-me"},
    }
    assert sorted([(await bq.result(i))[1]["n"] for i in ids]) == list(range(300))


async def test_chunk_size_makes_one_child_per_chunk(bq: Queue) -> None:
    b = await bq.submit_batch("part", list(range(25)), chunk_size=10)
    assert b.total == 3
    await run_all(bq)
    got = sorted([(await bq.result(i))[1] for i in await children(bq, b.id)], key=str)
    assert got == sorted(
        [
            {"offset": 0, "items": list(range(10))},
            {"offset": 10, "items": list(range(10, 20))},
            {"offset": 20, "items": list(range(20, 25))},
        ],
        key=str,
    )
    done = await bq.batches.status(b.id)
    assert (done.state, counts(done), done.callback_job) == ("finished", (0, 3, 0, 0), None)


async def test_failed_children_are_counted_and_retried(bq: Queue) -> None:
    items: list[Any] = [{"n": i, "fail": i % 4 == 0} for i in range(40)]
    b = await bq.submit_batch("part", items, callback=BatchCallback(type="summary"))
    await run_all(bq)
    first = await bq.batches.status(b.id)
    assert (first.state, counts(first)) == ("finished", (0, 30, 10, 0))
    callback = first.callback_job
    assert callback is not None
    assert (await bq.result(callback))[1]["failed"] == 10

    retried = await bq.batches.retry(b.id)
    assert retried.changed == 10
    assert (retried.batch.state, counts(retried.batch)) == ("running", (10, 30, 0, 0))
    await run_all(bq)
    again = await bq.batches.status(b.id)
    assert (again.state, counts(again)) == ("finished", (0, 40, 0, 0))
    # one callback per batch: the first completion's
    assert again.callback_job == callback
    assert (await bq.batches.retry(b.id)).changed == 0


async def test_cancel_cancels_every_child_not_started(bq: Queue) -> None:
    b = await bq.submit_batch(
        "part", [{"n": i} for i in range(2500)], callback=BatchCallback(type="summary")
    )
    out = await bq.batches.cancel(b.id)
    assert (out.changed, out.requested) == (2500, 0)
    assert out.batch.cancel_requested
    ids = await children(bq, b.id)
    assert {(await bq.status(i)).state for i in ids[:50]} == {State.CANCELLED}
    stats = await bq.admin.stats()
    assert stats["total"]["queued"] == 0
    await run_all(bq)  # the resolver ends it, and runs its callback
    done = await bq.batches.status(b.id)
    assert (done.state, counts(done)) == ("finished", (0, 0, 0, 2500))
    assert done.callback_job is not None
    assert (await bq.result(done.callback_job))[1]["cancelled"] == 2500
    assert (await bq.batches.cancel(b.id)).changed == 0  # nothing left to cancel


async def test_a_cancel_asks_running_children_to_stop(bq: Queue) -> None:
    b = await bq.submit_batch("part", [{"n": 1}])
    (child,) = await children(bq, b.id)
    claimed = await bq.scripts.claim(bq.keys.shard_of(child), "worker-a", 1, 30_000)
    assert [j.id for j in claimed.jobs] == [child]
    out = await bq.batches.cancel(b.id)
    assert (out.changed, out.requested) == (0, 1)
    assert (await bq.status(child)).cancel_requested


async def test_a_child_whose_lease_expires_on_its_last_attempt_counts_as_failed(
    bq: Queue,
) -> None:
    b = await bq.submit_batch("part", [{"n": 1}], max_attempts=1)
    (child,) = await children(bq, b.id)
    shard = bq.keys.shard_of(child)
    claimed = await bq.scripts.claim(shard, "worker-a", 1, 1)  # a lease of 1 ms
    assert [j.id for j in claimed.jobs] == [child]
    s = bq.settings

    async def reclaimed() -> bool:
        await bq.scripts.call(
            *reclaim_call(shard, 100, s.retention_seconds, s.dead_retention_seconds)
        )
        return (await bq.status(child)).state is State.FAILED

    await wait_for(reclaimed)
    await run_all(bq)  # the resolver ends the batch
    done = await bq.batches.status(b.id)
    assert (done.state, counts(done)) == ("finished", (0, 0, 1, 0))


async def test_hand_offs_applied_twice_change_nothing(bq: Queue) -> None:
    b = await bq.submit_batch("part", [{"n": i} for i in range(20)])
    shard = bq.keys.shard_of(b.id)
    await run_all(bq)
    done = await bq.batches.status(b.id)
    assert (done.state, counts(done)) == ("finished", (0, 20, 0, 0))
    record = store_batches.record_key(bq.store, b.id)
    before = cast(dict[bytes, bytes], await bq.redis.hgetall(record))
    some = next(k.decode()[2:] for k in before if k.startswith(b"e:"))
    epoch = before[f"e:{some}".encode()].decode()
    # the same hand-off again (a resolver died before it acknowledged), and an older one
    item = [b.id, some, "open", f"{epoch} 0 0 0"]
    older = [b.id, some, "open", "0 0 0 0"]
    reply = await bq.scripts.call("batch_done", shard, [60, 2, *item, *older])
    assert [Code(c) for c in reply] == [Code.DUPLICATE, Code.DUPLICATE]
    assert await bq.redis.hgetall(record) == before
    missing = await bq.scripts.call(
        "batch_done", shard, [60, 1, bq.keys.new_id(shard), "0", "done", "1 0 0 0"]
    )
    assert [Code(c) for c in missing] == [Code.NOT_FOUND]


async def test_children_finishing_before_the_submit_ends_do_not_end_the_batch(
    bq: Queue,
) -> None:
    # the submit's steps by hand: the hold, one child made and finished, then the seal
    keys = bq.keys
    batch_id = f"{keys.new_id(0)[: store_batches.PREFIX]}00000000-0"
    (child,) = store_batches.child_ids(keys, batch_id, 1)
    assert keys.shard_of(child) == 1
    await bq.redis.hset(
        store_batches.record_key(bq.store, batch_id),
        mapping={"tenant": "default", "total": 1, "shards": "1", "open": 1, "state": "running"},
    )
    counts_key = f"{keys.base(1)}bt:{batch_id[:18]}"
    await bq.redis.hset(counts_key, mapping={"bid": batch_id, "hold": 1})  # the hold
    await bq.redis.hincrby(counts_key, "left", 1)
    args = [batch_id, "default", "part", "default", "normal", 1, "", 1, child, b'{"n":1}']
    await bq.scripts.call("batch_submit", 1, args)
    await run_all(bq)
    status = await bq.batches.status(batch_id)
    assert (status.state, counts(status)) == ("running", (0, 1, 0, 0))  # not sealed yet
    assert await bq.scripts.call("batch_seal", 1, [batch_id]) == 0
    await run_all(bq)
    assert (await bq.batches.status(batch_id)).state == "finished"


async def test_plain_jobs_pay_nothing_for_batches(bq: Queue) -> None:
    job = await bq.submit("part", {"n": 1})
    await run_all(bq)
    assert await bq.redis.hget(bq.keys.job(job.job_id), "wf") is None
    assert await bq.redis.hget(bq.keys.job(job.job_id), "bid") is None
    shard = bq.keys.shard_of(job.job_id)
    assert [k async for k in bq.redis.scan_iter(match=f"{bq.keys.base(shard)}bt:*")] == []


async def test_bad_batches_are_refused_naming_the_member(bq: Queue) -> None:
    control = bq.batches
    cases: list[tuple[BatchSpec, str]] = [
        (BatchSpec(type="part", items=[]), "items"),
        (BatchSpec(type="part", items=[1], chunk_size=0), "chunk_size"),
        (BatchSpec(type="part", items=[1], priority="urgent"), "priority"),
        (BatchSpec(type="nope", items=[1]), "type"),
        (BatchSpec(type="part", items=["x" * 2_000_000]), "items"),
        (
            BatchSpec(type="part", items=[1], callback=BatchCallback(type="nope")),
            "callback.type",
        ),
    ]
    for spec, field in cases:
        with pytest.raises(InvalidRequest) as caught:
            await control.prepare(spec, "default")
        assert caught.value.field == field, (spec, caught.value)
    with pytest.raises(InvalidRequest) as caught:
        await control.prepare(BatchSpec(type="part", items=list(range(100_001))), "default")
    assert caught.value.field == "items"
    assert [k async for k in bq.redis.scan_iter(match="*batch:*")] == []


async def test_an_unknown_or_another_tenants_batch_is_not_found(bq: Queue) -> None:
    b = await bq.submit_batch("part", [1], tenant="acme")
    assert (await bq.batches.status(b.id, "acme")).total == 1
    for batch_id, tenant in [(b.id, "other"), (bq.keys.new_id(), "acme"), ("junk", "acme")]:
        with pytest.raises(BatchNotFound):
            await bq.batches.status(batch_id, tenant)
    with pytest.raises(BatchNotFound):
        await bq.batches.cancel(b.id, "other")
    assert (await bq.status((await children(bq, b.id))[0])).state is State.QUEUED
