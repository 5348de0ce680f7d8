"""jobtier: asynchronous jobs for Python services, with a status tier served in milliseconds.

The public API is re-exported here; everything else is private to its module. The names load
on first use (PEP 562), so ``import jobtier.client`` (httpx only) does not pull in Redis, the
worker or the scheduler.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# module -> the names it defines
_MODULES = {
    "jobtier.client": "AsyncClient Client",
    "jobtier.config": "Settings",
    "jobtier.core.breaker": "Breaker BreakerOpen DownstreamDown",
    "jobtier.core.errors": (
        "Cancelled Code ConfigError Fatal IdempotencyConflict InvalidRequest JobNotFound "
        "JobtierError Overloaded ResultGone Retry TransitionRefused UnknownTask"
    ),
    "jobtier.core.model": (
        "CallbackSpec Dependency FlowJob FlowSubmitted JobError JobSpec JobStatus Priority State"
        " Submitted"
    ),
    "jobtier.core.schedule": "Schedule ScheduleSpec",
    "jobtier.engine.queue": "Queue",
    "jobtier.flows": "chain fan_in",
    "jobtier.scheduler": "Scheduler",
    "jobtier.worker.job_context": "JobContext",
    "jobtier.worker.registry": "RetryPolicy Task TaskRegistry task",
    "jobtier.worker.runner": "Worker",
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names.split()}

__all__ = [
    "AsyncClient",
    "Breaker",
    "BreakerOpen",
    "CallbackSpec",
    "Cancelled",
    "Client",
    "Code",
    "ConfigError",
    "Dependency",
    "DownstreamDown",
    "Fatal",
    "FlowJob",
    "FlowSubmitted",
    "IdempotencyConflict",
    "InvalidRequest",
    "JobContext",
    "JobError",
    "JobNotFound",
    "JobSpec",
    "JobStatus",
    "JobtierError",
    "Overloaded",
    "Priority",
    "Queue",
    "ResultGone",
    "Retry",
    "RetryPolicy",
    "Schedule",
    "ScheduleSpec",
    "Scheduler",
    "Settings",
    "State",
    "Submitted",
    "Task",
    "TaskRegistry",
    "TransitionRefused",
    "UnknownTask",
    "Worker",
    "__version__",
    "chain",
    "fan_in",
    "task",
]


def _lazy_exports(module: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) importing each name of ``exports`` (name -> its
    module) on first use; once loaded, it is a plain attribute of ``module``."""

    def __getattr__(name: str) -> Any:
        source = exports.get(name)
        if source is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(source), name)
        setattr(sys.modules[module], name, value)
        return value

    return __getattr__


__getattr__ = _lazy_exports(__name__, _EXPORTS)


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from jobtier.client import AsyncClient, Client
    from jobtier.config import Settings
    from jobtier.core.breaker import Breaker, BreakerOpen, DownstreamDown
    from jobtier.core.errors import (
        Cancelled,
        Code,
        ConfigError,
        Fatal,
        IdempotencyConflict,
        InvalidRequest,
        JobNotFound,
        JobtierError,
        Overloaded,
        ResultGone,
        Retry,
        TransitionRefused,
        UnknownTask,
    )
    from jobtier.core.model import (
        CallbackSpec,
        Dependency,
        FlowJob,
        FlowSubmitted,
        JobError,
        JobSpec,
        JobStatus,
        Priority,
        State,
        Submitted,
    )
    from jobtier.core.schedule import Schedule, ScheduleSpec
    from jobtier.engine.queue import Queue
    from jobtier.flows import chain, fan_in
    from jobtier.scheduler import Scheduler
    from jobtier.worker.job_context import JobContext
    from jobtier.worker.registry import RetryPolicy, Task, TaskRegistry, task
    from jobtier.worker.runner import Worker
