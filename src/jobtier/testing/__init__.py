"""Helpers for testing your jobtier tasks.

Unit tests, no servers: ``run_task`` runs one attempt of a task in this process, through
the worker's own code, and returns its ``Outcome`` (state, result, error, retry delay,
every progress report)::

    from jobtier.testing import run_task

    async def test_resize() -> None:
        outcome = await run_task(resize, {"image": "a.png"})
        assert outcome.state == "succeeded" and outcome.result == {"url": "…"}

Integration tests against a real Redis: installing jobtier installs a pytest plugin whose
fixtures start a throw-away ``redis-server`` (once per session, emptied before each test):
``jobtier_settings``, ``jobtier_queue`` and ``jobtier_worker`` (a burst worker over your
tasks); see ``jobtier.testing.plugin``.

The names load on first use, so the plugin costs nothing in a session that does not use them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jobtier import _lazy_exports

_TASK_RUN = ("Outcome", "TaskError", "TaskRun", "run_task", "run_task_sync", "start_task")
_EXPORTS = {"BurstWorker": "jobtier.testing.burst"} | dict.fromkeys(
    _TASK_RUN, "jobtier.testing.task_run"
)

__all__ = [
    "BurstWorker",
    "Outcome",
    "TaskError",
    "TaskRun",
    "run_task",
    "run_task_sync",
    "start_task",
]


__getattr__ = _lazy_exports(__name__, _EXPORTS)


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:
    from jobtier.testing.burst import BurstWorker
    from jobtier.testing.task_run import (
        Outcome,
        TaskError,
        TaskRun,
        run_task,
        run_task_sync,
        start_task,
    )
