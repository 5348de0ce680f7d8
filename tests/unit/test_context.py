"""JobContext alone: its cancellation signal (the worker also cancels async tasks outright),
and how ``result()`` reads a dependency's result."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from jobtier.core.errors import Cancelled, Fatal
from jobtier.core.model import ClaimedJob
from jobtier.worker.attempt import failure
from jobtier.worker.job_context import JobContext


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


def with_dependencies(read: Any = None) -> JobContext:
    """A job that waited for three: one whose result is in Redis, one whose result is in the
    result store (its reference), one that failed."""
    inputs = (
        b"dep-a dep-b dep-c",
        [b"dep-a", b"s[1]", b"dep-b", b"S@pg:dep-b:3", b"dep-c", b'f{"type":"E","message":"m"}'],
    )
    job = ClaimedJob("01J-0", "t", b"null", 1, 3, 2, 0, 0, inputs=inputs)
    return JobContext(job, 0, "w1", asyncio.get_running_loop(), lambda _: None, None, read)


async def test_result_reads_a_stored_result_by_its_reference() -> None:
    asked: list[str] = []

    async def read(ref: str) -> bytes | None:
        asked.append(ref)
        return b'{"big": true}'

    ctx = with_dependencies(read)
    assert ctx.dependencies["dep-b"].result is None and ctx.dependencies["dep-b"].result_url
    assert await ctx.result("dep-a") == [1] and asked == []  # held in Redis: no read
    assert await ctx.result("dep-b") == {"big": True} and asked == ["pg:dep-b:3"]
    assert await ctx.result() is None and ctx.previous is None  # the last one failed
    with pytest.raises(KeyError, match="not one of the jobs"):
        await ctx.result("dep-z")
    ctx_none = JobContext(
        ClaimedJob("01J-1", "t", b"null", 1, 3, 2, 0, 0), 0, "w1", asyncio.get_running_loop(),
        lambda _: None,
    )  # fmt: skip
    assert await ctx_none.result() is None  # no dependencies


async def test_result_says_why_a_stored_result_cannot_be_read() -> None:
    async def gone(ref: str) -> bytes | None:
        return None  # deleted with its job

    with pytest.raises(LookupError, match="no longer holds the result of dep-b") as lost:
        await with_dependencies(gone).result("dep-b")
    # no retry can bring it back: the job fails for good unless the task catches it
    assert isinstance(lost.value, Fatal) and not failure(lost.value, None).retry
    with pytest.raises(RuntimeError, match="in the result store, unread here"):
        await with_dependencies().result("dep-b")  # a context without a reader
    # from a sync task's thread: refused at once (it reads on the worker's loop)
    with pytest.raises(RuntimeError, match="await it from an async task"):
        await asyncio.to_thread(with_dependencies(gone).result, "dep-a")
