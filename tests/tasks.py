"""Tasks used by the tests (also loaded by worker subprocesses: `jobtier worker tests.tasks`)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec

from jobtier import demo
from jobtier.core.errors import Retry
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import TaskRegistry, task


class Permanent(Exception):
    pass


@task(retries=3, backoff_base=0.2, backoff_factor=2.0, jitter=0.5)
async def flaky(ctx: JobContext, payload: Any) -> str:
    if ctx.attempt < int((payload or {}).get("succeed_on", 99)):
        raise RuntimeError(f"attempt {ctx.attempt} fails")
    return f"ok on {ctx.attempt}"


@task(retries=5, non_retryable=[Permanent])
async def permanent(ctx: JobContext, payload: Any) -> None:
    raise Permanent("cannot ever work")


@task(retries=1, timeout=0.2)
async def too_slow(ctx: JobContext, payload: Any) -> None:
    await asyncio.sleep(5)


@task(retries=1, backoff_base=60)  # the Retry delay wins over the policy
async def retry_later(ctx: JobContext, payload: Any) -> str:
    if ctx.attempt == 1:
        raise Retry("come back soon", delay=0.05)
    return "second time lucky"


@task(retries=0)
def blocking(ctx: JobContext, payload: Any) -> dict[str, Any]:
    time.sleep(float((payload or {}).get("seconds", 0.05)))
    ctx.progress({"thread": True})
    return {"ran_in_thread": True}


@task(retries=0)
async def unserialisable(ctx: JobContext, payload: Any) -> object:
    return object()


@task(retries=2)
async def slow(ctx: JobContext, payload: Any) -> str:
    await asyncio.sleep(float((payload or {}).get("seconds", 1.0)))
    return "slow done"


registry = TaskRegistry(
    [flaky, permanent, too_slow, retry_later, blocking, unserialisable, slow,
     demo.echo, demo.sleep, demo.fail, demo.cpu]
)  # fmt: skip


@task(retries=2)
async def slow_first(ctx: JobContext, payload: Any) -> str:
    """Hangs on its first attempt (for killing the worker mid-job), quick afterwards."""
    if ctx.attempt == 1:
        await asyncio.sleep(600)
    return f"done on attempt {ctx.attempt}"


registry.add(slow_first)


@task(retries=0)
async def wait_for_cancel(ctx: JobContext, payload: Any) -> str:
    """Waits for a cancel request, cleans up, then stops as cancelled."""
    try:
        await ctx.wait_cancelled()
    except asyncio.CancelledError:
        assert ctx.cancel_requested
        raise
    return "never: the worker cancels the task when it sees the request"


registry.add(wait_for_cancel)


class Thumbnail(msgspec.Struct):
    """A typed payload: the worker decodes into it; its schema is in the catalogue."""

    url: str
    width: int = 128


@task(queue="images", retries=4)
async def thumbnail(ctx: JobContext, payload: Thumbnail) -> dict[str, Any]:
    assert isinstance(payload, Thumbnail)
    return {"url": payload.url, "width": payload.width}


registry.add(thumbnail)


def big_rows(n: int) -> dict[str, Any]:
    """A result of about 110 bytes a row, with characters JSON escapes or that are multi-byte."""
    return {"rows": [{"i": i, "text": 'é\u2028 " \\ x' * 7} for i in range(n)], "end": None}


@task(retries=0)
async def big_result(ctx: JobContext, payload: int) -> dict[str, Any]:
    return big_rows(payload)


registry.add(big_result)


@task(retries=0)
async def read_results(ctx: JobContext, payload: Any) -> dict[str, Any]:
    """A dependent that reads its dependencies' results with ``ctx.result``, stored ones
    included; a big_rows result is summed up (its row count, and whether it is whole)."""

    def summed(value: Any) -> Any:
        if isinstance(value, dict) and "rows" in value:
            return {"rows": len(value["rows"]), "whole": value == big_rows(len(value["rows"]))}
        return value

    try:
        await ctx.result("01JNOTAJOBOFMINE0000000000-0")
        unknown = "read"
    except KeyError:
        unknown = "KeyError"
    return {
        "by_id": {dep: summed(await ctx.result(dep)) for dep in ctx.dependencies},
        "last": summed(await ctx.result()),
        "previous": summed(ctx.previous),
        "unknown": unknown,
    }


registry.add(read_results)


# --- flows ------------------------------------------------------------------------------------
@task(retries=0)
async def collect(ctx: JobContext, payload: Any) -> dict[str, Any]:
    """A flow's parent (or a chain's step): returns what it received."""
    return {
        "payload": payload,
        "previous": ctx.previous,
        "dependencies": {
            dep_id: [d.state, d.result, d.error.type if d.error else None]
            for dep_id, d in ctx.dependencies.items()
        },
    }


@task(retries=0)
async def add(ctx: JobContext, payload: Any) -> int:
    """A chain's step: the previous step's number plus this one's."""
    return int(ctx.previous or 0) + int(payload)


@task(retries=0)
async def refund(ctx: JobContext, payload: Any) -> Any:
    """The compensation of `charge`: receives the failed job's id, type, payload and error."""
    return payload


@task(retries=1, on_failure=refund, backoff_base=0.05)
async def charge(ctx: JobContext, payload: Any) -> str:
    if (payload or {}).get("fail"):
        raise RuntimeError(f"card declined (attempt {ctx.attempt})")
    return "charged"


for _t in (collect, add, refund, charge):
    registry.add(_t)
