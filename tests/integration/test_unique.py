"""Unique keys (docs/debounce-throttle.md): at most one job of a key at a time, until it
finishes or until it starts; keyed.lua decides and creates in one step, on the single Redis
and on the Cluster, and the job's end frees its key (lib.lua finish)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from jobtier.config import Settings
from jobtier.core.debounce import Unique
from jobtier.core.errors import InvalidRequest, Retry
from jobtier.core.model import JobSpec, State
from jobtier.engine.queue import Queue
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import TaskRegistry, task
from tests.fixtures.engine import Background, wait_for, worker_for

pytestmark = pytest.mark.contract  # on the single Redis and on the Redis Cluster


@task(queue="reindex")
async def reindex(ctx: JobContext, payload: Any) -> Any:
    return payload


@task(queue="reindex", retries=2)
async def later(ctx: JobContext, payload: Any) -> None:
    raise Retry(delay=60)  # started, then scheduled again: not finished


released: asyncio.Event | None = None  # each test's own (an Event is bound to its loop)


@task(queue="reindex")
async def held_up(ctx: JobContext, payload: Any) -> None:
    assert released is not None
    await released.wait()  # running until the test lets it end


@task(queue="reindex", retries=0)
async def broken(ctx: JobContext, payload: Any) -> None:
    raise RuntimeError("fails for good")


async def record(queue: Queue, job_id: str, key: str, tenant: str = "default") -> Any:
    """The key's record: the job it names (None: the key is free)."""
    base = queue.keys.log(queue.keys.shard_of(job_id)).rpartition("log")[0]
    got = await queue.redis.get(f"{base}uq:{tenant}:{key}")
    return got.decode() if isinstance(got, bytes) else got


async def test_a_submit_while_the_keys_job_has_not_finished_answers_that_job(
    queue: Queue, background: Background
) -> None:
    first = await queue.submit(reindex, {"doc": 1}, unique={"key": "doc-1"})
    again = await queue.submit(reindex, {"doc": 2}, unique=Unique(key="doc-1"))
    assert first.created and not again.created and again.job_id == first.job_id
    assert again.status.version == first.status.version  # unchanged: no transition
    assert await queue.redis.hget(queue.keys.job(first.job_id), "payload") == b'{"doc":1}'
    other = await queue.submit(reindex, {"doc": 3}, unique={"key": "doc-3"})
    assert other.created and other.job_id != first.job_id
    assert await record(queue, first.job_id, "doc-1") == first.job_id
    background.start(worker_for(queue, TaskRegistry([reindex])))

    async def done() -> bool:
        return (await queue.status(first.job_id)).state is State.SUCCEEDED

    await wait_for(done)
    assert await record(queue, first.job_id, "doc-1") is None  # its end freed the key
    after = await queue.submit(reindex, {"doc": 4}, unique={"key": "doc-1"})
    assert after.created and after.job_id != first.job_id


async def test_a_jobspec_made_with_a_mapping_for_its_key_is_taken_as_the_option(
    queue: Queue,
) -> None:
    """A ``JobSpec`` built in Python does not check its fields' types: a mapping for
    ``unique`` reaches submit_many as it was given (it raised an AttributeError there)."""
    given = JobSpec(type="reindex", payload=1, unique={"key": "spec-1"})  # type: ignore[arg-type]
    [first] = await queue.submit_many([given])  # (a keyed job is submitted alone)
    [again] = await queue.submit_many([given])
    assert not isinstance(first, Exception) and not isinstance(again, Exception)
    assert first.created and not again.created and again.job_id == first.job_id
    bad = JobSpec(type="reindex", unique={"key": 5})  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest) as refused:
        await queue.submit_many([bad])
    assert refused.value.field == "unique.key"


@pytest.mark.parametrize("until", ["finished", "started"])
async def test_a_job_waiting_for_its_retry_holds_its_key_in_both_modes(
    queue: Queue, background: Background, until: str
) -> None:
    first = await queue.submit(later, 1, unique={"key": "k", "until": until})
    background.start(worker_for(queue, TaskRegistry([later])))

    async def retrying() -> bool:  # it ran, and waits for its second attempt
        status = await queue.status(first.job_id)
        return status.state is State.SCHEDULED and status.attempt == 1

    await wait_for(retrying)
    again = await queue.submit(later, 2, unique={"key": "k", "until": until})
    assert not again.created and again.job_id == first.job_id


async def test_a_running_job_holds_its_key_by_its_own_mode(
    queue: Queue, background: Background
) -> None:
    """Running, a job of until "started" lets a second in, one of "finished" does not; a
    submit's own mode does not change who holds the key (a "started" submit does not take it
    from a running "finished" job); an older job's end does not free a key a newer one has."""
    global released
    released = asyncio.Event()
    background.start(worker_for(queue, TaskRegistry([held_up])))
    waits = await queue.submit(held_up, 1, unique={"key": "w", "until": "started"})
    holds = await queue.submit(held_up, 2, unique={"key": "h"})

    async def running() -> bool:
        states = [(await queue.status(j.job_id)).state for j in (waits, holds)]
        return states == [State.RUNNING] * 2

    await wait_for(running)
    second = await queue.submit(held_up, 3, unique={"key": "w", "until": "started"})
    assert second.created and second.job_id != waits.job_id
    for mode in ("started", "finished"):
        same = await queue.submit(held_up, 4, unique={"key": "h", "until": mode})
        assert not same.created and same.job_id == holds.job_id, mode
    released.set()

    async def ended() -> bool:
        return (await queue.status(waits.job_id)).state is State.SUCCEEDED

    await wait_for(ended)
    # the first's end left the key to the second, which then ran and ended too (or runs)
    assert await record(queue, waits.job_id, "w") in (second.job_id, None)


async def test_a_replayed_unique_job_takes_its_key_back_unless_another_holds_it(
    queue: Queue, background: Background
) -> None:
    from jobtier.core.errors import TransitionRefused

    background.start(worker_for(queue, TaskRegistry([broken])))
    first = await queue.submit(broken, 1, unique={"key": "k"})

    async def dead() -> bool:
        return (await queue.status(first.job_id)).state is State.FAILED

    await wait_for(dead)
    await background.stop()  # the replayed job waits in its queue
    assert await record(queue, first.job_id, "k") is None  # its failure freed the key
    second = await queue.submit(broken, 2, delay=3600, unique={"key": "k"})
    assert second.created
    with pytest.raises(TransitionRefused) as refused:
        await queue.jobs.replay(first.job_id)
    assert refused.value.reason and second.job_id in refused.value.reason
    assert refused.value.holder == second.job_id
    assert (await queue.status(first.job_id)).state is State.FAILED  # unchanged
    passed = await queue.jobs.replay_many(type="broken")  # by filter: passed over, named
    assert passed == [] and passed.held == [(first.job_id, second.job_id)]
    await queue.cancel(second.job_id)
    await queue.jobs.replay(first.job_id)  # the key is free: it takes it back
    assert await record(queue, first.job_id, "k") == first.job_id
    again = await queue.submit(broken, 3, unique={"key": "k"})
    assert again.job_id == first.job_id and not again.created


async def test_a_delayed_unique_job_holds_its_key_until_cancelled(queue: Queue) -> None:
    first = await queue.submit(reindex, 1, delay=3600, unique={"key": "k", "until": "started"})
    assert first.status.state is State.SCHEDULED and first.status.run_at is not None
    again = await queue.submit(reindex, 2, unique={"key": "k", "until": "started"})
    assert again.job_id == first.job_id and not again.created
    await queue.cancel(first.job_id)
    assert await record(queue, first.job_id, "k") is None
    third = await queue.submit(reindex, 3, unique={"key": "k"})
    assert third.created and third.status.state is State.QUEUED


async def test_a_key_is_the_tenants(queue: Queue) -> None:
    a = await queue.submit(reindex, 1, unique={"key": "k"}, tenant="acme")
    b = await queue.submit(reindex, 1, unique={"key": "k"}, tenant="globex")
    assert a.created and b.created and a.job_id != b.job_id


async def test_racing_unique_submits_make_one_job(settings: Settings) -> None:
    queues = [await Queue.connect(settings, catalog=False) for _ in range(4)]
    try:
        results = await asyncio.gather(
            *(queues[i % 4].submit(reindex, i, unique={"key": "race"}) for i in range(40))
        )
        assert len({r.job_id for r in results}) == 1
        assert [r.created for r in results].count(True) == 1
        assert {r.status.version for r in results} == {1}  # the others changed nothing
    finally:
        for q in queues:
            await q.close()


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"unique": {"key": "a b"}}, "unique.key"),
        ({"unique": {"key": "k", "until": "ended"}}, "unique.until"),
        ({"unique": {"key": "k"}, "idempotency_key": "i"}, "unique"),
        ({"unique": {"key": "k"}, "concurrency_key": "c"}, "unique"),
        ({"unique": {"key": "k"}, "debounce": {"key": "k", "seconds": 5}}, "unique"),
        ({"unique": "k"}, "unique"),
    ],
)
async def test_bad_unique_options_are_refused_and_change_nothing(
    queue: Queue, options: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidRequest) as refused:
        await queue.submit(reindex, 1, **options)
    assert refused.value.field == field
    for shard in range(queue.keys.shards):
        assert await queue.redis.xlen(queue.keys.log(shard)) == 0


async def test_a_batch_refuses_a_unique_job(queue: Queue) -> None:
    specs = [JobSpec(type="reindex"), JobSpec(type="reindex", unique=Unique(key="k"))]
    with pytest.raises(InvalidRequest) as refused:
        await queue.submit_many(specs)
    assert refused.value.field == "jobs[1].unique"
