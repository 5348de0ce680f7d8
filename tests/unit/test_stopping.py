"""runtime/stopping.py: a task that loses a cancellation is cancelled again until it ends; one that
never ends, and a shutdown step that does not finish, are left behind with a warning."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from jobtier.runtime.stopping import bounded, stop_task, stop_tasks


async def _loses_first_cancel(started: asyncio.Event, lost: list[int]) -> None:
    """A loop whose first cancellation is lost, as ``asyncio.wait_for`` loses one on Python
    3.11 when it arrives just as the call inside finished: it carries on, then waits again."""
    started.set()
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        lost.append(1)
    await asyncio.Event().wait()


async def _ignores_cancels(
    started: asyncio.Event, released: asyncio.Event, lost: list[int]
) -> None:
    started.set()
    while not released.is_set():
        try:
            await released.wait()
        except asyncio.CancelledError:
            lost.append(1)


async def test_a_task_that_lost_its_cancellation_is_cancelled_again() -> None:
    started, lost = asyncio.Event(), list[int]()
    task = asyncio.create_task(_loses_first_cancel(started, lost))
    await started.wait()
    assert await stop_task(task, "loop")
    assert lost == [1]
    assert task.cancelled()


async def test_a_task_that_never_ends_is_left_behind_with_a_warning(caplog: Any) -> None:
    started, released, lost = asyncio.Event(), asyncio.Event(), list[int]()
    task = asyncio.create_task(_ignores_cancels(started, released, lost))
    await started.wait()
    assert not await stop_task(task, "stubborn loop", timeout=0.2)
    assert not task.done()
    assert lost  # it was cancelled, and did not end
    assert "event=shutdown_abandoned part=stubborn loop" in caplog.text
    released.set()
    await task


async def test_a_task_that_ends_with_an_error_is_logged_not_raised(caplog: Any) -> None:
    started = asyncio.Event()

    async def fails() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            raise RuntimeError("broke while stopping")

    task = asyncio.create_task(fails())
    await started.wait()
    caplog.set_level(logging.ERROR)
    assert await stop_task(task, "failing loop")
    assert "event=shutdown_step_failed part=failing loop" in caplog.text
    assert await stop_task(None, "never started")


async def test_a_step_that_does_not_finish_is_cut_short(caplog: Any) -> None:
    assert await bounded("quick step", asyncio.sleep(0))
    assert not await bounded("stuck step", asyncio.Event().wait(), timeout=0.1)
    assert "event=shutdown_abandoned part=stuck step" in caplog.text
    assert "quick step" not in caplog.text


async def test_several_tasks_are_stopped_together_even_one_that_lost_its_cancellation(
    caplog: Any,
) -> None:
    started, lost = asyncio.Event(), list[int]()
    stubborn = asyncio.create_task(_loses_first_cancel(started, lost))
    plain = asyncio.create_task(asyncio.Event().wait())
    done = asyncio.create_task(asyncio.sleep(0))

    async def failed() -> None:
        raise RuntimeError("its owner reported it")

    broken = asyncio.create_task(failed())
    await started.wait()
    await asyncio.wait({done, broken})
    assert await stop_tasks([stubborn, plain, done, broken], "parts")
    assert lost == [1] and stubborn.cancelled() and plain.cancelled()
    assert "shutdown" not in caplog.text  # nothing left behind, and the error not logged again

    started2, released, lost2 = asyncio.Event(), asyncio.Event(), list[int]()
    never = asyncio.create_task(_ignores_cancels(started2, released, lost2))
    await started2.wait()
    assert not await stop_tasks([never], "stubborn parts", timeout=0.2)
    assert "event=shutdown_abandoned part=stubborn parts tasks=1" in caplog.text
    released.set()
    await never
