"""jobtier.worker.attempt, the code the worker and jobtier.testing share, at its seam."""

from __future__ import annotations

import asyncio
import gc
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jobtier.core.model import ClaimedJob
from jobtier.worker.attempt import Failure, Stopped, fail_state, run_attempt
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import task

freed: list[str] = []


class Boom(Exception):
    def __del__(self) -> None:
        freed.append(str(self))


@task
async def boom(ctx: JobContext, payload: Any) -> None:
    raise Boom(payload)


class Sink:
    def __init__(self) -> None:
        self.ends: list[str] = []

    def attempt_ended(self, ctx: JobContext, end: bytes | Failure | Stopped) -> None:
        self.ends.append(end.type if isinstance(end, Failure) else repr(end))


async def test_a_failed_attempt_leaves_no_reference_cycle() -> None:
    """The worker runs thousands of attempts: a failure must be freed when the worker is
    done with it, not left in a cycle (exception -> traceback -> frame -> failure) for the
    garbage collector, which a test of the worker's speed showed costs CPU per job."""
    ctx = JobContext(
        ClaimedJob("01J-0", "boom", b'"freed"', 1, 3, 2, 0, 0),
        0,
        "w1",
        asyncio.get_running_loop(),
        lambda _: None,
    )
    sink = Sink()
    gc.collect()
    gc.disable()
    try:
        with ThreadPoolExecutor(1) as threads:
            await run_attempt(boom, ctx, threads, 1000, sink)
        assert sink.ends == ["Boom"]
        assert freed == ["freed"]  # by reference counting alone: no cycle held it
    finally:
        gc.enable()


def test_fail_state_is_fail_luas_rule() -> None:
    assert fail_state(0, 1, 3) == "scheduled"
    assert fail_state(1500, 2, 3) == "scheduled"
    assert fail_state(1500, 3, 3) == "failed"  # no attempts left
    assert fail_state(-1, 1, 3) == "failed"  # not retryable
