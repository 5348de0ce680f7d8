"""A job's own timeout (``timeout`` at its submit): each of its attempts may run that long, in
place of its task's ``timeout``; the claim hands it to the worker (claim.lua, 'to' in the job's
hash: submit.lua). On the single Redis and on the Redis Cluster."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any

import pytest

from jobtier.core.debounce import Debounce, Throttle, Unique
from jobtier.core.errors import InvalidRequest
from jobtier.core.model import JobSpec, JobStatus, State
from jobtier.engine.queue import Queue
from jobtier.store.calls import claim_call, parse_claim
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import TaskRegistry, task
from tests.fixtures.engine import Background, wait_for, worker_for

pytestmark = pytest.mark.contract  # on the single Redis and on the Redis Cluster


@task(name="hangs", retries=0)
async def hangs(ctx: JobContext, payload: Any) -> None:
    await asyncio.Event().wait()  # never set: only a timeout (or a stop) ends it


@task(name="slow_but_bounded", retries=0, timeout=0.05)
async def slow_but_bounded(ctx: JobContext, payload: Any) -> str:
    await asyncio.sleep(0.5)  # ten times its task's timeout
    return "done"


@task(name="hangs_in_a_thread", retries=0)
def hangs_in_a_thread(ctx: JobContext, payload: Any) -> None:
    while not ctx.cancel_requested:  # a thread stops for the flag its timeout raises
        time.sleep(0.01)


REGISTRY = TaskRegistry([hangs, slow_but_bounded, hangs_in_a_thread])


async def ended(queue: Queue, job_id: str) -> JobStatus:
    async def done() -> bool:
        return (await queue.status(job_id)).state in (State.FAILED, State.SUCCEEDED)

    await wait_for(done, timeout=30)
    return await queue.status(job_id)


@pytest.mark.parametrize("type_", ["hangs", "hangs_in_a_thread"])
async def test_a_jobs_own_timeout_bounds_a_task_that_has_none(
    queue: Queue, background: Background, type_: str
) -> None:
    """An ``async def`` task is cancelled; a plain ``def`` one stops for the flag its
    timeout raises (``ctx.cancel_requested``)."""
    job_id = (await queue.submit(type_, None, timeout=0.2, max_attempts=1)).job_id
    background.start(worker_for(queue, REGISTRY))
    status = await ended(queue, job_id)
    assert status.state is State.FAILED and status.error is not None
    assert (status.error.type, status.error.message) == (
        "TimeoutError",
        "attempt timed out after 0.2s",
    )


async def test_a_jobs_own_timeout_replaces_its_tasks(queue: Queue, background: Background) -> None:
    bounded = (await queue.submit("slow_but_bounded", None, max_attempts=1)).job_id
    given_more = (
        await queue.submit("slow_but_bounded", None, timeout=timedelta(minutes=1), max_attempts=1)
    ).job_id
    background.start(worker_for(queue, REGISTRY))
    status = await ended(queue, bounded)
    assert status.error is not None and status.error.message == "attempt timed out after 0.05s"
    assert (await ended(queue, given_more)).state is State.SUCCEEDED


async def test_the_claim_hands_the_timeout_to_the_worker(queue: Queue) -> None:
    specs = [JobSpec(type="hangs", timeout=1.5), JobSpec(type="hangs")]
    made = await queue.submit_many(specs)
    ids = [m.job_id for m in made if not isinstance(m, Exception)]
    got: dict[str, float | None] = {}
    for shard in {queue.keys.shard_of(i) for i in ids}:
        [reply] = await queue.scripts.call_many([claim_call(shard, "w-t", 5, 60_000)])
        got |= {j.id: j.timeout for j in parse_claim(shard, reply).jobs}
    assert got == {ids[0]: 1.5, ids[1]: None}


@pytest.mark.parametrize(
    "options",
    [
        {"timeout": 0},
        {"timeout": -1},
        {"timeout": float("nan")},
        {"timeout": float("inf")},
        {"timeout": True},
        {"timeout": "30"},
        {"timeout": 10**9},
        {"timeout": 30, "unique": Unique(key="u")},
        {"timeout": 30, "debounce": Debounce(key="d", seconds=5)},
        {"timeout": 30, "throttle": Throttle(key="t", limit=1, period=60)},
    ],
)
async def test_bad_timeouts_are_refused_and_make_nothing(
    queue: Queue, options: dict[str, Any]
) -> None:
    spec = JobSpec(type="hangs", **options)
    with pytest.raises(InvalidRequest) as refused:
        await queue.submit_many([spec])
    assert refused.value.field == "timeout" or refused.value.field == "jobs[0].timeout"
    for shard in range(queue.keys.shards):
        assert await queue.redis.xlen(queue.keys.log(shard)) == 0
