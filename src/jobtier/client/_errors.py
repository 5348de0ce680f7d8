"""The client's exceptions: one class per kind of problem document the API answers with.

Each also derives from the engine exception that means the same thing, so code written
against ``jobtier.Queue`` keeps working against the HTTP client::

    JobtierError
    ├── ApiError                any error answer (status, type, title, detail, body)
    │   ├── Unauthorized        401, 403: missing, unknown or insufficient API key
    │   ├── NotFound            404 (also a JobNotFound; job_id)
    │   ├── Conflict            409
    │   │   ├── IdempotencyKeyConflict  also an IdempotencyConflict (key, job_id)
    │   │   └── WrongState              the job has finished (job: its status)
    │   ├── ValidationFailed    400, 413, 415, 422 (also an InvalidRequest; field)
    │   ├── RateLimited         429 (also Overloaded; retry_after)
    │   └── Unavailable         503 (also Overloaded; retry_after)
    └── WaitTimeout             wait() reached its deadline (also a TimeoutError; last)

Network failures are not wrapped: they are ``httpx.TransportError`` as httpx raises them.
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Mapping
from typing import Any

import msgspec

from jobtier.core.errors import (
    IdempotencyConflict,
    InvalidRequest,
    JobNotFound,
    JobtierError,
    Overloaded,
)
from jobtier.core.model import JobStatus, any_decoder, status_decoder

PROBLEM_PREFIX = "urn:jobtier:problem:"


class ApiError(JobtierError):
    """The server answered with an error.

    ``type`` is the problem type (``urn:jobtier:problem:<slug>``; ``about:blank`` when the
    answer was not a problem document, e.g. from a proxy), ``body`` the whole decoded document
    including extra members such as ``field`` or ``job_id``.
    """

    def __init__(self, status: int, type: str, title: str, detail: str, body: dict[str, Any]):
        # not super().__init__: the engine mixins below take other arguments
        Exception.__init__(self, f"{status} {title}: {detail}" if detail else f"{status} {title}")
        self.status = status
        self.type = type
        self.title = title
        self.detail = detail
        self.body = body

    @property
    def slug(self) -> str:
        """The last part of ``type``, e.g. ``"not-found"``."""
        return self.type.removeprefix(PROBLEM_PREFIX)

    def __reduce__(self) -> tuple[Any, ...]:
        # picklable (process pools) although ``args`` is not what __init__ takes
        args = (self.status, self.type, self.title, self.detail, self.body)
        return type(self), args, self.__dict__


class Unauthorized(ApiError):
    """401 or 403: the API key is missing, unknown, or not allowed on this route."""


class NotFound(ApiError, JobNotFound):
    """404: no such job, or another tenant's (the server does not tell them apart)."""

    job_id: str


class Conflict(ApiError):
    """409."""


class IdempotencyKeyConflict(Conflict, IdempotencyConflict):
    """409: the idempotency key was already used, for a different request (job ``job_id``)."""

    key: str
    job_id: str


class WrongState(Conflict):
    """409: not possible in the job's state (cancelling a finished job); ``job`` is its status."""

    job: JobStatus | None


class UniqueHeld(WrongState):
    """409: a replay of a dead-lettered unique job while another job holds its key (its id:
    ``holder``); replay it once that job has finished."""

    holder: str


class ValidationFailed(ApiError, InvalidRequest):
    """400, 413, 415, 422: the request was refused as malformed and nothing was changed;
    ``field`` names the offending member when the server said which."""

    field: str | None


class RateLimited(ApiError, Overloaded):
    """429: this tenant's rate limit or waiting-jobs cap; retry after ``retry_after`` seconds."""

    retry_after: float


class Unavailable(ApiError, Overloaded):
    """503: the service sheds load; retry after ``retry_after`` seconds."""

    retry_after: float


class WaitTimeout(JobtierError, TimeoutError):
    """``wait()`` reached its deadline before the job finished; ``last`` is the latest status."""

    def __init__(self, job_id: str, last: JobStatus) -> None:
        super().__init__(f"job {job_id} is still {last.state.value} (version {last.version})")
        self.job_id = job_id
        self.last = last

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.job_id, self.last)


_BY_STATUS: dict[int, type[ApiError]] = {
    400: ValidationFailed,
    401: Unauthorized,
    403: Unauthorized,
    404: NotFound,
    409: Conflict,
    410: NotFound,  # an idempotent duplicate of a job no longer kept (job_id says which)
    413: ValidationFailed,
    415: ValidationFailed,
    422: ValidationFailed,
    429: RateLimited,
    503: Unavailable,
}


def retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or HTTP date), or None."""
    raw = headers.get("retry-after")
    if raw is None:
        return None
    raw = raw.strip()
    if raw.isdigit():
        return float(raw)
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def api_error(
    status: int,
    content: bytes,
    headers: Mapping[str, str],
    *,
    job_id: str = "",
    key: str = "",
) -> ApiError:
    """The exception for an error answer. ``job_id`` and ``key`` are what the request was
    about, used where the document does not say."""
    body = _document(content)
    type_ = body.get("type")
    if isinstance(type_, str) and isinstance(body.get("title"), str):
        title: str = body["title"]
        detail = str(body.get("detail", ""))
    else:  # not a problem document: an old server, a proxy, a load balancer
        type_ = "about:blank"
        title = f"HTTP {status}"
        detail = content[:200].decode("utf-8", "replace").strip()
        body = {}
    cls = _BY_STATUS.get(status, ApiError)
    if cls is Conflict:
        if type_ == PROBLEM_PREFIX + "idempotency-conflict":
            cls = IdempotencyKeyConflict
        elif type_ == PROBLEM_PREFIX + "wrong-state":
            cls = WrongState
        elif type_ == PROBLEM_PREFIX + "unique-held":
            cls = UniqueHeld
    exc = cls(status, type_, title, detail, body)
    if isinstance(exc, NotFound):
        exc.job_id = str(body.get("job_id", job_id))
    elif isinstance(exc, IdempotencyKeyConflict):
        exc.key = key
        exc.job_id = str(body.get("job_id", job_id))
    elif isinstance(exc, WrongState):
        exc.job = _job(body.get("job"))
        if isinstance(exc, UniqueHeld):
            exc.holder = str(body.get("holder", ""))
    elif isinstance(exc, ValidationFailed):
        field = body.get("field")
        exc.field = field if isinstance(field, str) else None
    elif isinstance(exc, RateLimited | Unavailable):
        exc.retry_after = retry_after(headers) or 1.0
    return exc


def unexpected(status: int, detail: str) -> ApiError:
    """A success answer the client cannot read (e.g. a newer server's document)."""
    return ApiError(status, "about:blank", "Unexpected response", detail, {})


def _document(content: bytes) -> dict[str, Any]:
    try:
        body = any_decoder.decode(content)
    except msgspec.DecodeError:
        return {}
    return body if isinstance(body, dict) else {}


def _job(value: Any) -> JobStatus | None:
    if not isinstance(value, dict):
        return None
    try:
        return status_decoder.decode(msgspec.json.encode(value))
    except msgspec.ValidationError:
        return None
