"""Demo tasks shipped with jobtier: the README tour, `jobtier run`, and black-box tests.

echo   returns its payload
sleep  sleeps payload["seconds"] (default 1), reporting progress and logging two lines;
       honours cancellation
fail   logs a line, then raises a retryable error; with {"fatal": true} a non-retryable one
cpu    a sync task (runs in the worker's thread pool): sums range(payload["n"])
"""

from __future__ import annotations

import asyncio
from typing import Any

from jobtier.core.errors import Fatal
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import task


class DemoFailure(Exception):
    """The error the `fail` task raises when asked for a retryable failure."""


@task(retries=0)
async def echo(ctx: JobContext, payload: Any) -> Any:
    return payload


@task(retries=0)
async def sleep(ctx: JobContext, payload: Any) -> dict[str, float]:
    seconds = float((payload or {}).get("seconds", 1.0))
    steps = max(1, min(100, int(seconds * 10)))
    ctx.log(f"sleeping {seconds:g} s in {steps} steps")
    for step in range(steps):
        await asyncio.sleep(seconds / steps)  # a cancel request interrupts it here
        ctx.progress(round((step + 1) / steps, 3))
    ctx.log("awake")
    return {"slept": seconds}


@task(retries=2, backoff_base=0.5, backoff_factor=2.0, jitter=0.1)
async def fail(ctx: JobContext, payload: Any) -> None:
    ctx.log(f"failing on purpose (attempt {ctx.attempt})")
    if (payload or {}).get("fatal"):
        raise Fatal(f"asked to fail for good (attempt {ctx.attempt})")
    raise DemoFailure(f"asked to fail (attempt {ctx.attempt} of {ctx.max_attempts})")


@task(retries=0)
def cpu(ctx: JobContext, payload: Any) -> int:
    n = int((payload or {}).get("n", 100_000))
    total = 0
    for i in range(n):
        total += i
        if i % 10_000 == 0:
            ctx.check_cancelled()
    return total
