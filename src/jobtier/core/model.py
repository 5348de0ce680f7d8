"""The job's data: states, priorities, the status document, and codecs built once.

The status document is rendered by the Lua scripts (``store/lua/lib.lua: render``);
``JobStatus`` is its schema on the Python side (a test checks they have the same fields).
Decoding ignores unknown fields, so clients keep working when a newer server adds one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any, Literal, Protocol

import msgspec

from jobtier.core.debounce import Debounce, Throttle, Unique
from jobtier.core.errors import InvalidRequest


class State(StrEnum):
    # committed by jobtier.submit in SQL and not yet relayed into Redis (docs/outbox.md)
    SUBMITTED = "submitted"
    WAITING = "waiting"  # for its dependencies (flows); queued once they are done
    SCHEDULED = "scheduled"
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({State.SUCCEEDED, State.FAILED, State.CANCELLED})
# not started yet: counted against the waiting-jobs caps (JOBTIER_MAX_WAITING_*)
WAITING = frozenset({State.WAITING, State.SCHEDULED, State.QUEUED})

# the states a job listing filters on: a job only in the outbox (submitted) is in no listing
# until the relay has put it in Redis, so that filter is refused rather than always empty
LISTED_STATES = tuple(s.value for s in State if s is not State.SUBMITTED)


class Priority(StrEnum):
    CRITICAL = "critical"
    HIGH = "high"
    NORMAL = "normal"
    LOW = "low"


PRIORITIES: tuple[Priority, ...] = tuple(Priority)

DEFAULT_QUEUE = "default"
# what a failed dependency does to a job that waits for it (the default: cancel)
OnDependencyFailure = Literal["cancel", "run"]


class JobError(msgspec.Struct, frozen=True, omit_defaults=True):
    """Why an attempt failed (or, for a cancelled job, that it was cancelled).

    ``type`` is the exception's class name (``Cancelled`` for a cancelled job, ``LeaseExpired``
    when the worker vanished); ``message`` its text, at most 2,000 characters; ``traceback``
    that of an exception a task raised, bounded (its last 20 frames of each exception in a
    chain, at most 4,000 characters, the innermost kept); absent when nothing was raised.
    """

    type: str
    message: str
    traceback: str | None = None


LOG_LINES = 200  # a job keeps its latest lines (ctx.log), of all its attempts
LOG_LINE_CHARS = 1000  # a longer line is cut and ends with "…"


class LogLine(msgspec.Struct, frozen=True):
    """One line a task logged with ``ctx.log()``: when (ISO 8601, UTC), in which attempt."""

    at: str
    attempt: int
    message: str


class JobLogs(msgspec.Struct, frozen=True):
    """``GET /v1/jobs/{id}/logs``: the job's latest log lines, oldest first."""

    id: str
    lines: list[LogLine]


class Dependencies(msgspec.Struct, frozen=True):
    """A job's dependencies in its status document: how many, how many have finished
    (``done``), and how many of those did not succeed (``failed``: failed, cancelled or
    missing)."""

    total: int
    done: int
    failed: int


class CheckpointMark(msgspec.Struct, frozen=True):
    """What a job's status document shows of its last checkpoint (``ctx.checkpoint``): when
    it was saved, by which attempt, and the size of its state; ``GET /v1/jobs/{id}/checkpoint``
    gives the state itself."""

    at: str
    attempt: int
    bytes: int


class SavedCheckpoint(msgspec.Struct, frozen=True, omit_defaults=True):
    """``GET /v1/jobs/{id}/checkpoint``: the last state the job saved, when and by which
    attempt; ``state`` null and the rest absent when it never saved one."""

    id: str
    state: Any
    at: str | None = None
    attempt: int | None = None
    bytes: int | None = None


class JobStatus(msgspec.Struct, frozen=True):
    """The status document served by ``GET /v1/jobs/{id}`` and pushed over SSE.

    ``version`` increases by one on every change to this document: each state transition,
    each progress report, a cancel request, and each time some of a waiting job's
    dependencies finish (``dependencies``, present only on a job that has any).
    """

    id: str
    type: str
    state: State
    version: int
    priority: Priority
    attempt: int
    max_attempts: int
    created_at: str
    updated_at: str
    run_at: str | None = None
    progress: Any = None
    error: JobError | None = None
    cancel_requested: bool = False
    worker: str | None = None
    queue: str = DEFAULT_QUEUE
    dependencies: Dependencies | None = None
    # where to read a result kept outside Redis (JOBTIER_RESULT_STORE)
    result_url: str | None = None
    # the last checkpoint saved (docs/checkpoints-and-shedding.md), present once there is one
    checkpoint: CheckpointMark | None = None

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL


class Transition(msgspec.Struct, frozen=True):
    """One change of a job's status document, as ``GET /v1/jobs/{id}/history`` lists it.

    ``worker`` is who made the change: a worker id, or ``api``, ``scheduler``, ``admin``,
    ``resolver`` (flows), ``expiry`` (a claim found the job past its expiry: docs/expiry.md).
    Progress reports and cancel requests are changes too (``from_state == to_state``).
    ``error`` is set on the transitions that record one only: an attempt's failure (to
    ``failed``, or back to ``scheduled``/``queued`` for a retry or an expired lease) and a
    cancel's reason; not on the claims, promotions or success that follow a failed attempt.
    """

    version: int
    from_state: State | None
    to_state: State
    at: datetime
    worker: str
    attempt: int
    error: JobError | None = None
    progress: Any = None
    cancel_requested: bool = False


class CallbackSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A job's own webhook: ``url`` receives its terminal state, or every transition with
    ``events="all"``, signed with the tenant's secret (docs/webhooks.md)."""

    url: str
    events: str = "terminal"


class JobSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """One job to submit (the body of ``POST /v1/jobs``).

    ``queue`` defaults to the task's (as its workers advertise it), else ``default``.
    ``concurrency_key``: at most ``concurrency_limit`` (default 1) jobs of the key (per
    tenant) are ready or running at once. ``depends_on``: ids of existing jobs this one waits
    for (state ``waiting``); it is queued when the last succeeds, and cancelled when one fails,
    is cancelled or does not exist, unless ``on_dependency_failure`` is ``run``.
    ``expires_at`` or ``expires_in`` (seconds from the submit): a job not started by then is
    cancelled, its error an ``Expired`` one, when a worker's claim reaches it (docs/expiry.md).
    ``timeout``: seconds each attempt of this job may run, in place of its task's ``timeout``
    (docs/tasks.md).
    """

    type: str
    payload: Any = None
    priority: Priority = Priority.NORMAL
    run_at: datetime | None = None
    delay: float | None = None
    expires_at: datetime | None = None
    expires_in: float | None = None
    timeout: float | None = None
    max_attempts: int | None = None
    idempotency_key: str | None = None
    queue: str | None = None
    concurrency_key: str | None = None
    concurrency_limit: int | None = None
    depends_on: list[str] | None = None
    on_dependency_failure: OnDependencyFailure | None = None
    callback: CallbackSpec | None = None
    # by key (core/debounce.py): one job per quiet period, or at most so many per period
    debounce: Debounce | None = None
    throttle: Throttle | None = None
    # at most one job of the key at a time, until it finishes or starts (core/debounce.py)
    unique: Unique | None = None


class FlowJob(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One job of a flow (``POST /v1/flows``): a ``JobSpec`` without an idempotency key (the
    flow has one), with ``ref``, its name in the flow, and ``after``, the refs of the jobs of
    the flow it waits for: its children, whose results it receives and which cancelling it
    cancels if they have not started. ``depends_on`` names existing jobs it waits for too.
    """

    type: str
    payload: Any = None
    ref: str | None = None
    after: list[str] | None = None
    depends_on: list[str] | None = None
    on_dependency_failure: OnDependencyFailure | None = None
    priority: Priority = Priority.NORMAL
    run_at: datetime | None = None
    delay: float | None = None
    max_attempts: int | None = None
    queue: str | None = None
    concurrency_key: str | None = None
    concurrency_limit: int | None = None
    # last: a flow's request hash leaves it out (plan.py)
    callback: CallbackSpec | None = None

    def spec(self) -> JobSpec:
        """The job alone: its fields that ``JobSpec`` has, but its dependencies."""
        shared = [f for f in self.__struct_fields__ if f in JobSpec.__struct_fields__]
        return JobSpec(**{f: getattr(self, f) for f in shared if f != "depends_on"})


class FlowSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A flow: jobs and the order between them, submitted at once (``POST /v1/flows``). A
    repeated ``idempotency_key`` with the same jobs returns the flow it made first, finishing
    its submit if that was cut short."""

    jobs: list[FlowJob]
    idempotency_key: str | None = None


class Dependency(msgspec.Struct, frozen=True, kw_only=True):
    """One dependency of a job as the job sees it (``ctx.dependencies``, ``GET
    /v1/jobs/{id}/dependencies``): ``state`` is ``pending`` until it finishes, then
    ``succeeded`` (with its ``result``, or ``result_url`` when it is kept outside Redis),
    ``failed`` or ``cancelled`` (with its ``error``), or ``missing`` (no such job).
    ``child``: created in the same flow as the job."""

    id: str
    state: str
    result: Any = None
    error: JobError | None = None
    child: bool = False
    result_url: str | None = None


class QueueLimits(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A queue's limits across every worker: at most ``concurrency`` of its jobs running at
    once; at most ``rate`` job starts per ``per`` seconds. None: no such limit."""

    concurrency: int | None = None
    rate: int | None = None
    per: float = 1.0

    @property
    def limited(self) -> bool:
        return self.concurrency is not None or self.rate is not None


class Backoff(msgspec.Struct, frozen=True):
    base: float
    factor: float
    cap: float
    jitter: float


class TaskAd(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker advertises of one of its tasks."""

    type: str
    queue: str
    max_attempts: int
    backoff: Backoff
    timeout: float | None = None
    non_retryable: list[str] = []
    payload_schema: dict[str, Any] | None = None
    seen_at: float = 0.0
    worker: str = ""
    on_failure: str | None = None  # the task whose job compensates a failed one
    encrypt: bool = False  # its payloads and results are encrypted at rest (core/sealing.py)


@dataclass(frozen=True, slots=True)
class TaskInfo:
    """What a submit needs to know of a task: its queue, its attempts, and a payload check."""

    queue: str
    max_attempts: int
    check: Any = None  # callable(payload) raising InvalidRequest, or None
    on_failure: str | None = None  # compensation task type
    encrypt: bool = False  # its jobs' payloads are encrypted at submit (core/sealing.py)

    def validate(self, payload: Any) -> None:
        if self.check is not None:
            self.check(payload)


class TaskLookup(Protocol):
    """A source of TaskInfo: the in-process TaskRegistry, or the catalogue."""

    def info(self, type: str) -> TaskInfo | None: ...

    def names(self) -> list[str]: ...


class QueueInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One queue as ``GET /v1/admin/queues`` shows it."""

    name: str
    queued: dict[str, int]  # ready jobs by priority
    queued_total: int
    parked: int  # handed back by workers that lack their task, waiting for one that has it
    running: int
    waiting: int = 0  # for their dependencies
    # queued behind their concurrency keys: in no ready list, each waits for its key's turn
    # (more workers would not start them sooner; not in queued_total)
    held: int = 0
    paused: bool
    limits: QueueLimits | None = None
    blocked_until: float | None = None  # Unix time: a task raised RateLimited
    oldest_queued_age_seconds: float | None = None
    workers: int = 0  # live workers serving it
    tasks: list[str] = []  # task types the workers advertise for it


# jobs a worker runs at once unless told (``jobtier worker --concurrency``); the scaling read
# assumes it of a pool that has not advertised its slots
WORKER_CONCURRENCY = 50
# a worker's event loop unanswered this long is reported, naming the job that holds it
# (``jobtier worker --blocked-warn``, worker/loop_watch.py)
WORKER_BLOCKED_WARN_SECONDS = 1.0
WORKER_BLOCKED_WARN_LEAST = 0.1  # shorter, its watch would look more often than it is worth
# ``jobtier migrate``: the longest wait for a lock a try, and how long it tries before giving
# up (persist/db.py: migrate)
MIGRATE_LOCK_TIMEOUT = 2.0
MIGRATE_PATIENCE = 300.0


class QueueScaling(msgspec.Struct, frozen=True, kw_only=True):
    """How many workers a queue's pool wants, as ``GET /v1/admin/queues/{name}/scaling``
    answers, with every input the answer came from (docs/kubernetes.md: the formula)."""

    queue: str
    desired_workers: int
    # which clause set desired_workers: "demand" (ready and running jobs over slots), "rate"
    # (the same, the ready jobs capped by what the queue's rate limit lets start within
    # target_age), "blocked" (a task raised RateLimited: only the running jobs count), "age"
    # (the oldest ready job waited over target_age), "min" or "max" (a bound)
    decided_by: str
    ready: int  # jobs ready to be claimed (none of them counted while paused or blocked)
    running: int
    parked: int  # handed back by workers that lack their task: more of them would not help
    paused: bool
    concurrency_limit: int | None  # the queue's limit across every worker, which caps demand
    # jobs that could run at once: running + ready (the ready at most the rate's allowance),
    # at most concurrency_limit
    demand: int
    oldest_age_seconds: float | None  # the oldest ready job's wait
    live_workers: int  # workers serving the queue that advertised themselves lately
    slots: int  # jobs one worker runs at once
    # "query", "workers" (the fewest a live one has) or "default" (neither: WORKER_CONCURRENCY)
    slots_from: str
    utilisation: float | None  # running / (live_workers * slots); None without live workers
    target_age_seconds: float
    min: int
    max: int | None
    # the queue's rate limit, in job starts per second (rate / per); None: no rate limit
    rate_per_second: float | None = None
    # ready jobs the rate lets start within target_age: ceil(rate_per_second * target_age)
    rate_allowance: int | None = None
    blocked_until: float | None = None  # a task raised RateLimited: no start before (epoch s)


class ClaimedJob(msgspec.Struct, frozen=True):
    """A job handed to a worker by the claim script; ``lease_version`` is its fencing token."""

    id: str
    type: str
    payload: bytes
    attempt: int
    max_attempts: int
    lease_version: int
    queued_at_ms: int
    claimed_at_ms: int
    queue: str = DEFAULT_QUEUE
    # its dependencies' outcomes from claim.lua (lib.lua flow_inputs): their ids in order
    # (space-separated) and the flat id/outcome pairs; None for a job without
    inputs: tuple[bytes, list[bytes]] | None = None
    # the W3C traceparent of its submit, when that was traced (runtime/tracing.py)
    trace: str | None = None
    # a compensation's: the id of the failed job it compensates, as Redis recorded it when it
    # created the compensation (never read from the payload, which a submitter could write)
    compensates: str | None = None
    # the state the job's last checkpoint saved (JSON), handed to this attempt; None for none
    checkpoint: bytes | None = None
    # the job's own bound on an attempt, seconds, given at its submit; None: its task's
    timeout: float | None = None


@dataclass(frozen=True, slots=True)
class Submitted:
    """The outcome of a submit: the job's status document, and whether this call created it."""

    job_id: str
    doc: bytes
    created: bool

    @property
    def status(self) -> JobStatus:
        return decode_status(self.doc)


@dataclass(frozen=True, slots=True)
class FlowSubmitted:
    """The outcome of a flow submit: each job's, in the flow's order, and whether this call
    created the flow (False: an earlier submit with its idempotency key did; a job's ``doc``
    is then its document now, ``b""`` for one Redis no longer keeps)."""

    jobs: list[Submitted]
    created: bool

    @property
    def ids(self) -> list[str]:
        return [job.job_id for job in self.jobs]


# a job's result that starts with this is a reference to the result store, not JSON
RESULT_REF = b"@"


def is_ref(result: bytes | None) -> bool:
    return bool(result) and result[:1] == RESULT_REF  # type: ignore[index]


def ref_of(result: bytes) -> str:
    return result[1:].decode()


def marker(ref: str) -> bytes:
    """The value a worker reports as the job's result for a stored one."""
    return RESULT_REF + ref.encode()


json_encoder = msgspec.json.Encoder()
status_decoder = msgspec.json.Decoder(JobStatus)
any_decoder = msgspec.json.Decoder()


def expiry_fields(expires: datetime | timedelta | float | None) -> dict[str, Any]:
    """A submit's ``expires`` as ``JobSpec``'s fields: a time is ``expires_at``, seconds (a
    number or a ``timedelta``) are ``expires_in``; nothing for None. ``InvalidRequest`` for a
    bool or a number that is not finite (JSON has none: it would be sent as null, no expiry),
    and for a time without a zone."""
    if expires is None:
        return {}
    if isinstance(expires, datetime):
        if expires.utcoffset() is None:  # before the API would name its wire field
            raise InvalidRequest(
                f"expires needs a time zone: {expires.isoformat()} is a naive datetime "
                "(e.g. datetime.now(UTC) + timedelta(minutes=5))",
                field="expires_at",
            )
        return {"expires_at": expires}
    if isinstance(expires, timedelta):
        return {"expires_in": expires.total_seconds()}
    if isinstance(expires, bool) or not isinstance(expires, int | float):
        raise InvalidRequest(
            "expires must be a datetime (with a zone), a timedelta or a number of seconds, "
            f"not {type(expires).__name__}",
            field="expires_in",
        )
    if not math.isfinite(expires):
        raise InvalidRequest(
            f"expires must be a finite number of seconds, not {expires!r}", field="expires_in"
        )
    return {"expires_in": expires}


def job_ids(given: Iterable[str] | None) -> list[str] | None:
    """``depends_on`` as a list: one id alone is that id (a str is also an iterable of its
    characters, each of which would be refused as an id)."""
    if given is None:
        return None
    return [given] if isinstance(given, str) else list(given)


def encode_json(value: Any) -> bytes:
    """Encode a payload/result/progress value to compact JSON, or raise TypeError (also for
    a value nested too deep, or a string holding a lone surrogate)."""
    try:
        return json_encoder.encode(value)
    except (TypeError, msgspec.EncodeError) as exc:
        raise TypeError(f"not JSON-serialisable: {exc}") from None
    except (RecursionError, UnicodeEncodeError) as exc:
        raise TypeError(f"not JSON-serialisable: {type(exc).__name__}: {exc}") from None


def decode_status(doc: bytes | str) -> JobStatus:
    return status_decoder.decode(doc)
