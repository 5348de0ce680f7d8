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

The names load on first use, so the plugin costs nothing in a session that does not use it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    "BurstWorker": "jobtier.testing.burst",
    "Outcome": "jobtier.testing.task_run",
    "TaskError": "jobtier.testing.task_run",
    "TaskRun": "jobtier.testing.task_run",
    "run_task": "jobtier.testing.task_run",
    "run_task_sync": "jobtier.testing.task_run",
    "start_task": "jobtier.testing.task_run",
}

__all__ = [
    "BurstWorker",
    "Outcome",
    "TaskError",
    "TaskRun",
    "run_task",
    "run_task_sync",
    "start_task",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jobtier.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


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
