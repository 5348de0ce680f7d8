"""jobtier: asynchronous jobs for Python services, with a status tier served in milliseconds.

The public API is re-exported here; everything else is private to its module. The names load
on first use (PEP 562), so ``import jobtier.client`` (httpx only) does not pull in Redis, the
worker or the scheduler.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "AsyncClient": "jobtier.client",
    "Cancelled": "jobtier.core.errors",
    "Client": "jobtier.client",
    "Code": "jobtier.core.errors",
    "ConfigError": "jobtier.core.errors",
    "Dependency": "jobtier.core.model",
    "Fatal": "jobtier.core.errors",
    "FlowJob": "jobtier.core.model",
    "FlowSubmitted": "jobtier.core.model",
    "IdempotencyConflict": "jobtier.core.errors",
    "InvalidRequest": "jobtier.core.errors",
    "JobContext": "jobtier.worker.context",
    "JobError": "jobtier.core.model",
    "JobNotFound": "jobtier.core.errors",
    "JobSpec": "jobtier.core.model",
    "JobStatus": "jobtier.core.model",
    "JobtierError": "jobtier.core.errors",
    "Overloaded": "jobtier.core.errors",
    "Priority": "jobtier.core.model",
    "Queue": "jobtier.engine.queue",
    "ResultGone": "jobtier.core.errors",
    "Retry": "jobtier.core.errors",
    "RetryPolicy": "jobtier.worker.registry",
    "Schedule": "jobtier.core.schedule",
    "ScheduleSpec": "jobtier.core.schedule",
    "Scheduler": "jobtier.scheduler",
    "Settings": "jobtier.config",
    "State": "jobtier.core.model",
    "Submitted": "jobtier.core.model",
    "Task": "jobtier.worker.registry",
    "TaskRegistry": "jobtier.worker.registry",
    "TransitionRefused": "jobtier.core.errors",
    "UnknownTask": "jobtier.core.errors",
    "Worker": "jobtier.worker.runner",
    "chain": "jobtier.flows",
    "fan_in": "jobtier.flows",
    "task": "jobtier.worker.registry",
}

__all__ = [
    "AsyncClient",
    "Cancelled",
    "Client",
    "Code",
    "ConfigError",
    "Dependency",
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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jobtier' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from jobtier.client import AsyncClient, Client
    from jobtier.config import Settings
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
    from jobtier.worker.context import JobContext
    from jobtier.worker.registry import RetryPolicy, Task, TaskRegistry, task
    from jobtier.worker.runner import Worker
