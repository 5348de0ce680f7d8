"""The asyncio client (the mirror of ``_sync.Client`` over ``_core``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping, Sequence
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


class AsyncClient(BaseClient[httpx.AsyncBaseTransport]):
    """An asyncio client of the jobtier HTTP API (its options: see ``__init__``).

    >>> async with AsyncClient("http://127.0.0.1:8000", "my-key") as jobs:
    ...     sub = await jobs.submit("resize", {"image": "a.png"}, idempotency_key="img-a")
    ...     done = await jobs.wait(sub.id, timeout=60)
    ...     print(done.state, (await jobs.result(sub.id)).result)
    """

    def _open(self, **options: Any) -> None:
        self._http = httpx.AsyncClient(**options)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    # --- the API ----------------------------------------------------------------------------
    async def submit(
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
        """Submit one job of ``type``: a task's name, or the task (``@task``) itself, sent by
        its name. ``run_at`` must carry a time zone; give it or ``delay`` (seconds, or a
        ``timedelta``), not both. A repeat of an earlier submit's ``idempotency_key`` returns that job with
        ``created`` False, or raises ``IdempotencyKeyConflict`` if the type or payload differ.
        ``queue`` defaults to the task's; ``concurrency_key``: at most ``concurrency_limit``
        (default 1) jobs of the key run at once, the others wait in order. ``depends_on``:
        ids (or one id) of your jobs it waits for (``waiting``): it is queued when the last one
        succeeds, and cancelled when one fails, unless ``on_dependency_failure="run"``.
        ``callback``: a URL that receives the job's terminal state as a signed webhook, or
        ``{"url": …, "events": "all"}`` for every transition. ``debounce`` (``{"key", "seconds",
        "max_wait"}``), ``throttle`` (``{"key", "limit", "period", "on_limit"}``) or ``unique``
        (``{"key", "until"}``: the key's unfinished job, ``created`` False): see
        docs/debounce-throttle.md; a full throttle key that refuses raises ``RateLimited``.
        ``expires``: a time (with a zone), or seconds (a number or a ``timedelta``) from now,
        after which the job, not started, is cancelled rather than run (docs/expiry.md).
        ``timeout``: seconds (or a ``timedelta``) each attempt of this job may run, in place of
        its task's ``timeout`` (docs/tasks.md).
        """
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
        return await self._run(op)

    async def submit_many(
        self, specs: Iterable[JobSpec | Mapping[str, Any]]
    ) -> list[Submission | ApiError]:
        """Submit jobs in one request (``JobSpec``s or dicts of the same fields). Each job's
        outcome is in its place: a ``Submission``, or the ``ApiError`` (e.g. an
        ``IdempotencyKeyConflict``) it met. A bad job refuses the whole batch: that raises."""
        return await self._run(self._submit_many(specs))

    async def submit_flow(
        self,
        jobs: Iterable[FlowJob | Mapping[str, Any]],
        *,
        idempotency_key: str | None = None,
    ) -> FlowSubmission:
        """Submit a flow in one request: jobs that wait for others of the flow (``after``:
        their ``ref``) or for existing jobs (``depends_on``); build chains and fan-ins with
        ``jobtier.flows.chain`` and ``fan_in``. A job runs once all it waits for succeeded
        and finds their results in ``ctx.dependencies`` (``ctx.previous`` in a chain). A
        repeat with the same ``idempotency_key`` returns the same flow (``created`` False).
        A job's ``callback`` (``CallbackSpec`` on a ``FlowJob``; in a mapping, a URL or
        ``{"url": …, "events": "all"}``, as ``submit`` takes it) receives its own webhooks.
        A cycle, an unknown ref or id, a refused callback URL, or a flow over the server's
        size is a ``ValidationFailed`` and creates nothing."""
        return await self._run(self._submit_flow(jobs, idempotency_key))

    async def dependencies(self, job_id: str) -> list[Dependency]:
        """The jobs ``job_id`` waits for, in order: ``pending``, or their state and result
        (or error) once they finished."""
        return await self._run(self._dependencies(job_id))

    @overload
    async def status(self, job_id: str) -> JobStatus: ...
    @overload
    async def status(
        self, job_id: str, *, if_version: int | None, wait: float = 0.0
    ) -> JobStatus | None: ...
    async def status(
        self, job_id: str, *, if_version: int | None = None, wait: float = 0.0
    ) -> JobStatus | None:
        """The job's status. With ``if_version``: None while the job is still at that
        version, after waiting up to ``wait`` seconds for it to move on (long-poll)."""
        return await self._run(self._status(job_id, if_version, wait))

    async def wait(
        self, job_id: str, timeout: float | None = None, *, poll: float = 30.0
    ) -> JobStatus:
        """The job's status once it is terminal, by long-poll requests of up to ``poll``
        seconds each (at most the server's ``JOBTIER_LONG_POLL_MAX_SECONDS``). Raises
        ``WaitTimeout`` (a ``TimeoutError``, with the last status seen) after ``timeout``."""
        return await self._run(self._wait(job_id, timeout, poll))

    def events(
        self, job_id: str, last_event_id: int | str | None = None
    ) -> AsyncGenerator[JobStatus, None]:
        """The job's status, then each change, until a terminal status (or, resuming from
        ``last_event_id``, nothing if that was the last). A dropped connection is resumed
        from the last event received. Leaving the loop early keeps the connection open until
        the generator is collected: ``async with contextlib.aclosing(client.events(id))``
        closes it at once."""
        return self._stream(self._events(job_id, last_event_id))

    async def cancel(self, job_id: str) -> JobStatus:
        """Cancel a waiting job, or ask the worker running it to stop (``cancel_requested``).
        Raises ``WrongState`` once the job has finished."""
        return await self._run(self._job_action(job_id, "cancel"))

    async def result(self, job_id: str) -> Result:
        """The job's state, result (once succeeded) and error (once failed)."""
        return await self._run(result_op(job_id))

    # --- looking into jobs ------------------------------------------------------------------
    async def list_jobs(
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
        """A page of the tenant's jobs from Postgres, newest first (``order="asc"``: oldest),
        filtered by state, type, queue and creation time; pass ``next_cursor`` back as
        ``cursor`` for the next page. Needs an API with Postgres."""
        op = self._list_jobs(state, type, queue, created_after, cursor, limit, order)
        return await self._run(op)

    async def history(self, job_id: str) -> list[Transition]:
        """Every persisted change of the job, oldest first (errors with their tracebacks).
        Needs an API with Postgres."""
        return await self._run(history_op(job_id))

    async def logs(self, job_id: str) -> list[LogLine]:
        """The lines the job's task logged with ``ctx.log()``, oldest first (its latest 200),
        while Redis holds the job."""
        return await self._run(logs_op(job_id))

    async def show(self, job_id: str) -> JobDetails:
        """Everything about the job: status, result, history (None without Postgres), lines."""
        return await self._run(show_op(job_id))

    async def checkpoint(self, job_id: str) -> SavedCheckpoint:
        """The last state the job saved with ``ctx.checkpoint`` (what its next attempt
        resumes from), when and by which attempt; ``state`` None when it saved none. From
        Redis while it holds the job, then from Postgres."""
        return await self._run(checkpoint_op(job_id))

    async def explain(self, job_id: str) -> Explanation:
        """Why the job has not started: each reason (its queue paused or limited, its
        concurrency key held, its dependencies, its run_at, no worker for it, other tenants'
        turns, its place in line) in words and numbers; ``waiting`` False once it runs."""
        return await self._run(explain_op(job_id))

    async def retry(self, job_id: str) -> JobStatus:
        """Send a failed (dead-lettered) job back to its queue, attempts reset. Raises
        ``WrongState`` for a job that has not failed."""
        return await self._run(self._job_action(job_id, "retry"))

    async def promote(self, job_id: str) -> JobStatus:
        """Run a scheduled job now: a delayed one before its run-at, or one waiting out a
        retry's back-off. Raises ``WrongState`` for a job that is not scheduled."""
        return await self._run(self._job_action(job_id, "promote"))

    async def set_priority(self, job_id: str, priority: Priority | str) -> JobStatus:
        """Change the priority of a job not started yet (queued, scheduled, waiting): a ready
        one goes to the back of its new priority's jobs. Raises ``WrongState`` once it runs
        or has ended, ``ValidationFailed`` for an unknown priority."""
        return await self._run(self._job_action(job_id, "priority", {"priority": priority}))

    # --- dead letters (these need the admin key) --------------------------------------------
    async def dead_letters(
        self, *, type: str | None = None, since: datetime | str | None = None, limit: int = 100
    ) -> list[JobStatus]:
        """Dead-lettered jobs still in Redis, newest first: of one ``type``, dead-lettered at
        or after ``since``, when given."""
        return await self._run(self._dead_letters(type, since, limit))

    async def dead_letter(self, job_id: str) -> DeadLetter:
        """One dead letter in full: status (error and traceback), payload and log lines."""
        return await self._run(self._dead_letter(job_id))

    async def replay(self, job_id: str) -> JobStatus:
        """Send one dead-lettered job back to its queue, attempts reset (any tenant's)."""
        return await self._run(self._replay(job_id))

    async def replay_dead_letters(
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
        return await self._run(self._replay_dead_letters(type, since, limit, all))

    # --- queues (these need the admin key) --------------------------------------------------
    async def queues(self) -> list[QueueInfo]:
        """Every queue: ready jobs by priority, running, parked, paused, limits, workers."""
        return await self._run(self._queues())

    async def pause_queue(self, name: str) -> None:
        """Stop claims from the queue (submits are still accepted; running jobs finish)."""
        await self._run(self._queue_action(name, "pause"))

    async def resume_queue(self, name: str) -> None:
        await self._run(self._queue_action(name, "resume"))

    async def unblock_queue(self, name: str) -> float | None:
        """Lift a RateLimited block before its end (a pause stays): the end lifted (Unix
        time), or None when the queue was not blocked."""
        return await self._run(self._unblock_queue(name))

    async def purge_queue(self, name: str) -> QueuePurged:
        """Cancel every ready (or parked) job of the queue, oldest first, each as a cancel
        would; scheduled and running jobs stay."""
        return await self._run(self._purge_queue(name))

    async def set_queue_limits(
        self,
        name: str,
        *,
        concurrency: int | None = None,
        rate: int | None = None,
        per: float = 1.0,
    ) -> None:
        """At most ``concurrency`` of the queue's jobs running at once, and at most ``rate``
        starts per ``per`` seconds, across every worker; with neither, lift the limits."""
        # the period only with a rate (alone, the API refuses it: it would read as a lift)
        limits = QueueLimits(
            concurrency=concurrency, rate=rate, per=per if rate is not None else 1.0
        )
        await self._run(self._queue_action(name, "limits", limits))

    async def workers(self) -> WorkerList:
        """The live workers (admin key), newest heartbeat first: what each serves, its slots,
        and the jobs it runs (``running_total``: all running now, ``running_listed`` of them
        listed)."""
        return await self._run(workers_op())

    async def queue_scaling(
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
        return await self._run(queue_scaling_op(name, slots, min, max, target_age))

    async def submit_batch(
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
        return await self._run(op)

    async def batch(self, batch_id: str) -> BatchStatus:
        """The batch's status: its counts by state, summed over the shards now."""
        return await self._run(batch_op(batch_id))

    async def cancel_batch(self, batch_id: str) -> BatchChanged:
        """Cancel the batch's children that have not started; ask its running ones to stop."""
        return await self._run(batch_action_op(batch_id, "cancel"))

    async def retry_batch(self, batch_id: str) -> BatchChanged:
        """Send the batch's failed children back to their queue, attempts reset."""
        return await self._run(batch_action_op(batch_id, "retry"))

    async def tasks(self) -> list[TaskAd]:
        """The task catalogue: each task a live or recently seen worker runs, with its
        queue, retry policy and payload schema."""
        return await self._run(self._tasks())

    # --- recurring schedules -----------------------------------------------------------------
    async def create_schedule(self, spec: ScheduleSpec | Mapping[str, Any]) -> Schedule:
        """Create a recurring schedule (``ScheduleSpec`` or its fields as a dict): a cron
        expression with a time zone, or an interval in seconds. Raises ``Conflict`` when the
        name is taken, ``ValidationFailed`` for a bad expression, zone or interval."""
        return await self._run(schedule_ops.create_op(spec))

    async def schedules(self, *, after: str = "", limit: int = 100) -> list[Schedule]:
        """The tenant's schedules ordered by name, starting after the name ``after``."""
        return await self._run(schedule_ops.list_op(after, limit))

    async def schedule(self, schedule_id: str) -> Schedule:
        return await self._run(schedule_ops.one_op("GET", schedule_id))

    async def pause_schedule(self, schedule_id: str) -> Schedule:
        return await self._run(schedule_ops.one_op("POST", schedule_id, "/pause"))

    async def resume_schedule(self, schedule_id: str) -> Schedule:
        """Resume from the next slot (the paused time is not caught up)."""
        return await self._run(schedule_ops.one_op("POST", schedule_id, "/resume"))

    async def upsert_schedule(self, spec: ScheduleSpec | Mapping[str, Any]) -> Schedule:
        """Create the schedule ``spec`` names, or make the tenant's schedule of that name
        ``spec`` (a field it does not give takes its default): schedules declared in code,
        applied at each deploy. Not atomic with a create or delete of the same name by
        another client meanwhile; the last to land wins."""
        return await self._run(schedule_ops.upsert_op(spec))

    async def update_schedule(self, schedule_id: str, **changes: Any) -> Schedule:
        """Change the fields given (``ScheduleSpec``'s names; ``max_attempts=None`` or
        ``queue=None`` go back to the task's). Its slots start anew from now when ``cron``,
        ``interval`` or ``timezone`` change, or ``paused=False`` resumes it; else its next
        firing is kept. ``cron`` alone replaces an ``interval``, and the other way round.
        Raises ``Conflict`` for a name the tenant's other schedule has, ``ValidationFailed``
        for a bad field (nothing changes)."""
        return await self._run(schedule_ops.update_op(schedule_id, changes))

    async def run_schedule(
        self, schedule_id: str, *, idempotency_key: str | None = None
    ) -> Submission:
        """Submit one job of the schedule now, as its slots' are made (paused or not; its
        slots do not change). With ``idempotency_key``, sending it again makes no second job
        (and a 429 or 503 is retried as a keyed submit's)."""
        return await self._run(schedule_ops.run_op(self, schedule_id, idempotency_key))

    async def delete_schedule(self, schedule_id: str) -> None:
        await self._run(schedule_ops.delete_op(schedule_id))

    # --- the driver -------------------------------------------------------------------------
    async def _send(self, call: Call) -> httpx.Response:
        response = await self._http.send(self._request(self._http, call), stream=call.stream)
        if call.stream and response.status_code != 200:
            try:
                await response.aread()
            finally:
                await response.aclose()
        return response

    async def _run(self, op: Op[T]) -> T:
        value: list[T] = []
        async for status in self._stream(kept(op, value)):
            raise AssertionError(f"{status!r} outside an event stream")
        return value[0]

    async def _stream(self, op: Op[None]) -> AsyncGenerator[JobStatus, None]:
        """Run ``op``'s steps; hand each status it emits to the caller."""
        response: httpx.Response | None = None
        lines: AsyncIterator[str] | None = None
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
                        await asyncio.sleep(step.seconds)
                    elif isinstance(step, ReadLine):
                        assert lines is not None
                        reply = await anext(lines, None)
                    else:
                        await _aclose(response, lines)
                        response = reply = await self._send(step)
                        streaming = step.stream and response.status_code == 200
                        lines = response.aiter_lines() if streaming else None
                except httpx.TransportError as exc:
                    step = op.throw(exc)
                    continue
                step = op.send(reply)
        except StopIteration:
            return
        finally:
            op.close()
            await _aclose(response, lines)


async def _aclose(response: httpx.Response | None, lines: AsyncIterator[str] | None) -> None:
    aclose = getattr(lines, "aclose", None)
    if aclose is not None:
        await aclose()
    if response is not None:
        await response.aclose()
