"""Tasks for the shutdown tests (also loaded by worker subprocesses:
`jobtier worker tests.shutdown_tasks`)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import TaskRegistry, task

# the in-process test opens the gate of `gated` and learns when its thread is done
gate = threading.Event()
gated_done = threading.Event()


@task(retries=2)
async def hold(ctx: JobContext, payload: Any) -> str:
    """Runs for payload["seconds"] (long): a job still running when the worker stops."""
    await asyncio.sleep(float(payload["seconds"]))
    return "held to the end"


@task(retries=2)
def hold_sync(ctx: JobContext, payload: Any) -> str:
    """A sync task that never looks at cancellation: its thread cannot be interrupted."""
    time.sleep(float(payload["seconds"]))
    return "held to the end, in a thread"


@task(retries=2)
def gated(ctx: JobContext, payload: Any) -> str:
    """A sync task that ends when the test opens ``gate``, then reports progress and a
    result: both after its job was released."""
    try:
        gate.wait(60)
        ctx.progress({"late": True})
        return "late result"
    finally:
        gated_done.set()


registry = TaskRegistry([hold, hold_sync, gated])
