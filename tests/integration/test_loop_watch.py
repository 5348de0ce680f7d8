"""A blocking call in an ``async def`` task stops its whole worker: the worker's watch over
its loop (worker/loop_watch.py) says so, naming the job and the line, against a real Redis."""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from typing import Any

import pytest

from jobtier.core.model import State
from jobtier.engine.queue import Queue
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import TaskRegistry, task
from tests.fixtures.engine import wait_for, worker_for

told = threading.Event()  # the watch has logged the stall (set from its thread)


@task(name="blocks_the_loop")
async def blocks_the_loop(ctx: JobContext, payload: Any) -> str:
    # a blocking call in an async def (as time.sleep would be), held until the watch told
    assert told.wait(60), "the loop watch never reported the stall"
    return "done"


registry = TaskRegistry([blocks_the_loop])


class Teller(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("event=worker_loop_blocked "):
            told.set()


async def test_a_task_that_blocks_the_loop_is_named_with_its_line(
    queue: Queue, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="jobtier.worker")
    teller = Teller()
    logging.getLogger("jobtier.worker").addHandler(teller)
    told.clear()
    queue.produce.tasks = registry
    sub = await queue.submit("blocks_the_loop", None)
    worker = worker_for(queue, registry, blocked_warn=0.2)
    background = asyncio.create_task(worker.run())

    async def ended() -> bool:
        return (await queue.status(sub.job_id)).state is State.SUCCEEDED

    try:
        await wait_for(ended, 60)
    finally:
        logging.getLogger("jobtier.worker").removeHandler(teller)
        worker.stop()
        await background
    said = [r.getMessage() for r in caplog.records if "event=worker_loop_" in r.getMessage()]
    assert len(said) == 2, said
    blocked, unblocked = said
    assert blocked.startswith("event=worker_loop_blocked "), said
    assert f"job={sub.job_id}(blocks_the_loop)" in blocked, blocked
    # where: the innermost line (threading's wait) called from the task's own
    assert "threading.py" in blocked and "in wait" in blocked, blocked
    source, first = inspect.getsourcelines(blocks_the_loop.fn)
    line = first + next(i for i, text in enumerate(source) if "told.wait(" in text)
    assert f"(called from {__file__}:{line} in blocks_the_loop)" in blocked, blocked
    assert unblocked.startswith("event=worker_loop_unblocked "), said
    assert worker.stats.loop_blocked == 1
    assert worker.metrics().counters["worker_loop_blocked_total"] == {"": 1}


def test_the_watch_refuses_a_negative_time(queue: Queue) -> None:
    with pytest.raises(ValueError, match="0 \\(off\\) or more"):
        worker_for(queue, registry, blocked_warn=-1)
