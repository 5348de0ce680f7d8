"""Run one attempt of a task in this process, with a real ``JobContext``, and see its outcome.

No Redis, no worker loop: the attempt goes through the worker's own code
(``jobtier.worker.attempt``), so the outcome (result encoding and size limit, which exceptions
are retried and after what delay, what a cancel request does) is the one a worker would
report. Where Redis decides (a retryable failure on the last attempt; a stop after a cancel
request), the outcome states the decision the transition script would make.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Awaitable, Callable, Generator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, ParamSpec, TypeVar

import msgspec

from jobtier.config import Settings
from jobtier.core.errors import InvalidRequest
from jobtier.core.keys import Keys
from jobtier.core.model import LOG_LINES, RESULT_REF, ClaimedJob, Dependency, encode_json
from jobtier.flows.reads import MARKS
from jobtier.worker.attempt import (
    INTERRUPTED,
    Failure,
    Stopped,
    deliver_cancel,
    fail_state,
    run_attempt,
)
from jobtier.worker.checkpoint import check_size
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import Task
from jobtier.worker.registry import task as as_task

State = Literal["succeeded", "retry", "failed", "cancelled", "released"]
_decode = msgspec.json.Decoder().decode
_encode_error = msgspec.json.Encoder().encode
# lib.lua's mark of each finished state as claim.lua hands it to a worker (upper case: a
# child of the job)
_MARKS = {state: mark for mark, state in MARKS.items()}
_STORED = "jobtier.testing:"  # the references of results "kept in the result store" here

Inputs = tuple[bytes, list[bytes]]
P = ParamSpec("P")
R = TypeVar("R")


def dependency_inputs(
    dependencies: Mapping[str, Any],
) -> tuple[Inputs | None, Callable[[str], Awaitable[bytes | None]]]:
    """What claim.lua would hand a worker for a job that waited for ``dependencies`` (see
    ``run_task``), and a reader of the results they keep "in the result store"."""
    ids: list[str] = []
    flat: list[bytes] = []
    stored: dict[str, bytes] = {}
    for dep_id, value in dependencies.items():
        if not isinstance(dep_id, str) or dep_id.split() != [dep_id]:
            raise ValueError(f"dependencies: {dep_id!r} is not a job id")
        dep = value
        if not isinstance(dep, Dependency):
            dep = Dependency(id=dep_id, state="succeeded", result=value)
        if dep.id != dep_id:
            raise ValueError(f"dependencies: the Dependency under {dep_id!r} has id {dep.id!r}")
        mark = _MARKS.get(dep.state)
        if mark is None:
            raise ValueError(
                f"dependencies: {dep_id!r} is {dep.state!r}; a worker runs a job once each of "
                f"its dependencies has finished: {', '.join(_MARKS)}"
            )
        if dep.state == "succeeded" and dep.error is not None:
            raise ValueError(f"dependencies: {dep_id!r} succeeded: it has no error")
        if dep.state != "succeeded" and (dep.result is not None or dep.result_url is not None):
            raise ValueError(f"dependencies: {dep_id!r} is {dep.state!r}: it has no result")
        if dep.state == "succeeded":
            try:
                data = encode_json(dep.result)
            except TypeError as exc:
                raise InvalidRequest(f"dependencies: {dep_id!r}: {exc}") from None
            if dep.result_url is not None:  # kept in the result store: only its reference
                stored[_STORED + dep_id] = data
                data = RESULT_REF + (_STORED + dep_id).encode()
        else:
            data = b"" if dep.error is None else _encode_error(dep.error)
        ids.append(dep_id)
        flat += [dep_id.encode(), (mark.upper() if dep.child else mark).encode() + data]

    async def read(ref: str) -> bytes | None:
        return stored.get(ref)

    return ((" ".join(ids).encode(), flat) if ids else None), read


@dataclass(frozen=True, slots=True)
class TaskError:
    """A failed attempt: ``type``, ``message`` and ``traceback`` are what the job's ``error``
    would hold (the traceback bounded as a worker bounds it; None for a refused result, which
    nothing raised); ``retryable`` is False for ``Fatal``, the task's ``non_retryable``
    classes and refused results (whatever attempts remain); ``exception`` is what was raised,
    its whole traceback attached."""

    type: str
    message: str
    retryable: bool
    traceback: str | None
    exception: BaseException


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one attempt came to.

    ``state``:

    - ``"succeeded"``: ``result`` is the task's return value as a client reads it back
      (encoded to JSON and decoded again: tuples come back as lists);
    - ``"retry"``: the job would be scheduled again after ``retry_in`` seconds (the task's
      backoff policy, jitter included, or the delay of ``Retry(delay=…)``);
    - ``"failed"``: the job would go to the dead-letter set (``Fatal``, a ``non_retryable``
      exception, an unserialisable or oversized result, or no attempts left);
    - ``"cancelled"``: a cancel was requested and the task stopped for it, or returned after
      the request reached it (its result is dropped, as a worker drops it);
    - ``"released"``: the attempt was cancelled with no cancel requested (the caller of
      ``outcome()`` was, a test's timeout): a worker that stops gives the job back to its
      queue so. (A task whose own code raises ``asyncio.CancelledError``, its attempt not
      being cancelled, fails like any other: ``"retry"`` or ``"failed"``.)

    ``error`` is set for ``"retry"`` and ``"failed"``; ``progress`` holds every
    ``ctx.progress()`` value in the order reported (a worker merges reports made within a
    fraction of a second; here none is lost); ``logs`` the messages of ``ctx.log()`` as the
    job would keep them (its latest 200, each cut at 1,000 characters); ``checkpoints``
    every state saved with ``ctx.checkpoint()``, in order (the last one is what the next
    attempt would start from: ``run_task(..., checkpoint=outcome.checkpoints[-1])``).
    """

    state: State
    result: Any = None
    error: TaskError | None = None
    retry_in: float | None = None
    progress: list[Any] = field(default_factory=list)
    logs: list[str] = field(default_factory=list)
    checkpoints: list[Any] = field(default_factory=list)
    job_id: str = ""
    attempt: int = 1
    max_attempts: int = 1


class TaskRun:
    """A running attempt (``start_task``): watch its progress, request a cancel, await it."""

    def __init__(
        self,
        task: Task,
        job: ClaimedJob,
        shard: int,
        max_result_bytes: int,
        cancel_after_progress: int | None,
        read_result: Callable[[str], Awaitable[bytes | None]] | None = None,
        max_checkpoint_bytes: int = 64 * 1024,
    ) -> None:
        self.task = task
        self._loop = asyncio.get_running_loop()
        worker = f"jobtier.testing:{os.getpid()}"
        on_progress, on_log = self._on_progress, self._on_log
        self.ctx = JobContext(
            job,
            shard,
            worker,
            self._loop,
            on_progress,
            on_log,
            read_result,
            on_checkpoint=self._on_checkpoint,
        )
        self.checkpoints: list[Any] = []  # every state saved so far, in order
        self._max_checkpoint = max_checkpoint_bytes
        self.progress: list[Any] = []  # every report so far, in order
        self.logs: list[str] = []  # every ctx.log() message so far, as the job keeps each
        self._cancel_after = cancel_after_progress
        # a pool per attempt, as a worker's pool threads: a sync task runs off the loop
        self._threads = ThreadPoolExecutor(1, thread_name_prefix="jobtier-task")
        self._progressed = asyncio.Event()
        self._ended: Outcome | None = None
        # the attempt's coroutine is the asyncio task itself, as in a worker: a cancel
        # request reaches the task's code directly
        self._handle = self._loop.create_task(
            run_attempt(task, self.ctx, self._threads, max_result_bytes, self),
            name=f"job {job.id}",
        )

    @property
    def job_id(self) -> str:
        return self.ctx.job_id

    def done(self) -> bool:
        return self._handle.done()

    def cancel(self) -> None:
        """Request a cancel, as ``POST /v1/jobs/{id}/cancel`` does (from any thread).

        Delivered the way a worker delivers it on its next heartbeat: the context's flag is
        raised (``ctx.cancel_requested``, ``ctx.check_cancelled()``, ``ctx.wait_cancelled()``)
        and an async task is cancelled at its next ``await``."""
        self._loop.call_soon_threadsafe(self._deliver_cancel)

    async def wait_progress(self, count: int = 1) -> list[Any]:
        """Wait until the task has reported progress ``count`` times; returns the reports.
        Raises ``RuntimeError`` if the attempt ends first."""
        while len(self.progress) < count:
            if self._handle.done():
                raise RuntimeError(
                    f"the attempt ended after {len(self.progress)} progress report(s), "
                    f"before {count}"
                )
            self._progressed.clear()
            progressed = asyncio.ensure_future(self._progressed.wait())
            try:
                await asyncio.wait({self._handle, progressed}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                progressed.cancel()
        return list(self.progress)

    async def outcome(self) -> Outcome:
        """Wait for the attempt to end and return its outcome. Cancelling the caller (a test
        timeout) cancels the attempt too."""
        try:
            # not a plain await: the attempt would absorb a cancel of the caller (reading it as
            # one for the task), and the caller would never see it
            await asyncio.wait({self._handle})
        except asyncio.CancelledError:
            self._handle.cancel()
            raise
        self._handle.result()  # raises what the attempt's bookkeeping raised, if anything
        if self._ended is None:  # cancelled before it started: the task never ran
            return self._make("cancelled" if self.ctx.cancel_requested else "released")
        return self._ended

    def __await__(self) -> Generator[Any, None, Outcome]:
        return self.outcome().__await__()

    # --- inside -----------------------------------------------------------------------------
    def _on_progress(self, data: bytes) -> None:  # on the loop's thread
        self.progress.append(_decode(data))
        self._progressed.set()
        if self._cancel_after is not None and len(self.progress) == self._cancel_after:
            # after the task's current step, as a heartbeat would: an async task that
            # reports and returns without awaiting again has finished first
            self._loop.call_soon(self._deliver_cancel)

    async def _on_checkpoint(self, ctx: JobContext, data: bytes) -> None:
        check_size(data, self._max_checkpoint)  # as a worker refuses it
        self.checkpoints.append(_decode(data))

    def _on_log(self, ctx: JobContext) -> None:  # on the loop's thread
        self.logs += [_decode(line)["message"] for line in ctx._take_logs()]

    def _deliver_cancel(self) -> None:
        if not self._handle.done() and not self.ctx.cancel_requested:
            deliver_cancel(self.ctx, self.task, self._handle)

    def attempt_ended(self, ctx: JobContext, end: bytes | Failure | Stopped) -> None:
        """Called by ``run_attempt``: the outcome a worker and Redis would make of ``end``."""
        # like a worker: a sync task's thread cannot be interrupted; queue nothing more on it
        self._threads.shutdown(wait=False, cancel_futures=True)
        if isinstance(end, bytes):
            self._ended = self._make("succeeded", result=_decode(end) if end else None)
        elif isinstance(end, Failure):
            delay_ms = end.delay_ms(self.task.retry, ctx.attempt)
            error = TaskError(end.type, end.message, end.retry, end.traceback, end.exc)
            if fail_state(delay_ms, ctx.attempt, ctx.max_attempts, end.refund) == "scheduled":
                self._ended = self._make("retry", error=error, retry_in=delay_ms / 1000)
            else:
                self._ended = self._make("failed", error=error)
        elif end is INTERRUPTED and not ctx.cancel_requested:
            # reported "stopped", with no cancel request: stopped.lua gives the job back
            self._ended = self._make("released")
        else:  # STOPPED, or INTERRUPTED by the cancel request: stopped.lua cancels the job
            self._ended = self._make("cancelled")

    def _make(self, state: State, **kw: Any) -> Outcome:
        self._on_log(self.ctx)  # lines a thread logged whose notice has not run yet
        return Outcome(
            state,
            progress=list(self.progress),
            logs=self.logs[-LOG_LINES:],
            checkpoints=list(self.checkpoints),
            job_id=self.ctx.job_id,
            attempt=self.ctx.attempt,
            max_attempts=self.ctx.max_attempts,
            **kw,
        )


def _takes(start: Callable[P, Any]) -> Callable[[Callable[..., R]], Callable[P, R]]:
    """For the type checker: the function decorated takes the arguments of ``start`` (and
    hands them on to it)."""

    def same(fn: Callable[..., R]) -> Callable[P, R]:
        return fn

    return same


def start_task(
    task: Task | Callable[..., Any],
    payload: Any = None,
    *,
    attempt: int = 1,
    max_attempts: int | None = None,
    job_id: str | None = None,
    settings: Settings | None = None,
    cancel_after_progress: int | None = None,
    dependencies: Mapping[str, Any] | None = None,
    checkpoint: Any = None,
) -> TaskRun:
    """Start one attempt of ``task`` on the running event loop and return at once.

    The handle's ``progress`` fills as the task reports; ``cancel()`` requests a cancel;
    ``await run`` (or ``await run.outcome()``) gives the ``Outcome``. See ``run_task`` for
    the arguments.
    """
    asyncio.get_running_loop()  # fail here, not later, when called without a loop
    t = task if isinstance(task, Task) else as_task(task)
    s = settings or Settings.from_env()
    if max_attempts is None:
        max_attempts = t.max_attempts
    if isinstance(attempt, bool) or not 1 <= attempt <= max_attempts:
        raise ValueError(f"attempt must be between 1 and max_attempts ({max_attempts})")
    if cancel_after_progress is not None and cancel_after_progress < 1:
        raise ValueError("cancel_after_progress must be 1 or more (a count of reports)")
    try:
        data = encode_json(payload)
    except TypeError as exc:
        raise InvalidRequest(f"payload: {exc}", field="payload") from None
    if len(data) > s.max_payload_bytes:
        raise InvalidRequest(
            f"payload is {len(data)} bytes; the limit is {s.max_payload_bytes}", field="payload"
        )
    inputs, read_result = dependency_inputs(dependencies or {})
    keys = Keys(s.prefix, s.shards)
    job_id = job_id or keys.new_id()
    try:
        shard = keys.shard_of(job_id)
    except ValueError:
        shard = 0  # an id of the test's own making
    now_ms = time.time_ns() // 1_000_000
    # lease_version 2: the version a job has once claimed (submitted at 1)
    saved = None if checkpoint is None else encode_json(checkpoint)
    job = ClaimedJob(
        job_id, t.name, data, attempt, max_attempts, 2, now_ms, now_ms, inputs=inputs,
        checkpoint=saved,
    )  # fmt: skip
    return TaskRun(
        t,
        job,
        shard,
        s.max_result_bytes,
        cancel_after_progress,
        read_result,
        s.checkpoint_max_bytes,
    )


@_takes(start_task)
async def run_task(task: Task | Callable[..., Any], payload: Any = None, **options: Any) -> Outcome:
    """Run one attempt of ``task`` with ``payload`` as a worker would, and return its outcome.

    >>> outcome = await run_task(resize, {"image": "a.png"})
    >>> assert outcome.state == "succeeded" and outcome.progress == [0.5]

    - ``task``: a ``@task`` (a plain function is taken as ``@task`` with the defaults);
      async tasks run on this event loop, plain ``def`` tasks in a thread, both bounded by
      the task's ``timeout``.
    - ``payload``: any JSON value; it is encoded and decoded as a submit and a claim would
      (a payload a submit would refuse raises ``InvalidRequest``).
    - ``attempt`` / ``max_attempts``: what ``ctx.attempt`` and ``ctx.max_attempts`` say
      (``max_attempts`` defaults to the task's ``retries + 1``); a retryable failure on the
      last attempt is ``"failed"``.
    - ``job_id``: ``ctx.job_id`` (a fresh id of the production form when not given).
    - ``settings``: for the result and payload size limits (``Settings.from_env()`` when not
      given, as a worker in this environment would use).
    - ``cancel_after_progress``: request a cancel right after the task's n-th progress
      report; ``start_task`` gives a handle to cancel at any other point.
    - ``dependencies``: the jobs this one waited for (``ctx.dependencies``, ``ctx.previous``,
      ``ctx.result()``), by id, in order: each value is a succeeded dependency's result, or
      a ``jobtier.core.model.Dependency`` for any other finished outcome (``state`` "failed" or
      "cancelled" with its ``error``, "missing"; ``child=True`` for a flow's child). A
      succeeded ``Dependency`` with a ``result_url`` stands for a result kept in the result
      store: the task sees it as a worker would (no ``result`` in ``ctx.dependencies``),
      and ``await ctx.result(id)`` reads its ``result``.
    - ``checkpoint``: the state an earlier attempt saved (``ctx.checkpoint.state``), to
      test how the task resumes; the states this attempt saves are in ``checkpoints``.
    """
    return await start_task(task, payload, **options)


@_takes(start_task)
def run_task_sync(task: Task | Callable[..., Any], payload: Any = None, **options: Any) -> Outcome:
    """``run_task`` for a test with no event loop: runs the attempt in a new loop
    (``asyncio.run``). Inside a coroutine, ``await run_task(...)`` instead."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError(
            "run_task_sync() was called inside a running event loop "
            f"(thread {threading.current_thread().name}): use `await run_task(...)`"
        )
    return asyncio.run(run_task(task, payload, **options))
