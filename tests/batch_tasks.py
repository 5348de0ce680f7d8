"""Tasks the batch tests run (in-process workers)."""

from __future__ import annotations

from typing import Any

from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import TaskRegistry, task

# ids of jobs that failed once already: `part` fails a job marked "fail" only the first time,
# so a retried child succeeds
FAILED_ONCE: set[str] = set()


@task(retries=0)
async def part(ctx: JobContext, payload: Any) -> Any:
    """A batch's child: fails (for good: no retries) when its payload says so, once."""
    if isinstance(payload, dict) and payload.get("fail") and ctx.job_id not in FAILED_ONCE:
        FAILED_ONCE.add(ctx.job_id)
        raise RuntimeError("this part fails")
    return payload


@task(retries=0)
async def summary(ctx: JobContext, payload: Any) -> Any:
    """A batch's callback: returns what it was given."""
    return payload


registry = TaskRegistry([part, summary])
