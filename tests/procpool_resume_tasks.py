"""Two tasks named ``resumes`` for the process pool's checkpoint test (attempt 1 on the event
loop, attempt 2 in a child): a module of their own, as one registry (``jobtier worker
tests.procpool_tasks``) cannot hold two tasks of one name. A child imports it by name."""

from __future__ import annotations

from typing import Any

from jobtier.core.errors import Retry
from jobtier.worker.registry import task


@task(name="resumes", executor="process", retries=1)
def resumes_in_child(ctx: Any, payload: Any) -> dict[str, Any]:
    """Attempt 2 of ``resumes`` (attempt 1 saved a state on the event loop: the test's
    ``resumes_on_loop``): what the child's ``ctx.checkpoint`` shows, and that it cannot save."""
    try:
        ctx.checkpoint({"next": 99})
        refused = ""
    except RuntimeError as exc:
        refused = str(exc)
    cp = ctx.checkpoint
    return {"state": cp.state, "resumed": cp.resumed, "saves": cp.saves, "refused": refused}


@task(name="resumes", retries=1)
async def resumes_on_loop(ctx: Any, payload: Any) -> None:
    await ctx.checkpoint({"next": 3})
    raise Retry("again, in a child", delay=0.05)
