"""The bodies of the HTTP worker protocol's requests and answers (worker_routes.py): the
msgspec Structs the routes decode and encode with, from which the OpenAPI document's
schemas are generated."""

from __future__ import annotations

import math
from typing import Annotated, Any

import msgspec

from jobtier.config import Settings
from jobtier.core.model import DEFAULT_QUEUE, LOG_LINES, Backoff, Dependency, TaskAd
from jobtier.core.names import JOB_ID_RE, QUEUE_NAME_RE, TASK_NAME_RE
from jobtier.engine.validate import MAX_ATTEMPTS_LIMIT

WORKER_ID_RE = r"^[A-Za-z0-9_.:-]{1,64}$"
MAX_CLAIM = 1000  # jobs one claim may ask for
MAX_RUNNING = 1_000_000  # jobs a worker may say it runs (a claim's `running`)
MAX_TYPES = 200  # task types (and queues) one claim may name
TRACEBACK_CHARS = 4000  # a failure's traceback is kept to its last this many characters
ERROR_CHARS = 4000  # a failure's message is kept to its first this many characters
ADVERTISE_EVERY = 5.0  # s: a claiming worker is written to the workers hash at most this often
ADVERTISED_KEPT = 10_000  # workers whose last advert an API process remembers
DEFAULT_BACKOFF = Backoff(1.0, 2.0, 300.0, 0.1)  # a Python task's default RetryPolicy
MAX_BACKOFF_SECONDS = (
    366 * 86400.0
)  # an advertised base or cap: JOBTIER_MAX_FUTURE_SECONDS' default
MAX_BACKOFF_FACTOR = 100.0  # an advertised growth per attempt

WorkerId = Annotated[str, msgspec.Meta(pattern=WORKER_ID_RE)]
TaskName = Annotated[str, msgspec.Meta(pattern=TASK_NAME_RE.pattern)]
QueueName = Annotated[str, msgspec.Meta(pattern=QUEUE_NAME_RE.pattern)]
LeaseVersion = Annotated[int, msgspec.Meta(ge=1)]


class ClaimRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A long poll for jobs: answered as soon as one is claimed, or empty after ``wait``."""

    worker: WorkerId
    types: Annotated[list[TaskName], msgspec.Meta(min_length=1, max_length=MAX_TYPES)]
    # (default: the default queue)
    queues: Annotated[list[QueueName], msgspec.Meta(min_length=1, max_length=MAX_TYPES)] = (
        msgspec.field(default_factory=lambda: [DEFAULT_QUEUE])
    )
    count: Annotated[int, msgspec.Meta(ge=1, le=MAX_CLAIM)] = 1
    wait: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    # jobs it runs now (the workers view): with count, its slots
    running: Annotated[int, msgspec.Meta(ge=0, le=MAX_RUNNING)] = 0


class WorkerJob(msgspec.Struct):
    """A claimed job: the answers about it carry ``worker`` and ``lease_version``."""

    id: str
    type: str
    queue: str
    payload: msgspec.Raw
    attempt: int
    max_attempts: int
    lease_version: int
    traceparent: str | None = None
    compensates: str | None = None
    # a job that waited for others: their outcomes, in the order it named them (as a Python
    # task's ctx.dependencies); none for a job that waited for none
    dependencies: list[Dependency] | None = None
    # the job's own bound on an attempt, seconds, given at its submit (none: the worker's own)
    timeout: float | None = None


class ClaimResponse(msgspec.Struct):
    """The jobs claimed and their lease; ``limited``: the queues asked whose jobs no HTTP
    worker takes (a concurrency or rate limit: only Python workers take their permits)."""

    jobs: list[WorkerJob]
    lease_seconds: float
    limited: list[str] = msgspec.field(default_factory=list)


class LeaseRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    worker: WorkerId
    lease_version: LeaseVersion


class HeartbeatRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    worker: WorkerId
    lease_version: LeaseVersion
    progress: Any = None  # null: unchanged


class ProgressRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    worker: WorkerId
    lease_version: LeaseVersion
    progress: Any


class HeartbeatResponse(msgspec.Struct):
    cancel_requested: bool
    lease_seconds: float


class LogRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    worker: WorkerId
    lease_version: LeaseVersion
    attempt: Annotated[int, msgspec.Meta(ge=1)]
    lines: Annotated[list[str], msgspec.Meta(min_length=1, max_length=LOG_LINES)]


class LogResponse(msgspec.Struct):
    written: int


class CompleteRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    worker: WorkerId
    lease_version: LeaseVersion
    result: Any = None


class CompleteItem(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    id: Annotated[str, msgspec.Meta(pattern=JOB_ID_RE.pattern)]
    lease_version: LeaseVersion
    result: Any = None


class CompleteManyRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    worker: WorkerId
    jobs: Annotated[list[CompleteItem], msgspec.Meta(min_length=1, max_length=MAX_CLAIM)]


class ItemOutcome(msgspec.Struct):
    """One job's answer in a batch: ``status`` as the one-job route would answer (200, or
    409 for a lease lost, 404 for a job Redis no longer keeps), ``detail`` for a refusal.
    A 409 says what the job is now, as the one-job route's does: ``state``, ``attempt`` and
    ``worker`` (a result sent again, its first reply lost, finds its own)."""

    id: str
    status: int
    state: str | None = None
    detail: str | None = None
    attempt: int | None = None
    worker: str | None = None


class CompleteManyResponse(msgspec.Struct):
    jobs: list[ItemOutcome]


class WorkerError(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
    message: str = ""  # kept to its first ERROR_CHARS characters
    traceback: str | None = None  # kept to its last TRACEBACK_CHARS characters


class FailRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    worker: WorkerId
    lease_version: LeaseVersion
    error: WorkerError
    retryable: bool = True
    retry_in: Annotated[float, msgspec.Meta(ge=0)] | None = None  # s; null: the task's backoff
    # the attempt was given back, not failed (the worker held the job: a rate limit or a
    # breaker of its own): retried after retry_in, the attempt not counted (fail.lua's refund)
    held: bool = False
    # with held and retry_in: the job's queue starts no job for retry_in seconds, on every
    # worker (a partner said "slow down": a Python task's RateLimited; worker_holds.py)
    block_queue: bool = False


class Outcome(msgspec.Struct):
    id: str
    state: str


class RetryBackoff(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``delay = min(base * factor ** (attempt - 1), cap)`` plus up to ``jitter * delay``."""

    base: Annotated[float, msgspec.Meta(ge=0, le=MAX_BACKOFF_SECONDS)] = 1.0
    factor: Annotated[float, msgspec.Meta(ge=1, le=MAX_BACKOFF_FACTOR)] = 2.0
    cap: Annotated[float, msgspec.Meta(ge=0, le=MAX_BACKOFF_SECONDS)] = 300.0
    jitter: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.1


def retry_delay(b: Backoff, attempt: int, most: float, jitter: float) -> float:
    """``RetryBackoff``'s delay after ``attempt`` (``jitter`` in [0, 1) draws its share of the
    jitter), never over ``most`` seconds: a catalogue entry may hold any figures (one
    written before the bounds, or by a Python worker), and a delay past ``most`` would
    overflow or be refused by fail.lua."""
    try:
        grown = b.base * b.factor ** max(attempt - 1, 0) if b.base > 0 else 0.0
    except OverflowError:  # factor ** attempt past a float's range
        grown = math.inf
    plain = min(grown, b.cap)
    delay = plain + plain * b.jitter * jitter
    return delay if 0 <= delay <= most else most  # (NaN compares false: it is clamped too)


class WorkerTask(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: TaskName
    queue: QueueName = DEFAULT_QUEUE
    max_attempts: Annotated[int, msgspec.Meta(ge=1, le=MAX_ATTEMPTS_LIMIT)] = 3
    backoff: RetryBackoff | None = None
    timeout: Annotated[float, msgspec.Meta(gt=0)] | None = None
    payload_schema: dict[str, Any] | None = None


class TasksRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    worker: WorkerId
    tasks: Annotated[list[WorkerTask], msgspec.Meta(min_length=1, max_length=MAX_TYPES)]


class TasksResponse(msgspec.Struct):
    tasks: list[TaskAd]


class LeaveRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A worker that stops: no longer listed as live."""

    worker: WorkerId


class LeaveResponse(msgspec.Struct):
    worker: str
    listed: bool  # it was listed as live until now


OPENAPI_TYPES = (
    ClaimRequest,
    ClaimResponse,
    HeartbeatRequest,
    ProgressRequest,
    HeartbeatResponse,
    LogRequest,
    LogResponse,
    CompleteRequest,
    CompleteManyRequest,
    CompleteManyResponse,
    FailRequest,
    LeaseRequest,
    Outcome,
    TasksRequest,
    TasksResponse,
    LeaveRequest,
    LeaveResponse,
)


def constrain(c: dict[str, Any], settings: Settings) -> None:
    """The rules of the worker bodies that are settings, not constants."""
    wait = c["ClaimRequest"]["properties"]["wait"]
    wait["maximum"] = settings.long_poll_max_seconds
    wait["description"] = "seconds to wait for a job (JOBTIER_LONG_POLL_MAX_SECONDS at most)"
    c["ClaimRequest"]["properties"]["queues"]["default"] = [DEFAULT_QUEUE]
    retry_in = c["FailRequest"]["properties"]["retry_in"]["anyOf"][0]
    retry_in["maximum"] = settings.max_future_seconds
