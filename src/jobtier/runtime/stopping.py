"""Stopping background loops and shutdown steps within a bound, whatever Redis is doing.

A process stopped while Redis restarts, loads or is frozen must still exit promptly, and say
in its log what it left behind:

* A cancellation can be lost: on Python 3.11, ``asyncio.wait_for`` returns the inner call's
  result when the cancel arrives just as it finished (CPython gh-86296). redis-py writes
  every command through ``wait_for``; jobtier's connections do not (store/redis.py), and
  jobtier's own waits use ``asyncio.timeout``, but a library may still lose one, and
  ``task.cancel(); await task`` would then wait forever: ``stop_task`` cancels again while
  the task runs.
* A shutdown step that talks to a server that does not answer can take a client timeout per
  retry: ``bounded`` gives each step ``STOP_TIMEOUT`` seconds and moves on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterable
from typing import Any

log = logging.getLogger("jobtier.shutdown")

STOP_TIMEOUT = 5.0  # seconds one shutdown step may take before it is abandoned
RECANCEL_EVERY = 1.0  # a task still running this long after a cancel has lost it: again


async def stop_task(
    task: asyncio.Task[Any] | None, part: str, timeout: float = STOP_TIMEOUT
) -> bool:
    """``stop_tasks`` of one task; an exception it ended with is logged, not raised (the rest
    of the shutdown still runs)."""
    if task is None:
        return True
    if not await stop_tasks([task], part, timeout):
        return False
    if not task.cancelled() and task.exception() is not None:
        log.error("event=shutdown_step_failed part=%s", part, exc_info=task.exception())
    return True


async def stop_tasks(
    tasks: Iterable[asyncio.Task[Any]], part: str, timeout: float = STOP_TIMEOUT
) -> bool:
    """Cancel ``tasks`` and wait until all have ended, cancelling again every
    ``RECANCEL_EVERY`` seconds those still running. True once all have ended; False if some
    still run after ``timeout`` seconds: they are left behind, with a warning naming
    ``part``. What they ended with is neither raised nor logged."""
    tasks = list(tasks)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    running = {task for task in tasks if not task.done()}
    while running:
        left = deadline - loop.time()
        if left <= 0:
            log.warning(
                "event=shutdown_abandoned part=%s tasks=%d seconds=%.1f: still running after "
                "they were cancelled; left behind",
                part,
                len(running),
                timeout,
            )
            return False
        for task in running:
            task.cancel()
        await asyncio.wait(running, timeout=min(left, RECANCEL_EVERY))
        running = {task for task in running if not task.done()}
    for task in tasks:
        if not task.cancelled():
            task.exception()  # retrieved, so asyncio does not report it as never retrieved
    return True


async def bounded(part: str, step: Awaitable[Any], timeout: float = STOP_TIMEOUT) -> bool:
    """Run one shutdown step for at most ``timeout`` seconds: True if it finished, False if
    it was cut short (a warning names ``part``). What the step raises is raised."""
    try:
        async with asyncio.timeout(timeout):
            await step
    except TimeoutError:
        message = "event=shutdown_abandoned part=%s seconds=%.1f: did not finish in time; cut short"
        log.warning(message, part, timeout)
        return False
    return True
