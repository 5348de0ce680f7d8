"""Promoting a scheduled job: a delayed one before its run-at, or one waiting out a retry's
back-off, runs now (real Redis, a real worker)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from jobtier.core.errors import JobNotFound, Retry, TransitionRefused
from jobtier.core.model import State
from jobtier.engine.queue import Queue
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import TaskRegistry, task
from tests.fixtures.engine import Background, wait_for, worker_for
from tests.fixtures.redis import logged


@task(name="again_in_an_hour", retries=3)
async def again_in_an_hour(ctx: JobContext, payload: Any) -> int:
    if ctx.attempt == 1:
        raise Retry("not yet", delay=3600)
    return ctx.attempt


@task(name="noted")
async def noted(ctx: JobContext, payload: Any) -> Any:
    return payload


REGISTRY = TaskRegistry([again_in_an_hour, noted])


async def until(queue: Queue, job_id: str, state: State) -> None:
    async def reached() -> bool:
        return (await queue.status(job_id)).state is state

    await wait_for(reached, timeout=20)


async def test_a_delayed_job_promoted_runs_now(queue: Queue, background: Background) -> None:
    background.start(worker_for(queue, REGISTRY))
    job_id = (await queue.submit("noted", {"n": 1}, delay=3600)).job_id
    before = await queue.status(job_id)
    assert before.state is State.SCHEDULED
    promoted = await queue.jobs.promote(job_id)
    assert promoted.state is State.QUEUED and promoted.version == before.version + 1
    assert promoted.run_at is not None
    moved = datetime.fromisoformat(promoted.run_at)
    assert abs((moved - datetime.now(UTC)).total_seconds()) < 60  # now, not in an hour
    await until(queue, job_id, State.SUCCEEDED)
    assert (await queue.result(job_id))[1] == {"n": 1}
    # its log carries the promotion as a transition (the write-behind's history has it)
    shard = queue.keys.shard_of(job_id)
    states = [f[b"d"] for f in await logged(queue.redis, queue.keys.log(shard))]
    assert sum(job_id.encode() in d and b'"state":"queued"' in d for d in states) == 1


async def test_a_retry_waiting_out_its_backoff_promoted_runs_its_next_attempt(
    queue: Queue, background: Background
) -> None:
    background.start(worker_for(queue, REGISTRY))
    job_id = (await queue.submit("again_in_an_hour", None)).job_id

    async def backing_off() -> bool:
        s = await queue.status(job_id)
        return s.state is State.SCHEDULED and s.attempt == 1

    await wait_for(backing_off, timeout=20)
    promoted = await queue.jobs.promote(job_id)
    assert promoted.state is State.QUEUED and promoted.attempt == 1  # not counted again
    await until(queue, job_id, State.SUCCEEDED)
    assert (await queue.result(job_id))[1] == 2


@pytest.mark.parametrize("state", [State.QUEUED, State.SUCCEEDED, State.CANCELLED])
async def test_only_a_scheduled_job_is_promoted(queue: Queue, state: State) -> None:
    job_id = (
        await queue.submit("noted", None, delay=3600 if state is State.CANCELLED else None)
    ).job_id
    if state is State.CANCELLED:
        await queue.cancel(job_id)
    elif state is State.SUCCEEDED:
        await worker_for(queue, REGISTRY, burst=True).run()
    before = await queue.status(job_id)
    assert before.state is state
    with pytest.raises(TransitionRefused):
        await queue.jobs.promote(job_id)
    assert await queue.status(job_id) == before  # nothing changed


async def test_another_tenants_job_is_not_found(queue: Queue) -> None:
    job_id = (await queue.submit("noted", None, delay=3600, tenant="acme")).job_id
    with pytest.raises(JobNotFound):
        await queue.jobs.promote(job_id, tenant="globex")
    assert (await queue.status(job_id)).state is State.SCHEDULED
    assert (await queue.jobs.promote(job_id, tenant="acme")).state is State.QUEUED


async def test_a_promoted_job_waits_its_turn_behind_its_concurrency_key(
    queue: Queue, background: Background
) -> None:
    first = (await queue.submit("noted", 1, concurrency_key="acct")).job_id
    later = (await queue.submit("noted", 2, concurrency_key="acct", delay=3600)).job_id
    shard = queue.keys.shard_of(first)
    assert await queue.redis.zscore(queue.keys.sched(shard), later) is not None
    assert (await queue.jobs.promote(later)).state is State.QUEUED
    assert await queue.redis.zscore(queue.keys.sched(shard), later) is None  # due no more
    stats = await queue.admin.stats()
    assert (stats["total"]["queued"], stats["total"]["held"]) == (1, 1)  # held behind `first`
    background.start(worker_for(queue, REGISTRY))
    await until(queue, later, State.SUCCEEDED)  # admitted once `first` ended
    assert (await queue.result(later))[1] == 2
    assert (await queue.admin.stats())["total"]["held"] == 0
