"""Tasks of the checkpoint tests (also loaded by worker subprocesses:
`jobtier worker tests.checkpoint_tasks:registry`)."""

from __future__ import annotations

import asyncio
from typing import Any

from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import TaskRegistry, task


@task(retries=2, backoff_base=0.05)
async def chunked(ctx: JobContext, payload: dict[str, Any]) -> dict[str, Any]:
    """Sums chunk numbers 0 … ``chunks`` - 1, saving a checkpoint after each chunk. On its
    first attempt it hangs after ``hang_after`` chunks (for killing its worker) or fails after
    ``fail_after``; a later attempt resumes from the last checkpoint."""
    state = ctx.checkpoint.state or {"next": 0, "sum": 0}
    resumed_from, ran = state["next"], []
    for i in range(state["next"], payload["chunks"]):
        ran.append(i)
        state = {"next": i + 1, "sum": state["sum"] + i}
        await ctx.checkpoint(state)
        if ctx.attempt == 1 and i + 1 == payload.get("hang_after"):
            await asyncio.sleep(600)
        if ctx.attempt == 1 and i + 1 == payload.get("fail_after"):
            raise RuntimeError("the downstream is out")
    return {
        "attempt": ctx.attempt,
        "resumed": ctx.checkpoint.resumed,
        "resumed_from": resumed_from,
        "ran": ran,
        "sum": state["sum"],
    }


@task(retries=2)
async def oversized(ctx: JobContext, payload: int) -> None:
    """Saves a state of ``payload`` characters (over the limit: the attempt fails for good)."""
    await ctx.checkpoint("x" * payload)


registry = TaskRegistry([chunked, oversized])
