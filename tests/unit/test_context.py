"""JobContext's cancellation signal, alone (the worker also cancels async tasks outright)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from jobtier.errors import Cancelled
from jobtier.model import ClaimedJob
from jobtier.worker.context import JobContext


def context() -> JobContext:
    job = ClaimedJob("01J-0", "t", b"null", 1, 3, 2, 0, 0)
    return JobContext(job, 0, "w1", asyncio.get_running_loop(), lambda _: None)


async def test_a_waiter_made_before_the_cancel_wakes() -> None:
    ctx = context()
    waiting = asyncio.create_task(ctx.wait_cancelled())
    await asyncio.sleep(0)
    assert not waiting.done() and not ctx.cancel_requested
    ctx._request_cancel()
    await asyncio.wait_for(waiting, 5)
    assert ctx.cancel_requested
    with pytest.raises(Cancelled):
        ctx.check_cancelled()


async def test_waiting_after_the_cancel_returns_at_once() -> None:
    ctx = context()
    ctx.check_cancelled()  # nothing asked yet: no raise
    ctx._request_cancel()
    await asyncio.wait_for(ctx.wait_cancelled(), 5)


async def test_a_sync_task_in_a_thread_sees_the_cancel() -> None:
    ctx = context()
    started = threading.Event()

    def sync_task() -> str:
        for _ in range(5000):
            try:
                ctx.check_cancelled()
            except Cancelled:
                return "stopped"
            started.set()
            time.sleep(0.001)  # the task's work between two checks
        return "never saw it"

    running = asyncio.get_running_loop().run_in_executor(None, sync_task)
    assert await asyncio.to_thread(started.wait, 10)  # running, and not cancelled yet
    ctx._request_cancel()
    assert await asyncio.wait_for(running, 10) == "stopped"
