"""A burst worker (``jobtier worker --burst``, the pytest plugin's) drains its queues: jobs
held behind a concurrency key, made ready as the jobs before them end, run before it ends
(worker/claimer.py: a last round over every shard); on the single Redis and the Cluster."""

from __future__ import annotations

from typing import Any

import pytest

from jobtier.config import Settings
from jobtier.core.model import State
from jobtier.engine.queue import Queue
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import TaskRegistry, task
from tests.fixtures.engine import worker_for

pytestmark = pytest.mark.contract


@task(name="one_by_one")
async def one_by_one(ctx: JobContext, payload: Any) -> Any:
    return payload


async def test_a_burst_worker_runs_the_jobs_a_key_admits_as_its_last_jobs_end(
    queue: Queue,
) -> None:
    """Each job is admitted by the end of the one before it, in a shard the worker last
    found empty (the wake saying it is not may come after the worker decided to end)."""
    ids = [
        (await queue.submit("one_by_one", i, concurrency_key="one-at-a-time")).job_id
        for i in range(4)
    ]
    stats = await worker_for(queue, TaskRegistry([one_by_one]), burst=True, concurrency=4).run()
    states = [(await queue.status(j)).state for j in ids]
    assert states == [State.SUCCEEDED] * 4, (states, stats)


async def test_one_slot_and_one_shard_too(settings: Settings) -> None:
    """One slot (the claim loop waits on the slot directly, ahead of the reporter's send of
    the outcome) and one shard (the last round asks every shard at once): the outcomes are
    sent before that round, so the job the last end admits is in it."""
    queue = await Queue.connect(settings.replace(shards=1), catalog=False)
    try:
        ids = [
            (await queue.submit("one_by_one", i, concurrency_key="single")).job_id for i in range(3)
        ]
        registry = TaskRegistry([one_by_one])
        await worker_for(queue, registry, burst=True, concurrency=1).run()
        states = [(await queue.status(j)).state for j in ids]
        assert states == [State.SUCCEEDED] * 3, states
    finally:
        await queue.close()
