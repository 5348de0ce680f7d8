"""A blocking call in an ``async def`` task stops its whole worker: the worker's watch over
its loop (worker/loop_watch.py) says so, naming the job and the line, against a real Redis;
a loop that is only busy (many jobs each taking a step) is told apart, and no job blamed."""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from typing import Any

import pytest

from jobtier.core.model import State
from jobtier.engine.queue import Queue
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import TaskRegistry, task
from tests.fixtures.engine import wait_for, worker_for

told = threading.Event()  # the watch has logged what the test waits for (from its thread)


@task(name="blocks_the_loop")
async def blocks_the_loop(ctx: JobContext, payload: Any) -> str:
    # a blocking call in an async def (as time.sleep would be), held until the watch told
    assert told.wait(60), "the loop watch never reported the stall"
    return "done"


@task(name="takes_steps")
async def takes_steps(ctx: JobContext, payload: Any) -> None:
    # well-behaved, each step short; together they keep the loop from its timers
    while not told.is_set():
        time.sleep(0.002)
        await asyncio.sleep(0)


registry = TaskRegistry([blocks_the_loop, takes_steps])


class Teller(logging.Handler):
    """Sets ``told`` at the first line of the worker's log that holds ``what``."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def emit(self, record: logging.LogRecord) -> None:
        if self.what in record.getMessage():
            told.set()


async def run_until(queue: Queue, ids: list[str], teller: Teller, **options: Any) -> Any:
    """A worker (with ``options``) until every job of ``ids`` has succeeded."""
    logger = logging.getLogger("jobtier.worker")
    logger.addHandler(teller)
    worker = worker_for(queue, registry, **options)
    background = asyncio.create_task(worker.run())

    async def ended() -> bool:
        states = [(await queue.status(job_id)).state for job_id in ids]
        return all(state is State.SUCCEEDED for state in states)

    try:
        await wait_for(ended, 120)
    finally:
        logger.removeHandler(teller)
        told.set()  # whatever happened, nothing waits on it past the test
        worker.stop()
        await background
    return worker


def watch_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "event=worker_loop_" in r.getMessage()]


async def test_a_task_that_blocks_the_loop_is_named_with_its_line(
    queue: Queue, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="jobtier.worker")
    told.clear()
    queue.produce.tasks = registry
    sub = await queue.submit("blocks_the_loop", None)
    named = f"job={sub.job_id}(blocks_the_loop)"
    worker = await run_until(queue, [sub.job_id], Teller(named), blocked_warn=0.2)
    said = [line for line in watch_lines(caplog) if named in line]
    assert len(said) == 2, watch_lines(caplog)
    blocked, unblocked = said
    assert blocked.startswith("event=worker_loop_blocked "), said
    # where: the innermost line (threading's wait) called from the task's own
    assert "threading.py" in blocked and "in wait" in blocked, blocked
    source, first = inspect.getsourcelines(blocks_the_loop.fn)
    line = first + next(i for i, text in enumerate(source) if "told.wait(" in text)
    assert f"(called from {__file__}:{line} in blocks_the_loop)" in blocked, blocked
    assert unblocked.startswith("event=worker_loop_unblocked "), said
    assert worker.stats.loop_blocked >= 1
    counted = worker.metrics().counters["worker_loop_blocked_total"][""]
    assert counted == worker.stats.loop_blocked


async def test_a_loop_busy_with_many_jobs_blames_none_of_them(
    queue: Queue, caplog: pytest.LogCaptureFixture
) -> None:
    """300 jobs each taking 2 ms steps: a turn of the loop takes over half a second, its
    timers wait, but no job holds it."""
    caplog.set_level(logging.INFO, logger="jobtier.worker")
    told.clear()
    queue.produce.tasks = registry
    ids = [(await queue.submit("takes_steps", i)).job_id for i in range(300)]
    teller = Teller("event=worker_loop_busy ")
    worker = await run_until(queue, ids, teller, blocked_warn=0.2, concurrency=300)
    said = watch_lines(caplog)
    busy = [line for line in said if line.startswith("event=worker_loop_busy ")]
    assert busy and "running=" in busy[0], said
    assert not [line for line in said if line.startswith("event=worker_loop_blocked ")], said
    assert worker.stats.loop_blocked == 0


def test_the_watch_refuses_a_time_too_short_or_negative(queue: Queue) -> None:
    for seconds in (-1, 0.01, float("inf")):
        with pytest.raises(ValueError, match=r"0 \(off\) or at least 0\.1"):
            worker_for(queue, registry, blocked_warn=seconds)
    assert worker_for(queue, registry, blocked_warn=0).loop_watch.seconds == 0  # off
