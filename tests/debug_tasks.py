"""Tasks for the tests of failures, cancellation and log lines (in-process workers only: the
gates are asyncio events the test opens)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from jobtier import demo
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import TaskRegistry, task
from tests import tasks

GATES: dict[str, asyncio.Event] = {}  # job id -> opened by the test


def gate(job_id: str) -> asyncio.Event:
    return GATES.setdefault(job_id, asyncio.Event())


@task(retries=0)
async def swallow_cancel(ctx: JobContext, payload: Any) -> str:
    """Catches its cancellation and returns a result anyway."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        return "cleaned up, then returned"
    return "never: it sleeps an hour"


@task(retries=0)
def poll_cancel_sync(ctx: JobContext, payload: Any) -> str:
    """A sync task that notices the request, then returns what it has."""
    deadline = time.monotonic() + 60
    while not ctx.cancel_requested and time.monotonic() < deadline:
        time.sleep(0.002)
    return "partial work"


@task(retries=3, backoff_base=600)
async def gated(ctx: JobContext, payload: Any) -> str:
    """Waits for the test to open its gate, then fails (payload {"fail": true}) or returns."""
    await gate(ctx.job_id).wait()
    if (payload or {}).get("fail"):
        raise ConnectionError("the downstream went away")
    return "done"


@task(retries=3, backoff_base=600)
async def fail_once(ctx: JobContext, payload: Any) -> None:
    """Fails; its retry is ten minutes away."""
    raise RuntimeError(f"attempt {ctx.attempt} fails")


def _recurse(depth: int) -> None:
    if depth == 0:
        try:
            record: dict[str, str] = {}
            print(record["missing"])  # the lookup fails
        except KeyError as exc:
            raise ValueError("the record is incomplete " + "x" * 3000) from exc
    _recurse(depth - 1)


@task(retries=0)
async def deep_failure(ctx: JobContext, payload: Any) -> None:
    """Fails 200 frames deep, with a cause and a long message."""
    _recurse(200)


@task(retries=1, backoff_base=0.01, jitter=0)
async def chatty(ctx: JobContext, payload: Any) -> str:
    """Logs ``n`` numbered lines, then one over-long line; fails its first attempt when asked."""
    p = payload or {}
    for i in range(int(p.get("n", 3))):
        ctx.log(f"line {i}")
    ctx.log("y" * int(p.get("long", 0)) if p.get("long") else "done")
    if p.get("fail_first") and ctx.attempt == 1:
        raise RuntimeError("first attempt fails")
    return "logged"


@task(retries=0)
def chatty_sync(ctx: JobContext, payload: Any) -> str:
    for i in range(int((payload or {}).get("n", 3))):
        ctx.log(f"thread line {i}")
    return "logged"


@task(retries=0)
async def cancelled_elsewhere(ctx: JobContext, payload: Any) -> None:
    """Awaits a future something else cancelled: its CancelledError escapes the task."""
    inner = asyncio.ensure_future(asyncio.sleep(3600))
    inner.cancel()
    await inner


@task(retries=0)
async def too_deep(ctx: JobContext, payload: Any) -> list[Any]:
    """Returns a result nested deeper than the encoder goes (a RecursionError)."""
    result: list[Any] = []
    for _ in range(5000):
        result = [result]
    return result


HOSTILE = "line1\nFAKE ROW \x1b[2J\x1b[31m\x1b]0;title\x07\x00\r\x9b"


@task(retries=0)
async def hostile(ctx: JobContext, payload: Any) -> None:
    """Logs and fails with text a terminal would act on (escape sequences, a forged line)."""
    ctx.log(HOSTILE)
    raise ValueError(HOSTILE)


registry = TaskRegistry(
    [swallow_cancel, poll_cancel_sync, gated, fail_once, deep_failure, chatty, chatty_sync,
     cancelled_elsewhere, too_deep, hostile, tasks.wait_for_cancel, tasks.unserialisable,
     demo.echo]
)  # fmt: skip
