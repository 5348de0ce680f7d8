"""An attempt given back (jobtier's RateLimited, an open breaker) is logged as such ('rf'), and
counted as held; a task's own exception that shares the name fails its attempt like any other."""

from __future__ import annotations

from typing import Any

from jobtier.core.errors import RateLimited
from jobtier.core.model import State
from jobtier.engine.queue import Queue
from jobtier.metrics.snapshot import labels
from jobtier.metrics.transitions import TransitionCounter
from jobtier.streams.entries import LogEntry, parse_entries
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import TaskRegistry, task
from tests.fixtures.engine import worker_for
from tests.fixtures.postgres import log_entries


class OwnRateLimited(Exception):
    """A task's own exception, with the name of jobtier's."""


OwnRateLimited.__name__ = OwnRateLimited.__qualname__ = "RateLimited"


@task(queue="partner-a")
async def told_to_wait(ctx: JobContext, payload: Any) -> None:
    raise RateLimited("429 from partner", retry_after=60)


@task(queue="partner-b")
async def raises_its_own(ctx: JobContext, payload: Any) -> None:
    raise OwnRateLimited("a failure of the task's own")


async def test_a_given_back_attempt_is_told_by_its_flag_not_by_its_errors_name(
    queue: Queue,
) -> None:
    held = (await queue.submit(told_to_wait, 1)).job_id
    failed = (await queue.submit(raises_its_own, 2)).job_id
    await worker_for(queue, TaskRegistry([told_to_wait, raises_its_own]), burst=True).run()
    entries: list[LogEntry] = []
    for shard, entry_id, fields in await log_entries(queue.redis, queue.keys):
        entries += parse_entries(shard, entry_id, fields)
    ends = {e.status.id: e for e in entries if e.from_state == "running"}
    assert ends[held].status.state is State.SCHEDULED and ends[held].refunded
    assert ends[failed].status.state is State.SCHEDULED and not ends[failed].refunded
    errors = [ends[job].status.error for job in (held, failed)]
    assert [e and e.type for e in errors] == ["RateLimited", "RateLimited"]
    counter = TransitionCounter()
    counter.observe(entries)
    got = {name: dict(series) for name, series in counter.counts.items()}
    a = labels(type="told_to_wait", queue="partner-a")
    b = labels(type="raises_its_own", queue="partner-b")
    assert got["jobs_held_total"] == {a: 1}
    assert got["jobs_failed_total"] == got["jobs_retried_total"] == {b: 1}
