"""Exceptions, and the result codes every Lua script returns.

``Code`` is the one place the numbers live: ``store/lua/lib.lua`` defines the same names with the
same values (a unit test keeps the two in step), and Python never compares bare integers.
"""

from __future__ import annotations

import math
from enum import IntEnum


class Code(IntEnum):
    OK = 0
    NOT_FOUND = 1
    VERSION_CONFLICT = 2  # the writer's fencing token is not the job's current lease
    WRONG_STATE = 3
    NOT_OWNER = 4  # the lease belongs to another worker
    IDEMPOTENCY_CONFLICT = 5  # same idempotency key, different request
    DUPLICATE = 6  # same idempotency key, same request: the original job is returned
    EXISTS = 7  # a job with this explicit id already exists


class JobtierError(Exception):
    """Base of every error jobtier raises on purpose."""


class ConfigError(JobtierError):
    """Settings (environment or the services they point at) are unusable."""


class InvalidRequest(JobtierError, ValueError):
    """Bad input from a caller; nothing was changed."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class PayloadTooLarge(InvalidRequest):
    """A payload over ``JOBTIER_MAX_PAYLOAD_BYTES`` (the API answers 413)."""


class UnknownTask(InvalidRequest):
    """The task type is not registered."""


class JobNotFound(JobtierError, LookupError):
    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id} not found")
        self.job_id = job_id


class TransitionRefused(JobtierError):
    """A script refused a transition; ``code`` says why."""

    def __init__(
        self,
        code: Code,
        job_id: str,
        detail: str = "",
        *,
        reason: str | None = None,
        holder: str | None = None,
    ) -> None:
        super().__init__(f"{code.name.lower()}: job {job_id}{' ' + detail if detail else ''}")
        self.code = code
        self.job_id = job_id
        # why, when not the job's state (the API answers it rather than its own wording)
        self.reason = reason
        # the job that holds the unique key a replay would take back (the API's unique-held)
        self.holder = holder


class IdempotencyConflict(JobtierError):
    """The idempotency key was already used for a different request."""

    def __init__(self, key: str, job_id: str) -> None:
        super().__init__(f"idempotency key {key!r} was used for a different request (job {job_id})")
        self.key = key
        self.job_id = job_id


class Overloaded(JobtierError):
    """Back-pressure: try again after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RateLimited(JobtierError):
    """Raised by a task when a downstream service said "slow down": the job runs again after
    ``retry_after`` seconds without using an attempt, and its queue starts no job before then
    (on every worker)."""

    def __init__(self, message: str = "rate limited", *, retry_after: float) -> None:
        super().__init__(message)
        if not retry_after >= 0:
            raise ValueError("retry_after must be a non-negative number of seconds")
        self.retry_after = retry_after


class Retry(JobtierError):
    """Raised by a task to ask for a retry, optionally after a specific delay (seconds)."""

    def __init__(self, message: str = "retry requested", *, delay: float | None = None) -> None:
        if not isinstance(message, str):  # Retry(5): a delay meant, a message made
            raise TypeError(f"Retry's message is a str; a delay is Retry(delay={message!r})")
        if delay is not None and (
            isinstance(delay, bool)
            or not isinstance(delay, int | float)
            or not math.isfinite(delay)
        ):
            raise TypeError(f"Retry(delay=…) is a number of seconds, not {delay!r}")
        super().__init__(message)
        self.delay = delay


class Fatal(JobtierError):
    """Raised by a task for a failure that retrying cannot fix: the job goes straight to the
    dead-letter set."""


class ResultGone(Fatal, LookupError):
    """Raised by ``ctx.result(id)`` when the result store no longer holds a dependency's result
    (deleted with its job): a retry cannot bring it back, so the job fails for good unless the
    task catches it (as a ``LookupError`` too)."""


class Cancelled(JobtierError):
    """Raised inside a task (by ``ctx.check_cancelled()``) once a cancel was requested."""
