"""The blocking client (the mirror of ``_async.AsyncClient`` over ``_core``)."""

from __future__ import annotations

import time
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, TypeVar, overload

import httpx

from jobtier.client import _schedules as schedule_ops
from jobtier.client._batches import batch_action_op, batch_op, submit_batch_op
from jobtier.client._checkpoint import checkpoint_op
from jobtier.client._core import (
    BaseClient,
    Call,
    DeadLetter,
    Dependency,
    Emit,
    FlowJob,
    FlowSubmission,
    JobDetails,
    JobPage,
    JobSpec,
    JobStatus,
    LogLine,
    NamedTask,
    OnDependencyFailure,
    Op,
    Priority,
    QueueInfo,
    QueueLimits,
    ReadLine,
    Result,
    Schedule,
    ScheduleSpec,
    Sleep,
    State,
    Submission,
    TaskAd,
    Transition,
    kept,
    present,
)
from jobtier.client._details import history_op, logs_op, result_op, show_op
from jobtier.client._errors import (
    ApiError,
)
from jobtier.client._explain import explain_op
from jobtier.client._scaling import queue_scaling_op
from jobtier.client._types import QueuePurged, Replayed, seconds
from jobtier.client._workers import workers_op
from jobtier.core.batch_model import BatchCallback, BatchChanged, BatchStatus
from jobtier.core.explanation import Explanation
from jobtier.core.model import QueueScaling, SavedCheckpoint, expiry_fields, job_ids
from jobtier.core.worker_list import WorkerList

T = TypeVar("T")


class Client(BaseClient[httpx.BaseTransport]):
    """A blocking client of the jobtier HTTP API (its options: see ``__init__``): the methods
    of ``AsyncClient``, not awaited. Safe to share between threads.

    >>> with Client("http://127.0.0.1:8000", "my-key") as jobs:
    ...     sub = jobs.submit("resize", {"image": "a.png"}, idempotency_key="img-a")
    ...     for status in jobs.events(sub.id):
    ...         print(status.version, status.state, status.progress)
    """

    def _open(self, **options: Any) -> None:
        self._http = httpx.Client(**options)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # --- the API (documented on AsyncClient) ------------------------------------------------
    def submit(
        self,
        type: str | NamedTask,
        payload: Any = None,
        *,
        priority: Priority | str = Priority.NORMAL,
        run_at: datetime | None = None,
        delay: float | timedelta | None = None,
        max_attempts: int | None = None,
        idempotency_key: str | None = None,
        queue: str | None = None,
        concurrency_key: str | None = None,
        concurrency_limit: int | None = None,
        depends_on: Iterable[str] | None = None,
        on_dependency_failure: OnDependencyFailure | None = None,
        callback: str | Mapping[str, Any] | None = None,
        debounce: Mapping[str, Any] | None = None,
        throttle: Mapping[str, Any] | None = None,
        unique: Mapping[str, Any] | None = None,
        expires: datetime | timedelta | float | None = None,
        timeout: float | timedelta | None = None,
    ) -> Submission:
        """Submit one job; see ``AsyncClient.submit``."""
        op = self._submit(
            type,
            payload,
            priority,
            run_at,
            seconds(delay),
            max_attempts,
            idempotency_key,
            queue,
            concurrency_key,
            concurrency_limit,
            job_ids(depends_on),
            on_dependency_failure,
            callback,
            present(debounce=debounce, throttle=throttle, unique=unique)
            | expiry_fields(expires)
            | present(timeout=seconds(timeout, "timeout")),
        )
        return self._run(op)

    def submit_many(
        self, specs: Iterable[JobSpec | Mapping[str, Any]]
    ) -> list[Submission | ApiError]:
        """Submit jobs in one request; see ``AsyncClient.submit_many``."""
        return self._run(self._submit_many(specs))

    def submit_flow(
        self,
        jobs: Iterable[FlowJob | Mapping[str, Any]],
        *,
        idempotency_key: str | None = None,
    ) -> FlowSubmission:
        """Submit a flow in one request; see ``AsyncClient.submit_flow``."""
        return self._run(self._submit_flow(jobs, idempotency_key))

    def dependencies(self, job_id: str) -> list[Dependency]:
        """The jobs ``job_id`` waits for; see ``AsyncClient.dependencies``."""
        return self._run(self._dependencies(job_id))

    @overload
    def status(self, job_id: str) -> JobStatus: ...
    @overload
    def status(
        self, job_id: str, *, if_version: int | None, wait: float = 0.0
    ) -> JobStatus | None: ...
    def status(
        self, job_id: str, *, if_version: int | None = None, wait: float = 0.0
    ) -> JobStatus | None:
        """The job's status; see ``AsyncClient.status``."""
        return self._run(self._status(job_id, if_version, wait))

    def wait(self, job_id: str, timeout: float | None = None, *, poll: float = 30.0) -> JobStatus:
        """The job's terminal status; see ``AsyncClient.wait``."""
        return self._run(self._wait(job_id, timeout, poll))

    def events(
        self, job_id: str, last_event_id: int | str | None = None
    ) -> Generator[JobStatus, None, None]:
        """The job's statuses until a terminal one; see ``AsyncClient.events``. Leaving the
        loop early: ``with contextlib.closing(client.events(job_id)) as stream:``."""
        return self._stream(self._events(job_id, last_event_id))

    def cancel(self, job_id: str) -> JobStatus:
        """Cancel the job; see ``AsyncClient.cancel``."""
        return self._run(self._job_action(job_id, "cancel"))

    def result(self, job_id: str) -> Result:
        """The job's state, result and error."""
        return self._run(result_op(job_id))

    # --- looking into jobs ------------------------------------------------------------------
    def list_jobs(
        self,
        *,
        state: State | str | None = None,
        type: str | None = None,
        queue: str | None = None,
        created_after: datetime | str | None = None,
        cursor: str | None = None,
        limit: int = 50,
        order: str = "desc",
    ) -> JobPage:
        """A page of the tenant's jobs from Postgres; see ``AsyncClient.list_jobs``."""
        op = self._list_jobs(state, type, queue, created_after, cursor, limit, order)
        return self._run(op)

    def history(self, job_id: str) -> list[Transition]:
        """Every persisted change of the job; see ``AsyncClient.history``."""
        return self._run(history_op(job_id))

    def logs(self, job_id: str) -> list[LogLine]:
        """The lines the job's task logged; see ``AsyncClient.logs``."""
        return self._run(logs_op(job_id))

    def show(self, job_id: str) -> JobDetails:
        """Everything about the job: status, result, history (None without Postgres), lines."""
        return self._run(show_op(job_id))

    def checkpoint(self, job_id: str) -> SavedCheckpoint:
        """The last state the job saved; see ``AsyncClient.checkpoint``."""
        return self._run(checkpoint_op(job_id))

    def explain(self, job_id: str) -> Explanation:
        """Why the job has not started; see ``AsyncClient.explain``."""
        return self._run(explain_op(job_id))

    def retry(self, job_id: str) -> JobStatus:
        """Send a failed job back to its queue; see ``AsyncClient.retry``."""
        return self._run(self._job_action(job_id, "retry"))

    def promote(self, job_id: str) -> JobStatus:
        """Run a scheduled job now; see ``AsyncClient.promote``."""
        return self._run(self._job_action(job_id, "promote"))

    def set_priority(self, job_id: str, priority: Priority | str) -> JobStatus:
        """Change a waiting job's priority; see ``AsyncClient.set_priority``."""
        return self._run(self._job_action(job_id, "priority", {"priority": priority}))

    # --- dead letters (these need the admin key) --------------------------------------------
    def dead_letters(
        self, *, type: str | None = None, since: datetime | str | None = None, limit: int = 100
    ) -> list[JobStatus]:
        """Dead-lettered jobs still in Redis; see ``AsyncClient.dead_letters``."""
        return self._run(self._dead_letters(type, since, limit))

    def dead_letter(self, job_id: str) -> DeadLetter:
        """One dead letter in full: status (error and traceback), payload and log lines."""
        return self._run(self._dead_letter(job_id))

    def replay(self, job_id: str) -> JobStatus:
        """Send one dead-lettered job back to its queue, attempts reset (any tenant's)."""
        return self._run(self._replay(job_id))

    def replay_dead_letters(
        self,
        *,
        type: str | None = None,
        since: datetime | str | None = None,
        limit: int = 100,
        all: bool = False,
    ) -> Replayed:
        """Replay the dead letters that match ``type`` and ``since``, up to ``limit``, newest
        first; returns their ids (a list), with ``.skipped`` those passed over because another
        job holds their unique key. With neither, ``all=True`` must say that every dead letter
        is meant (else the API refuses: 422)."""
        return self._run(self._replay_dead_letters(type, since, limit, all))

    # --- queues (these need the admin key) --------------------------------------------------
    def queues(self) -> list[QueueInfo]:
        """Every queue; see ``AsyncClient.queues``."""
        return self._run(self._queues())

    def pause_queue(self, name: str) -> None:
        """Stop claims from the queue (submits are still accepted; running jobs finish)."""
        self._run(self._queue_action(name, "pause"))

    def resume_queue(self, name: str) -> None:
        self._run(self._queue_action(name, "resume"))

    def unblock_queue(self, name: str) -> float | None:
        """Lift a RateLimited block before its end (a pause stays): the end lifted (Unix
        time), or None when the queue was not blocked."""
        return self._run(self._unblock_queue(name))

    def purge_queue(self, name: str) -> QueuePurged:
        """Cancel every ready (or parked) job of the queue, oldest first, each as a cancel
        would; scheduled and running jobs stay."""
        return self._run(self._purge_queue(name))

    def set_queue_limits(
        self,
        name: str,
        *,
        concurrency: int | None = None,
        rate: int | None = None,
        per: float = 1.0,
    ) -> None:
        """Limit the queue across every worker; see ``AsyncClient.set_queue_limits``."""
        # the period only with a rate (alone, the API refuses it: it would read as a lift)
        limits = QueueLimits(
            concurrency=concurrency, rate=rate, per=per if rate is not None else 1.0
        )
        self._run(self._queue_action(name, "limits", limits))

    def workers(self) -> WorkerList:
        """The live workers (admin key), newest heartbeat first: what each serves, its slots,
        and the jobs it runs (``running_total``: all running now, ``running_listed`` of them
        listed)."""
        return self._run(workers_op())

    def queue_scaling(
        self,
        name: str,
        *,
        slots: int | None = None,
        min: int | None = None,
        max: int | None = None,
        target_age: float | None = None,
    ) -> QueueScaling:
        """The workers the queue's pool wants now and the inputs of the formula
        (docs/kubernetes.md): ``slots`` per worker (default: what live workers advertise),
        bounded by ``min``/``max``, raised while the oldest job waits over ``target_age`` s."""
        return self._run(queue_scaling_op(name, slots, min, max, target_age))

    def submit_batch(
        self,
        type: str,
        items: Sequence[Any],
        *,
        chunk_size: int | None = None,
        priority: str = "normal",
        queue: str | None = None,
        max_attempts: int | None = None,
        callback: BatchCallback | None = None,
        idempotency_key: str | None = None,
    ) -> BatchStatus:
        """Submit a batch in one request: a child job of ``type`` per item (or per
        ``chunk_size`` items: payload ``{"offset", "items"}``), and ``callback`` created once
        all have finished (with its own ``webhook``, if given). Returns its status; a bad
        batch is a ``ValidationFailed`` and creates nothing; a repeated ``idempotency_key``
        answers with the first batch (docs/batches.md)."""
        op = submit_batch_op(
            type, items, chunk_size, priority, queue, max_attempts, callback, idempotency_key
        )
        return self._run(op)

    def batch(self, batch_id: str) -> BatchStatus:
        """The batch's status: its counts by state, summed over the shards now."""
        return self._run(batch_op(batch_id))

    def cancel_batch(self, batch_id: str) -> BatchChanged:
        """Cancel the batch's children that have not started; ask its running ones to stop."""
        return self._run(batch_action_op(batch_id, "cancel"))

    def retry_batch(self, batch_id: str) -> BatchChanged:
        """Send the batch's failed children back to their queue, attempts reset."""
        return self._run(batch_action_op(batch_id, "retry"))

    def tasks(self) -> list[TaskAd]:
        """The task catalogue; see ``AsyncClient.tasks``."""
        return self._run(self._tasks())

    # --- recurring schedules -----------------------------------------------------------------
    def create_schedule(self, spec: ScheduleSpec | Mapping[str, Any]) -> Schedule:
        """Create a recurring schedule; see ``AsyncClient.create_schedule``."""
        return self._run(schedule_ops.create_op(spec))

    def schedules(self, *, after: str = "", limit: int = 100) -> list[Schedule]:
        """The tenant's schedules ordered by name, starting after the name ``after``."""
        return self._run(schedule_ops.list_op(after, limit))

    def schedule(self, schedule_id: str) -> Schedule:
        return self._run(schedule_ops.one_op("GET", schedule_id))

    def pause_schedule(self, schedule_id: str) -> Schedule:
        return self._run(schedule_ops.one_op("POST", schedule_id, "/pause"))

    def resume_schedule(self, schedule_id: str) -> Schedule:
        """Resume from the next slot (the paused time is not caught up)."""
        return self._run(schedule_ops.one_op("POST", schedule_id, "/resume"))

    def upsert_schedule(self, spec: ScheduleSpec | Mapping[str, Any]) -> Schedule:
        """Create or replace the schedule of ``spec``'s name; see ``AsyncClient``'s."""
        return self._run(schedule_ops.upsert_op(spec))

    def update_schedule(self, schedule_id: str, **changes: Any) -> Schedule:
        """Change the fields given; see ``AsyncClient.update_schedule``."""
        return self._run(schedule_ops.update_op(schedule_id, changes))

    def run_schedule(self, schedule_id: str, *, idempotency_key: str | None = None) -> Submission:
        """Submit one job of the schedule now; see ``AsyncClient.run_schedule``."""
        return self._run(schedule_ops.run_op(self, schedule_id, idempotency_key))

    def delete_schedule(self, schedule_id: str) -> None:
        self._run(schedule_ops.delete_op(schedule_id))

    # --- the driver (AsyncClient's, without awaiting) ---------------------------------------
    def _send(self, call: Call) -> httpx.Response:
        response = self._http.send(self._request(self._http, call), stream=call.stream)
        if call.stream and response.status_code != 200:
            try:
                response.read()
            finally:
                response.close()
        return response

    def _run(self, op: Op[T]) -> T:
        value: list[T] = []
        for status in self._stream(kept(op, value)):
            raise AssertionError(f"{status!r} outside an event stream")
        return value[0]

    def _stream(self, op: Op[None]) -> Generator[JobStatus, None, None]:
        response: httpx.Response | None = None
        lines: Iterator[str] | None = None
        try:
            step = next(op)
            while True:
                if isinstance(step, Emit):
                    yield step.status
                    step = next(op)
                    continue
                reply: Any = None
                try:
                    if isinstance(step, Sleep):
                        time.sleep(step.seconds)
                    elif isinstance(step, ReadLine):
                        assert lines is not None
                        reply = next(lines, None)
                    else:
                        _close(response, lines)
                        response = reply = self._send(step)
                        streaming = step.stream and response.status_code == 200
                        lines = response.iter_lines() if streaming else None
                except httpx.TransportError as exc:
                    step = op.throw(exc)
                    continue
                step = op.send(reply)
        except StopIteration:
            return
        finally:
            op.close()
            _close(response, lines)


def _close(response: httpx.Response | None, lines: Iterator[str] | None) -> None:
    close = getattr(lines, "close", None)
    if close is not None:
        close()
    if response is not None:
        response.close()
