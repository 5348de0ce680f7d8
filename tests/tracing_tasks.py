"""Tasks for the tracing tests (also loaded by worker subprocesses:
`jobtier worker tests.tracing_tasks`): each says which span was current while it ran."""

from __future__ import annotations

from typing import Any

from opentelemetry import trace

from jobtier.core.errors import RateLimited
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import TaskRegistry, task


def _current() -> dict[str, str]:
    ctx = trace.get_current_span().get_span_context()
    return {"trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}"}


@task(retries=0)
async def traced(ctx: JobContext, payload: Any) -> dict[str, str]:
    return _current()


@task(retries=0)
def traced_sync(ctx: JobContext, payload: Any) -> dict[str, str]:
    """Runs in the worker's thread pool: the attempt's span is current there too."""
    return _current()


@task(retries=1, backoff_base=0.01, jitter=0.0)
async def traced_fail(ctx: JobContext, payload: Any) -> None:
    raise ValueError(f"boom on attempt {ctx.attempt}")


_held_once: set[str] = set()


@task(retries=0)
async def traced_held(ctx: JobContext, payload: Any) -> None:
    """Told to slow down on its first attempt (given back uncounted), then done."""
    if ctx.job.id not in _held_once:
        _held_once.add(ctx.job.id)
        raise RateLimited("429 from partner", retry_after=0.05)


registry = TaskRegistry([traced, traced_sync, traced_fail, traced_held])
