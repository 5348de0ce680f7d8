"""jobtier: asynchronous jobs for Python services, with a status tier served in milliseconds.

The public API is re-exported here; everything else is private to its module.
"""

from jobtier.client import AsyncClient, Client
from jobtier.config import Settings
from jobtier.errors import (
    Cancelled,
    Code,
    ConfigError,
    Fatal,
    IdempotencyConflict,
    InvalidRequest,
    JobNotFound,
    JobtierError,
    Overloaded,
    Retry,
    TransitionRefused,
    UnknownTask,
)
from jobtier.model import JobError, JobStatus, Priority, State
from jobtier.queue import JobSpec, Queue, Submitted
from jobtier.scheduler import Scheduler
from jobtier.schedules import Schedule, ScheduleSpec
from jobtier.worker.context import JobContext
from jobtier.worker.registry import RetryPolicy, Task, TaskRegistry, task
from jobtier.worker.runner import Worker

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "Cancelled",
    "Client",
    "Code",
    "ConfigError",
    "Fatal",
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
    "task",
]
