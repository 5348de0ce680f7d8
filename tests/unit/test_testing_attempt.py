"""jobtier.worker.attempt, the code the worker and jobtier.testing share, at its seam."""

from __future__ import annotations

import asyncio
import gc
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from jobtier.core.model import ClaimedJob
from jobtier.worker.attempt import Failure, Stopped, fail_state, run_attempt
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import Task, task

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


def _helper() -> None:
    raise ValueError("deep down")


@task(retries=0)
async def wraps(ctx: JobContext, payload: Any) -> None:
    try:
        _helper()
    except ValueError as exc:
        raise RuntimeError("wrapped") from exc


@task(retries=0)
def wraps_sync(ctx: JobContext, payload: Any) -> None:
    _helper()


@pytest.mark.parametrize("fn", [wraps, wraps_sync])
async def test_a_traceback_starts_with_the_tasks_own_frame(fn: Task) -> None:
    """Not with jobtier's run_attempt (nor, for a plain def, the executor's thread): the
    frames that led to the task are the runner's, not the user's."""
    ctx = JobContext(
        ClaimedJob("01J-0", fn.name, b"null", 1, 3, 2, 0, 0),
        0,
        "w1",
        asyncio.get_running_loop(),
        lambda _: None,
    )
    failures: list[Failure] = []

    class Keep:
        def attempt_ended(self, ctx: JobContext, end: bytes | Failure | Stopped) -> None:
            assert isinstance(end, Failure)
            failures.append(end)

    with ThreadPoolExecutor(1) as threads:
        await run_attempt(fn, ctx, threads, 1000, Keep())
    text = failures[0].traceback
    assert text is not None
    frames = [line.strip() for line in text.splitlines() if line.strip().startswith("File ")]
    assert f"in {fn.fn.__name__}" in frames[0] and any("in _helper" in f for f in frames), text
    assert "deep down" in text and "run_attempt" not in text and "thread.py" not in text
