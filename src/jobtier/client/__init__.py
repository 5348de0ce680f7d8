"""The Python client of the jobtier HTTP API: ``Client`` (blocking) and ``AsyncClient``.

Both have the same methods and are context managers::

    from jobtier.client import AsyncClient, Client

    async with AsyncClient("http://127.0.0.1:8000", api_key) as jobs:
        sub = await jobs.submit("resize", {"image": "a.png"}, idempotency_key="img-a")
        async for status in jobs.events(sub.id):  # every change until it finishes
            print(status.version, status.state)
        print((await jobs.result(sub.id)).result)

    with Client("http://127.0.0.1:8000", api_key) as jobs:
        done = jobs.wait(jobs.submit("echo", 42).id, timeout=30)

Statuses are ``jobtier.core.model.JobStatus``; a submit returns a ``Submission`` (``job`` and
``created``, False for an idempotent duplicate). Error answers raise ``ApiError`` subclasses,
which also derive from the matching engine exceptions (``JobNotFound``,
``IdempotencyConflict``, ``InvalidRequest``, ``Overloaded``).
"""

from jobtier.client._async import AsyncClient
from jobtier.client._core import (
    DeadLetter,
    FlowSubmission,
    JobDetails,
    JobPage,
    Result,
    Schedule,
    ScheduleSpec,
    Submission,
)
from jobtier.client._errors import (
    ApiError,
    Conflict,
    IdempotencyKeyConflict,
    NotFound,
    RateLimited,
    Unauthorized,
    Unavailable,
    UniqueHeld,
    ValidationFailed,
    WaitTimeout,
    WrongState,
)
from jobtier.client._sync import Client
from jobtier.client._types import QueuePurged, Replayed, SkippedReplay
from jobtier.core.explanation import Explanation, Reason, ReasonCode
from jobtier.core.model import SavedCheckpoint

__all__ = [
    "ApiError",
    "AsyncClient",
    "Client",
    "Conflict",
    "DeadLetter",
    "Explanation",
    "FlowSubmission",
    "IdempotencyKeyConflict",
    "JobDetails",
    "JobPage",
    "NotFound",
    "QueuePurged",
    "RateLimited",
    "Reason",
    "ReasonCode",
    "Replayed",
    "Result",
    "SavedCheckpoint",
    "Schedule",
    "ScheduleSpec",
    "SkippedReplay",
    "Submission",
    "Unauthorized",
    "Unavailable",
    "UniqueHeld",
    "ValidationFailed",
    "WaitTimeout",
    "WrongState",
]
