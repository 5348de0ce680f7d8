"""What a running task sees of its job: ids, attempt, progress, checkpoint, log lines,
cancellation."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import msgspec

from jobtier.core.errors import Cancelled, ResultGone
from jobtier.core.model import (
    LOG_LINE_CHARS,
    LOG_LINES,
    ClaimedJob,
    Dependency,
    LogLine,
    encode_json,
)
from jobtier.core.sealing import Keyring, unseal
from jobtier.flows.reads import from_inputs, opened, stored_refs
from jobtier.worker.checkpoint import Checkpoint, Saver

# A job's log lines (ctx.log): it keeps its latest LOG_LINES lines, of all its attempts, each
# at most LOG_LINE_CHARS characters (a longer one is cut and ends with "…"). A task that logs
# more than LOG_LINES lines between two sends of its worker (every ~0.2 s) loses the oldest
# of them, and a line says how many.
_encode_line = msgspec.json.Encoder().encode
_log_lock = threading.Lock()  # ctx.log may be called from a sync task's thread


class _LogBuffer:
    """Lines not yet sent to Redis (made on a task's first ``ctx.log``)."""

    __slots__ = ("dropped", "lines")

    def __init__(self) -> None:
        self.lines: deque[bytes] = deque(maxlen=LOG_LINES)
        self.dropped = 0


def _now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class JobContext:
    """Passed as the first argument to every task: ``async def my_task(ctx, payload)``.

    Thread-safe where it has to be: a sync task running in the thread pool may call
    ``progress()`` and ``log()`` and read ``cancel_requested``.
    """

    __slots__ = (
        "_cancelled",
        "_checkpoint",
        "_dependencies",
        "_keyring",
        "_log",
        "_loop",
        "_loop_thread",
        "_on_checkpoint",
        "_on_log",
        "_on_progress",
        "_read_result",
        "_refs",
        "_waiter",
        "job",
        "shard",
        "worker_id",
    )

    def __init__(
        self,
        job: ClaimedJob,
        shard: int,
        worker_id: str,
        loop: asyncio.AbstractEventLoop,
        on_progress: Callable[[bytes], None],
        on_log: Callable[[JobContext], None] | None = None,
        read_result: Callable[[str], Awaitable[bytes | None]] | None = None,
        keyring: Keyring | None = None,
        on_checkpoint: Saver | None = None,
    ) -> None:
        self.job = job
        self.shard = shard
        self.worker_id = worker_id
        self._loop = loop
        self._loop_thread = threading.get_ident()  # built on the event loop's thread
        self._on_progress = on_progress
        # told (on the loop's thread) when lines wait to be taken (``_take_logs``); one call
        # per batch of lines, not per line
        self._on_log = on_log
        self._log: _LogBuffer | None = None
        # made on first use: most tasks never wait for a cancel, and a context is built per job
        self._cancelled = False  # read from the thread pool too: a bool is safe to share
        self._waiter: asyncio.Event | None = None
        self._dependencies: dict[str, Dependency] | None = None  # decoded on first use
        # a result kept in the result store, by its reference (``result``): the worker's
        self._read_result = read_result
        self._refs: dict[str, str] | None = None  # their references, found on first use
        self._keyring = keyring  # opens the dependencies' encrypted results
        # saves ``checkpoint`` states (worker/checkpoint.py); None keeps them here only
        self._on_checkpoint = on_checkpoint
        self._checkpoint: Checkpoint | None = None  # made on first use

    @property
    def checkpoint(self) -> Checkpoint:
        """The job's checkpoint: ``await ctx.checkpoint(state)`` saves ``state`` (JSON,
        at most ``JOBTIER_CHECKPOINT_MAX_BYTES``) under the job's lease;
        ``ctx.checkpoint.state`` is the last state saved — on a retried or reclaimed
        attempt, the one an earlier attempt saved (None if none did)."""
        cp = self._checkpoint
        if cp is None:
            cp = self._checkpoint = Checkpoint(self, self.job.checkpoint)
        return cp

    @property
    def job_id(self) -> str:
        return self.job.id

    @property
    def attempt(self) -> int:
        """1 for the first run, 2 for the first retry, …"""
        return self.job.attempt

    @property
    def max_attempts(self) -> int:
        return self.job.max_attempts

    @property
    def type(self) -> str:
        return self.job.type

    @property
    def dependencies(self) -> dict[str, Dependency]:
        """The jobs this one waited for (``depends_on``; a flow's ``after``: its children),
        by id, in the order they were given, each with its ``state`` and its ``result`` (or
        ``error``: with ``on_dependency_failure="run"`` a job also runs after failures). A
        result kept in the result store (``JOBTIER_RESULT_STORE``) is not copied here: its
        ``result_url`` says where to read it. Empty for a job without dependencies."""
        if self._dependencies is None:
            self._dependencies = opened(from_inputs(self.job.inputs), self._keyring)
        return self._dependencies

    @property
    def previous(self) -> Any:
        """The result of the last dependency (in a chain: the step before this one), or
        None without any. A result kept in the result store is None here, as in
        ``dependencies``: ``await ctx.result()`` reads it."""
        deps = self.dependencies
        if not deps:
            return None
        return deps[next(reversed(deps))].result

    def result(self, dependency: str | None = None) -> Awaitable[Any]:
        """The result of a job this one waited for, by id (the last one without an id, as
        ``previous``), read from the result store when it is kept there
        (``JOBTIER_RESULT_STORE``: ``dependencies`` and ``previous`` give None for such a
        result, and its ``result_url``). None for a dependency that did not succeed.

        ``await`` it from an ``async`` task: it reads on the worker's event loop, and a sync
        task (in the thread pool) gets a ``RuntimeError``. ``KeyError`` for an id this job
        did not wait for; ``jobtier.core.errors.ResultGone`` (a ``LookupError``, and ``Fatal``: no
        retry brings it back) when the store no longer holds the result (deleted with its
        job); a worker that stores no results itself needs ``JOBTIER_DATABASE_URL`` to read
        one (else ``ConfigError``, retried: a worker given the setting can read it). Raised
        into the task, each fails the attempt as any error does unless the task catches it."""
        if threading.get_ident() != self._loop_thread:
            raise RuntimeError(
                "ctx.result() reads on the worker's event loop: await it from an async task"
            )
        return self._result(dependency)

    async def _result(self, dependency: str | None) -> Any:
        deps = self.dependencies
        if dependency is None:
            if not deps:
                return None
            dependency = next(reversed(deps))
        dep = deps.get(dependency)
        if dep is None:
            raise KeyError(f"{dependency!r} is not one of the jobs this job waited for")
        if dep.result_url is None:
            return dep.result
        if self._refs is None:
            self._refs = stored_refs(self.job.inputs)
        if self._read_result is None:
            raise RuntimeError(f"the result of {dependency} is in the result store, unread here")
        data = await self._read_result(self._refs[dependency])
        if data is None:
            raise ResultGone(f"the result store no longer holds the result of {dependency}")
        return msgspec.json.decode(unseal(self._keyring, dependency, "result", data))

    def progress(self, value: Any) -> None:
        """Report progress (any JSON value, e.g. 0.4 or {"done": 40, "of": 100}).

        It appears in the job's status document within a fraction of a second; reports made
        faster than that are merged, the latest winning.
        """
        self._on_loop(self._on_progress, encode_json(value))

    def log(self, message: Any) -> None:
        """Add a line to the job's log: ``GET /v1/jobs/{id}/logs``, ``Client.logs()`` and
        ``jobtier jobs logs`` show it, with its time and attempt.

        A job keeps its latest ``LOG_LINES`` (200) lines, each cut at ``LOG_LINE_CHARS``
        (1,000) characters; they live in Redis as long as the job does there. Lines reach
        Redis within a fraction of a second, batched, apart from the job's transitions. A
        non-string ``message`` is written as ``str(message)``.
        """
        text = message if isinstance(message, str) else str(message)
        if len(text) > LOG_LINE_CHARS:
            text = text[: LOG_LINE_CHARS - 1] + "…"
        line = _encode_line(LogLine(_now_iso(), self.job.attempt, text))
        with _log_lock:
            buffer = self._log
            if buffer is None:
                buffer = self._log = _LogBuffer()
            first = not buffer.lines
            if len(buffer.lines) == LOG_LINES:
                buffer.dropped += 1  # the deque drops its oldest line
            buffer.lines.append(line)
        if first and self._on_log is not None:
            self._on_loop(self._on_log, self)

    def _on_loop(self, call: Callable[[Any], None], arg: Any) -> None:
        """``call(arg)`` on the worker's event loop: now when on its thread, else soon."""
        if threading.get_ident() == self._loop_thread:
            call(arg)
        else:
            self._loop.call_soon_threadsafe(call, arg)

    def _take_logs(self) -> list[bytes]:
        """The lines logged since the last call (JSON ``LogLine`` each), oldest first; a line
        saying how many were dropped comes first when the buffer overflowed."""
        with _log_lock:
            buffer = self._log
            if buffer is None or not buffer.lines:
                return []
            lines, dropped = list(buffer.lines), buffer.dropped
            buffer.lines.clear()
            buffer.dropped = 0
        if dropped:
            note = f"[{dropped} earlier lines dropped: over {LOG_LINES} lines in one send]"
            lines.insert(0, _encode_line(LogLine(_now_iso(), self.job.attempt, note)))
        return lines

    @property
    def cancel_requested(self) -> bool:
        """True once someone asked to cancel this job."""
        return self._cancelled

    async def wait_cancelled(self) -> None:
        """Return when a cancel is requested."""
        if self._cancelled:
            return
        if self._waiter is None:
            self._waiter = asyncio.Event()
        await self._waiter.wait()

    def check_cancelled(self) -> None:
        """Raise ``jobtier.Cancelled`` if a cancel was requested (for loops in sync tasks)."""
        if self._cancelled:
            raise Cancelled(f"job {self.job.id} was cancelled")

    def _request_cancel(self) -> None:
        self._cancelled = True
        if self._waiter is not None:
            self._waiter.set()
