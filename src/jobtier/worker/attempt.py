"""One attempt of a task, and what it comes to: a result, a failure, or a stop.

The worker and ``jobtier.testing.task_run`` both run attempts through ``run_attempt``,
which hands how each ended to their ``attempt_ended``, and turn failures into the job's
error and retry delay through ``Failure``: a test of a task sees exactly the decisions a
worker makes (which exceptions are retried, after what delay, which results are refused,
what a cancel request does).

``run_attempt`` is the coroutine of the job's asyncio task itself, not one more layer under
the worker's: one more coroutine per running job would be one more object for the garbage
collector to carry per job in flight.

What happens next is Redis's: ``fail.lua`` retries a failure only while attempts remain
and no cancel was requested (``fail_state`` states its rule in Python for the tests), and
``stopped.lua`` turns a stop into ``cancelled`` when a cancel was requested, else gives the
job back to its queue.

A cancel request and a result: a task whose return reaches the worker *after* the request
was delivered to it (``ctx.cancel_requested`` is True by then) ends ``cancelled``, its result
dropped — it was asked to stop and may have cut its work short. A task that returned before
the request reached its worker succeeds: a success wins over a request not yet delivered.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import os
import traceback
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import msgspec

from jobtier.core.errors import Cancelled, Fatal, RateLimited, Retry
from jobtier.core.model import ClaimedJob, encode_json
from jobtier.core.sealing import (
    PREFIX,
    KeyMissing,
    Keyring,
    SealError,
    open_compensation,
    unseal,
)
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import RetryPolicy, Task

if TYPE_CHECKING:
    from jobtier.worker.procpool import ProcessPool

MESSAGE_LIMIT = 2000  # characters of an exception's message kept in the job's error
# A failed attempt's traceback, as the job's error keeps it: the last TRACEBACK_FRAMES frames
# of each exception in the chain, then at most TRACEBACK_CHARS characters, the end kept (the
# innermost frames and the exception line). The error is part of the status document every
# poll serves: these caps bound it however deep the failure.
TRACEBACK_FRAMES = 20
TRACEBACK_CHARS = 4000
DEFAULT_POLICY = RetryPolicy()  # for a job whose type this worker does not know
_encode = msgspec.json.Encoder().encode


class Stopped(enum.Enum):
    """An attempt that ended without a result or a failure."""

    STOPPED = "stopped"  # the task raised ``Cancelled`` for a requested cancel, or returned
    # after the request was delivered to it
    INTERRUPTED = "interrupted"  # asyncio.CancelledError of the attempt's task: a cancel
    # request reached an async task, or the worker is shutting down or lost the lease (one
    # the task's own code raised, its task not being cancelled, is a Failure)


STOPPED = Stopped.STOPPED
INTERRUPTED = Stopped.INTERRUPTED


@dataclass(slots=True)  # not frozen: a frozen __init__ sets each field by object.__setattr__
class Failure:
    """A failed attempt as the job records it.

    ``type``, ``message`` and the bounded ``traceback`` of ``exc`` become the job's
    ``error``; ``retry`` False sends the job to the dead-letter set whatever its attempts;
    ``delay`` is a delay the task asked for (``Retry(delay=…)``), else the policy decides.
    ``exc`` is what was raised (``raised`` False: made up here, for a refused result — it has
    no traceback worth keeping).
    """

    exc: BaseException
    type: str
    message: str
    retry: bool
    delay: float | None = None
    refund: bool = False  # the attempt does not count (RateLimited): retried whatever is left
    raised: bool = True

    @property
    def traceback(self) -> str | None:
        """``exc``'s traceback as the job keeps it (bounded), or None."""
        return format_traceback(self.exc) if self.raised else None

    def error_json(self) -> bytes:
        error = {"type": self.type, "message": self.message}
        text = self.traceback
        if text is not None:
            error["traceback"] = text
        return encode_json(error)

    def delay_ms(self, policy: RetryPolicy, attempt: int) -> int:
        """Milliseconds before the next attempt, or -1 for "do not retry" (fail.lua's ARGV).
        A delay asked for that has passed already (``Retry(delay=reset_at - now)``) is 0."""
        if not self.retry:
            return -1
        delay = self.delay if self.delay is not None else policy.delay(attempt)
        return max(0, round(1000 * delay))


def _folder(module: Any) -> str:
    return os.path.dirname(str(module.__file__)) + os.sep


_JOBTIER = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# Frames a task's failure passes through before the task's own: jobtier's (run_attempt) and,
# for a plain def task, the executor's thread and asyncio's future. Dropped from the start of
# each traceback, so that the reader sees their own code first.
RUNNER_FRAMES = (_JOBTIER, *(_folder(m) for m in (asyncio, concurrent.futures)))


def _drop_runner_frames(te: traceback.TracebackException) -> None:
    seen: set[int] = set()
    todo = [te]
    while todo:
        t = todo.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        leading = 0
        for frame in t.stack:
            if not frame.filename.startswith(RUNNER_FRAMES):
                break
            leading += 1
        if leading < len(t.stack):  # all runner frames: the runner raised it, keep them
            del t.stack[:leading]
        todo += [c for c in (t.__cause__, t.__context__) if c is not None]
        todo += getattr(t, "exceptions", None) or []


def format_traceback(exc: BaseException) -> str:
    """``exc``'s traceback, chained causes included, without the runner's frames that lead to
    the task's, bounded: the last ``TRACEBACK_FRAMES`` frames of each, then the last
    ``TRACEBACK_CHARS`` characters (cut at a line start)."""
    te = traceback.TracebackException.from_exception(exc, limit=-TRACEBACK_FRAMES)
    _drop_runner_frames(te)
    text = "".join(te.format())
    if len(text) > TRACEBACK_CHARS:
        tail = text[-(TRACEBACK_CHARS - 2) :]
        newline = tail.find("\n")
        if 0 <= newline < len(tail) - 1:
            tail = tail[newline + 1 :]
        text = "…\n" + tail
    return printable(text)


def printable(text: str) -> str:
    """``text`` as UTF-8 can carry it into the job's JSON: a lone surrogate (a file name
    decoded with ``surrogateescape``, as ``os.listdir`` gives one) as its ``\\udcXX`` escape."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def message_of(exc: BaseException) -> str:
    """``str(exc)`` for the job's error, bounded and printable; a placeholder when the
    exception's ``__str__`` itself raises."""
    try:
        text = str(exc)
    except Exception:
        text = f"<the {type(exc).__name__}'s message could not be read: its __str__ raised>"
    return printable(text[:MESSAGE_LIMIT])


def failure(exc: BaseException, task: Task | None, limit: float | None = None) -> Failure:
    """Classify what a task raised: ``Fatal``, a ciphertext that fails authentication and the
    task's ``non_retryable`` classes are not retried, everything else is (a timeout and a
    missing encryption key included, and what is no ``Exception``: a ``SystemExit`` or a
    ``KeyboardInterrupt`` the task raised fails its attempt, not the worker), ``Retry`` with
    the delay it names. ``limit``: the attempt's bound (``time_limit``), seconds."""
    if isinstance(exc, TimeoutError) and limit is not None:
        return Failure(exc, "TimeoutError", f"attempt timed out after {limit:g}s", True)
    if isinstance(exc, RateLimited):  # the worker also holds the queue back (reporter.py)
        message = message_of(exc)
        return Failure(exc, "RateLimited", message, True, exc.retry_after, refund=True)
    retry = not (
        isinstance(exc, Fatal)
        # no retry mends a ciphertext; a missing key may come with the worker's next deploy
        or (isinstance(exc, SealError) and not isinstance(exc, KeyMissing))
        or (task is not None and isinstance(exc, task.non_retryable))
    )
    delay = exc.delay if isinstance(exc, Retry) else None
    return Failure(exc, type(exc).__name__, message_of(exc), retry, delay)


def time_limit(task: Task | None, job: ClaimedJob) -> float | None:
    """How long an attempt of ``job`` may run, seconds: the job's own timeout, given at its
    submit, else its task's (None: unbounded, or no task to run)."""
    if task is None:
        return None
    return job.timeout if job.timeout is not None else task.timeout


class AttemptSink(Protocol):
    def attempt_ended(self, ctx: JobContext, end: bytes | Failure | Stopped) -> None:
        """How the attempt for ``ctx`` ended: its encoded result (``b""`` for ``None``), a
        ``Failure``, or ``STOPPED`` / ``INTERRUPTED``."""


async def run_attempt(
    task: Task | None,
    ctx: JobContext,
    executor: Executor,
    max_result_bytes: int,
    sink: AttemptSink,
    keyring: Keyring | None = None,
    sealed_queue: bool = False,
    processes: ProcessPool | None = None,
) -> None:
    """Run one attempt of ``task`` for ``ctx``'s job, as a worker does, and tell ``sink``
    how it ended (exactly once, before returning; a cancellation of this coroutine ends it
    too, as ``INTERRUPTED``: the sink knows why it cancelled and what that means).

    An ``async def`` task runs on the event loop, a plain ``def`` in ``executor`` (in
    ``processes``, a pool of child processes, when given); the job's ``timeout``, else the
    task's, bounds each (``time_limit``). An encrypted payload is opened with ``keyring``
    first, and the result of such a job (or of a task with ``encrypt=True``, or of a job in
    an encrypted queue: ``sealed_queue``) sealed (docs/encryption.md).
    """
    sealed = sealed_queue
    limit = time_limit(task, ctx.job)
    me = asyncio.current_task()  # a GeneratorExit met outside it closes us (_running_in)
    try:
        if task is None:
            raise LookupError(f"no task {ctx.type!r} in this worker ({ctx.worker_id})")
        payload = ctx.job.payload
        if payload[:13] == PREFIX:  # (is_sealed, without its call per job)
            sealed = True
            payload = unseal(keyring, ctx.job.id, "payload", payload)
        elif ctx.job.compensates is not None:  # a compensation's, perhaps holding a sealed one
            payload = open_compensation(keyring, payload, ctx.job.compensates)
        try:
            decoded = task.decode_payload(payload)  # into its annotated type, if any
        except msgspec.ValidationError as exc:
            raise Fatal(f"the payload does not fit {task.name}'s payload type: {exc}") from None
        if task.is_async:
            call: Any = task.fn(ctx, decoded)
        elif processes is not None:
            call = processes.run(task, ctx, decoded)
        else:
            call = ctx._loop.run_in_executor(executor, task.fn, ctx, decoded)
        if limit is not None:
            async with asyncio.timeout(limit):
                result = await call
        else:
            result = await call
    # The outcome goes straight to the sink, never into a local: a Failure holds the
    # exception, whose traceback holds this frame, which would then hold the Failure — a
    # cycle per failed job for the garbage collector to find.
    except asyncio.CancelledError as exc:
        current = asyncio.current_task()
        if current is not None and current.cancelling():  # we were cancelled: a stop
            sink.attempt_ended(ctx, INTERRUPTED)
        else:
            # raised by the task's own code (it awaited a future something else cancelled):
            # a failure like any other. As a stop it would be given back, to fail so again
            # at once, over and over, never counting an attempt
            message = "the task raised asyncio.CancelledError without being cancelled"
            sink.attempt_ended(ctx, Failure(exc, "CancelledError", message, True))
    except SealError as exc:  # the message names the job and key id, never a plain byte
        # a missing key is retried with the task's back-off: during a rolling deploy the
        # next worker to claim the job may hold it; a ciphertext that fails never opens
        retry = isinstance(exc, KeyMissing)
        sink.attempt_ended(ctx, Failure(exc, exc.kind, str(exc), retry, raised=False))
    except Cancelled as exc:
        if ctx.cancel_requested:
            sink.attempt_ended(ctx, STOPPED)
        else:
            sink.attempt_ended(ctx, Failure(exc, "Cancelled", message_of(exc), False))
    except BaseException as exc:  # any Exception; and a SystemExit, KeyboardInterrupt… it raised
        if isinstance(exc, GeneratorExit) and not _running_in(me):
            raise  # this coroutine is being closed (destroyed unfinished), not run: it ends
        if isinstance(exc, TimeoutError) and task is not None and not task.is_async:
            # a thread cannot be interrupted: it runs on past its timeout unless it stops
            # for the flag a cancel request raises (ctx.cancel_requested, check_cancelled)
            ctx._request_cancel()
        sink.attempt_ended(ctx, failure(exc, task, limit))
    else:
        if ctx._cancelled:  # (ctx.cancel_requested, without a property call per job)
            # the task returned after its cancel request was delivered: it was asked to stop
            # and may have cut its work short, so the job ends cancelled, its result dropped
            # (a request that reaches the worker after the return loses: the job succeeds)
            sink.attempt_ended(ctx, STOPPED)
        elif keyring is not None and (sealed or task.encrypt):  # (task: not None, it ran)
            # (a worker with an encrypt=True task has keys: WorkerState refuses to start
            # without; jobtier.testing runs one without, its result left plain)
            sink.attempt_ended(ctx, _sealed(encode_result(result, max_result_bytes), ctx, keyring))
        else:
            sink.attempt_ended(ctx, encode_result(result, max_result_bytes))


def _running_in(task: asyncio.Task[Any] | None) -> bool:
    """Whether the attempt runs in ``task`` now: a GeneratorExit met then is one the task's
    code raised (a failure like any other); met outside it, it was thrown in to close the
    coroutine (by the garbage collector, another task running or none)."""
    try:
        return task is not None and asyncio.current_task() is task
    except RuntimeError:  # no event loop running
        return False


def _sealed(end: bytes | Failure, ctx: JobContext, keyring: Keyring) -> bytes | Failure:
    """An encrypted job's result as it is kept: sealed (``b""``, no result, as it is)."""
    if not end or isinstance(end, Failure):
        return end
    return keyring.seal(ctx.job.id, "result", end)


def encode_result(result: Any, max_result_bytes: int) -> bytes | Failure:
    """The result as the job keeps it (``b""`` for ``None``), or why it cannot keep it."""
    if result is None:
        return b""
    try:
        data = _encode(result)
    except Exception as exc:  # also a RecursionError (nested too deep), a UnicodeEncodeError
        why = f"{type(exc).__name__}: {message_of(exc)}"
        return _refused("ResultNotSerialisable", f"result is not JSON-serialisable: {why}")
    if len(data) > max_result_bytes:
        return _refused("ResultTooLarge", f"result is {len(data)} bytes; limit {max_result_bytes}")
    return data


def _refused(kind: str, message: str) -> Failure:
    """A result the job cannot keep: no retry would make it fit."""
    message = message[:MESSAGE_LIMIT]
    return Failure(Fatal(message), kind, message, retry=False, raised=False)


def deliver_cancel(ctx: JobContext, task: Task | None, handle: asyncio.Task[Any] | None) -> None:
    """A cancel was requested for a running job: raise the context's flag (sync tasks poll
    it) and cancel an async task outright (it stops at its next ``await``)."""
    ctx._request_cancel()
    if task is not None and task.is_async and handle is not None:
        handle.cancel()


def fail_state(
    delay_ms: int, attempt: int, max_attempts: int, refund: bool = False
) -> Literal["scheduled", "failed"]:
    """The state ``fail.lua`` gives a failed attempt: retried while attempts remain (an
    attempt refunded does not count).

    fail.lua decides in Redis; this is the same rule for ``jobtier.testing``, which runs no
    Redis (tests/integration/test_testing_plugin.py checks the two agree)."""
    if refund:
        attempt -= 1
    return "scheduled" if delay_ms >= 0 and attempt < max_attempts else "failed"
