"""Tasks of the chaos soak's workers (`jobtier worker chaos_tasks`, with bench/ on the path).

``noop`` sleeps a few milliseconds; ``flaky`` fails its first attempts with a retryable
error, then succeeds. Both are harmless to run twice, as at-least-once delivery requires.
"""

from __future__ import annotations

import asyncio
from typing import Any

from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import task


class ChaosFailure(Exception):
    """The retryable failure ``flaky`` raises on purpose."""


@task(retries=9, backoff_base=0.05, backoff_factor=2.0, backoff_cap=0.5, jitter=0.2)
async def noop(ctx: JobContext, payload: Any) -> dict[str, Any]:
    await asyncio.sleep(float(payload.get("ms", 0)) / 1000)
    return {"n": payload.get("n"), "attempt": ctx.attempt}


@task(retries=9, backoff_base=0.05, backoff_factor=2.0, backoff_cap=0.5, jitter=0.2)
async def flaky(ctx: JobContext, payload: Any) -> dict[str, Any]:
    if ctx.attempt < int(payload.get("succeed_on", 2)):
        raise ChaosFailure(f"attempt {ctx.attempt} fails on purpose")
    return {"n": payload.get("n"), "attempt": ctx.attempt}
