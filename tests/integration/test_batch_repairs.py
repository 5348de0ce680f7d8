"""Batches whose submit broke off or raced a cancel, and their counts' lifetime, on the real
scripts (single Redis and Cluster): a cancel ends a batch whose submit died part-way (the
children never made count as cancelled) and stops a submit still running; an idempotency
key answers a retried submit with the first batch; a shard's counts outlive its share until
the whole batch has finished, and a retry does not rebuild counts no longer kept."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from jobtier.config import Settings
from jobtier.core.batch_model import BatchCallback, BatchSpec
from jobtier.core.errors import IdempotencyConflict
from jobtier.core.model import State
from jobtier.engine.queue import Queue
from jobtier.flows import batches as store_batches
from jobtier.flows.resolver import Resolver
from jobtier.store.calls import Call
from tests.batch_tasks import registry
from tests.integration.test_batches import children, counts, run_all

pytestmark = pytest.mark.contract


@pytest.fixture
async def bq(settings: Settings) -> AsyncIterator[Queue]:
    q = await Queue.connect(settings, registry)
    yield q
    await q.close()


class Broken(ConnectionError):
    """The submit's Redis connection lost at a chosen round."""


def break_round(
    q: Queue, monkeypatch: pytest.MonkeyPatch, at: int, before: Any = None
) -> list[int]:
    """Make the submit's ``at``-th round of batch_submit calls raise (``before``: run it
    first instead, and let the round go on); returns the rounds seen."""
    scripts = q.store.scripts
    real = scripts.call_many
    seen: list[int] = []

    async def call_many(calls: Sequence[Call]) -> list[Any]:
        if calls and calls[0][0] == "batch_submit":
            seen.append(len(seen) + 1)
            if len(seen) == at:
                if before is None:
                    raise Broken("connection lost")
                await before()
        return await real(calls)

    monkeypatch.setattr(scripts, "call_many", call_many)
    return seen


def spec(n: int, key: str | None = None) -> BatchSpec:
    items = [{"n": i} for i in range(n)]
    out = BatchSpec(type="part", items=items, callback=BatchCallback(type="summary"))
    if key is not None:
        out.idempotency_key = key
    return out


async def test_a_batch_whose_submit_broke_off_ends_when_cancelled(
    bq: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_batches, "ROUND", 5)
    break_round(bq, monkeypatch, at=3)
    prepared = await bq.batches.prepare(spec(20), "default")
    with pytest.raises(Broken):
        await bq.batches.submit_prepared(prepared)
    monkeypatch.undo()
    batch_id = prepared.batch_id
    record = store_batches.record_key(bq.store, batch_id)
    assert not await bq.redis.hexists(record, "sealed")
    await run_all(bq)  # the two rounds made run; the batch cannot end by itself
    stuck = await bq.batches.status(batch_id)
    assert (stuck.state, counts(stuck)) == ("running", (10, 10, 0, 0))

    out = await bq.batches.cancel(batch_id)
    assert (out.changed, out.requested) == (10, 0)  # the ten never made
    await run_all(bq)
    done = await bq.batches.status(batch_id)
    assert (done.state, counts(done)) == ("finished", (0, 10, 0, 10))
    assert done.callback_job is not None
    assert (await bq.result(done.callback_job))[1]["cancelled"] == 10
    # the ids of the children never made stay unused
    ids = await children(bq, batch_id)
    assert [await bq.redis.exists(bq.keys.job(i)) for i in ids[10:]] == [0] * 10


async def test_a_cancel_during_the_submit_stops_its_later_rounds(
    bq: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_batches, "ROUND", 5)
    prepared = await bq.batches.prepare(spec(20), "default")
    changed: list[tuple[int, int]] = []

    async def cancel() -> None:
        changed.append(await store_batches.cancel_batch(bq.store, prepared.batch_id, None))

    rounds = break_round(bq, monkeypatch, at=2, before=cancel)
    status = await bq.batches.submit_prepared(prepared)
    assert rounds == [1, 2, 3, 4]  # the submit went on to its end
    assert await bq.redis.hget(store_batches.record_key(bq.store, status.id), "sealed") == b"1"
    assert changed == [(20, 0)]  # the five made cancelled, the fifteen others never made
    ids = await children(bq, status.id)
    assert [await bq.redis.exists(bq.keys.job(i)) for i in ids[5:]] == [0] * 15
    await run_all(bq)
    done = await bq.batches.status(status.id)
    assert (done.state, counts(done)) == ("finished", (0, 0, 0, 20))
    assert done.callback_job is not None


async def test_an_idempotency_key_answers_a_retried_submit_with_the_first_batch(
    bq: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_batches, "ROUND", 5)
    break_round(bq, monkeypatch, at=2)
    first = await bq.batches.prepare(spec(12, "nightly-42"), "default")
    with pytest.raises(Broken):
        await bq.batches.submit_prepared(first)
    monkeypatch.undo()
    again = await bq.batches.prepare(spec(12, "nightly-42"), "default")
    assert again.batch_id != first.batch_id
    status = await bq.batches.submit_prepared(again)
    assert (status.id, status.total) == (first.batch_id, 12)
    assert not await bq.redis.exists(store_batches.record_key(bq.store, again.batch_id))
    with pytest.raises(IdempotencyConflict) as conflict:
        await bq.batches.submit_prepared(
            await bq.batches.prepare(spec(13, "nightly-42"), "default")
        )
    assert conflict.value.job_id == first.batch_id
    # another tenant's key is its own
    other = await bq.batches.prepare(spec(12, "nightly-42"), "tenant-b")
    assert (await bq.batches.submit_prepared(other)).id == other.batch_id


async def test_a_shards_counts_are_kept_until_the_whole_batch_has_finished(
    bq: Queue, settings: Settings
) -> None:
    b = await bq.submit_batch("part", [{"n": 1}, {"n": 2}])
    first, second = await children(bq, b.id)
    one, two = bq.keys.shard_of(first), bq.keys.shard_of(second)
    assert one != two
    counts_key = f"{bq.keys.base(one)}bt:{b.id[:18]}"
    await bq.cancel(first)  # its shard's share has finished, the batch has not
    assert await Resolver(bq.store, name="test-resolver").drain() == 1  # the hand-off
    assert (await bq.batches.status(b.id)).state == "running"
    assert await bq.redis.ttl(counts_key) == -1
    await bq.cancel(second)
    await run_all(bq)
    assert (await bq.batches.status(b.id)).state == "finished"
    for shard in (one, two):
        ttl = await bq.redis.ttl(f"{bq.keys.base(shard)}bt:{b.id[:18]}")
        assert settings.retention_seconds < ttl <= settings.dead_retention_seconds


async def test_a_retry_does_not_rebuild_counts_no_longer_kept(bq: Queue) -> None:
    b = await bq.submit_batch("part", [{"n": 1, "fail": True}])
    await run_all(bq)
    assert counts(await bq.batches.status(b.id)) == (0, 0, 1, 0)
    (child,) = await children(bq, b.id)
    counts_key = f"{bq.keys.base(bq.keys.shard_of(child))}bt:{b.id[:18]}"
    await bq.redis.delete(counts_key)  # as when they expire
    assert (await bq.batches.retry(b.id)).changed == 1
    assert (await bq.status(child)).state == State.QUEUED
    assert not await bq.redis.exists(counts_key)


async def test_a_submit_that_wrote_nothing_frees_its_idempotency_key(
    bq: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    redis = bq.store.redis
    real = redis.pipeline

    def pipeline(*args: Any, **kwargs: Any) -> Any:
        pipe = real(*args, **kwargs)
        monkeypatch.setattr(redis, "pipeline", real)  # the first only: the submit's step 1

        async def execute(*_: Any, **__: Any) -> Any:
            raise Broken("connection lost before the record was written")

        pipe.execute = execute  # type: ignore[method-assign]
        return pipe

    monkeypatch.setattr(redis, "pipeline", pipeline)
    first = await bq.batches.prepare(spec(3, "k-1"), "default")
    with pytest.raises(Broken):
        await bq.batches.submit_prepared(first)
    monkeypatch.undo()
    again = await bq.batches.prepare(spec(3, "k-1"), "default")
    status = await bq.batches.submit_prepared(again)
    assert (status.id, status.total) == (again.batch_id, 3)
