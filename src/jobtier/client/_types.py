"""The bodies the client decodes: what a submit, a result, a listing answer."""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import msgspec

from jobtier.core.errors import InvalidRequest
from jobtier.core.model import (
    Dependency,
    JobError,
    JobSpec,
    JobStatus,
    LogLine,
    QueueInfo,
    State,
    TaskAd,
    Transition,
)
from jobtier.core.schedule import Schedule


class Submission(msgspec.Struct, frozen=True):
    """The outcome of a submit: the job's status, and whether this call created it.

    ``created`` is False for a duplicate: an earlier submit with the same idempotency key
    (and the same type and payload) made the job, and ``job`` is that job's status now.
    """

    job: JobStatus
    created: bool

    @property
    def id(self) -> str:
        return self.job.id


class FlowSubmission(msgspec.Struct, frozen=True):
    """The outcome of a flow submit: each job's status, in the order of the flow, and
    whether this call created the flow (False: a repeat of an earlier submit with the same
    idempotency key; ``jobs`` are then the flow's jobs as they are now)."""

    created: bool
    jobs: list[JobStatus]

    @property
    def ids(self) -> list[str]:
        return [job.id for job in self.jobs]


class Result(msgspec.Struct, frozen=True):
    """``GET /v1/jobs/{id}/result``: ``result`` is the task's return value once the job has
    succeeded (else None); ``error`` says why it failed."""

    id: str
    state: State
    version: int
    result: Any = None
    error: JobError | None = None
    # the result kept outside Redis: where the server streams it (``result()`` follows it)
    result_url: str | None = None

    @property
    def terminal(self) -> bool:
        return self.state.terminal


class JobPage(msgspec.Struct, frozen=True):
    """A page of ``GET /v1/jobs`` (from Postgres): ``next_cursor`` for the next page (None on
    the last); ``lag`` says how far behind the write-behind is (``transitions``,
    ``seconds``): jobs changed within it may show an older state."""

    jobs: list[JobStatus]
    next_cursor: str | None
    lag: dict[str, float]


class JobDetails(msgspec.Struct, frozen=True):
    """Everything about one job (``show``): its status, its result (once succeeded), its
    history (None when the API has no Postgres, or its Postgres is away), and its log lines
    (``ctx.log``). ``result_missing``: why a result kept in the result store could not be
    read (the store away: Postgres, for JOBTIER_RESULT_STORE=postgres; or the result no
    longer kept), when it could not: ``result`` is None then, not the job's."""

    status: JobStatus
    result: Any
    history: list[Transition] | None
    lines: list[LogLine]
    result_missing: str | None = None


class DeadLetter(msgspec.Struct, frozen=True):
    """One dead-lettered job in full (admin): its status (the error and its traceback), its
    payload and its log lines."""

    job: JobStatus
    payload: Any
    lines: list[LogLine]


# --- the documents that wrap a list ----------------------------------------------------------
class _DependencyList(msgspec.Struct):
    id: str
    dependencies: list[Dependency]


class _History(msgspec.Struct):
    transitions: list[Transition]


class _Logs(msgspec.Struct):
    lines: list[LogLine]


class _DeadLetters(msgspec.Struct):
    jobs: list[JobStatus]


class SkippedReplay(msgspec.Struct):
    """A dead letter a replay by filter passed over: its unique key is held by job
    ``holder`` (``why``: "unique-held"); replay it once that job has finished."""

    id: str
    holder: str | None = None
    why: str = "unique-held"


class Replayed(list[str]):
    """The ids a replay by filter replayed; ``skipped``: those it passed over, and why."""

    skipped: list[SkippedReplay] = []  # (replaced on each answer: never appended to)


class _Replayed(msgspec.Struct):
    replayed: list[str]
    skipped: list[SkippedReplay] = []  # an API from before it sent none


class _QueueList(msgspec.Struct):
    queues: list[QueueInfo]


class _TaskList(msgspec.Struct):
    tasks: list[TaskAd]


class QueuePurged(msgspec.Struct, frozen=True):
    """What a purge did: the queue's ready (and parked) jobs cancelled, and those ready now
    (submitted meanwhile, or let in by a concurrency key as the purged ones left)."""

    queue: str
    cancelled: int
    remaining: int


class _Unblocked(msgspec.Struct):
    queue: str
    blocked_until: float | None = None


class _ScheduleList(msgspec.Struct):
    schedules: list[Schedule]
    next_after: str | None = None


class _BatchItem(msgspec.Struct):
    status: int
    job: msgspec.Raw = msgspec.Raw()  # empty when absent
    problem: dict[str, Any] | None = None


class _BatchResults(msgspec.Struct):
    results: list[_BatchItem]


batch_decoder = msgspec.json.Decoder(_BatchResults)
page_decoder = msgspec.json.Decoder(JobPage)
history_decoder = msgspec.json.Decoder(_History)
logs_decoder = msgspec.json.Decoder(_Logs)
dead_letters_decoder = msgspec.json.Decoder(_DeadLetters)
dead_letter_decoder = msgspec.json.Decoder(DeadLetter)
replayed_decoder = msgspec.json.Decoder(_Replayed)
result_decoder = msgspec.json.Decoder(Result)
flow_decoder = msgspec.json.Decoder(FlowSubmission)
dependencies_decoder = msgspec.json.Decoder(_DependencyList)
queue_list_decoder = msgspec.json.Decoder(_QueueList)
task_list_decoder = msgspec.json.Decoder(_TaskList)
schedule_decoder = msgspec.json.Decoder(Schedule)
purged_decoder = msgspec.json.Decoder(QueuePurged)
unblocked_decoder = msgspec.json.Decoder(_Unblocked)
schedule_list_decoder = msgspec.json.Decoder(_ScheduleList)
encoder = msgspec.json.Encoder()


def seconds(delay: float | timedelta | None, field: str = "delay") -> float | None:
    """A submit's ``delay`` (or another ``field`` of seconds) as the API takes it: seconds (a
    ``timedelta`` converted; msgspec would send it as an ISO 8601 duration, which the API
    refuses). ``InvalidRequest`` naming ``field`` for a number that is not finite: JSON has
    none, and msgspec would send null (none given); and for what is no number of seconds (a
    string, a bool), which the API would refuse in its decoder's words."""
    if delay is not None and (
        isinstance(delay, bool) or not isinstance(delay, int | float | timedelta)
    ):
        raise InvalidRequest(
            f"{field} must be a number of seconds or a timedelta, not {type(delay).__name__}",
            field=field,
        )
    if isinstance(delay, float) and not math.isfinite(delay):
        raise InvalidRequest(
            f"{field} must be a finite number of seconds, not {delay!r}", field=field
        )
    return delay.total_seconds() if isinstance(delay, timedelta) else delay


_SECONDS = ("delay", "expires_in", "timeout")


def spec_seconds(spec: JobSpec | Mapping[str, Any]) -> JobSpec | Mapping[str, Any]:
    """A spec of ``submit_many`` with its ``delay``, ``expires_in`` and ``timeout`` as the API
    takes them: seconds (a ``timedelta`` converted, as ``seconds`` does)."""
    if isinstance(spec, JobSpec):
        given = {f: seconds(getattr(spec, f), f) for f in _SECONDS}
        changed = {f: v for f, v in given.items() if v is not getattr(spec, f)}
        return msgspec.structs.replace(spec, **changed) if changed else spec
    return {k: seconds(v, k) if k in _SECONDS else v for k, v in spec.items()}
