"""What a running task sees of its job: ids, attempt, progress reporting, cancellation."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from jobtier.errors import Cancelled
from jobtier.flows.reads import from_inputs
from jobtier.model import ClaimedJob, Dependency, encode_json


class JobContext:
    """Passed as the first argument to every task: ``async def my_task(ctx, payload)``.

    Thread-safe where it has to be: a sync task running in the thread pool may call
    ``progress()`` and read ``cancel_requested``.
    """

    __slots__ = (
        "_cancelled", "_dependencies", "_loop", "_loop_thread", "_on_progress", "_waiter",
        "job", "shard", "worker_id",
    )  # fmt: skip

    def __init__(
        self,
        job: ClaimedJob,
        shard: int,
        worker_id: str,
        loop: asyncio.AbstractEventLoop,
        on_progress: Callable[[bytes], None],
    ) -> None:
        self.job = job
        self.shard = shard
        self.worker_id = worker_id
        self._loop = loop
        self._loop_thread = threading.get_ident()  # built on the event loop's thread
        self._on_progress = on_progress
        # made on first use: most tasks never wait for a cancel, and a context is built per job
        self._cancelled = False  # read from the thread pool too: a bool is safe to share
        self._waiter: asyncio.Event | None = None
        self._dependencies: dict[str, Dependency] | None = None  # decoded on first use

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
        ``error``: with ``on_dependency_failure="run"`` a job also runs after failures).
        Empty for a job without dependencies."""
        if self._dependencies is None:
            self._dependencies = from_inputs(self.job.inputs)
        return self._dependencies

    @property
    def previous(self) -> Any:
        """The result of the last dependency (in a chain: the step before this one), or
        None without any."""
        deps = self.dependencies
        if not deps:
            return None
        return deps[next(reversed(deps))].result

    def progress(self, value: Any) -> None:
        """Report progress (any JSON value, e.g. 0.4 or {"done": 40, "of": 100}).

        It appears in the job's status document within a fraction of a second; reports made
        faster than that are merged, the latest winning.
        """
        data = encode_json(value)
        if threading.get_ident() == self._loop_thread:
            self._on_progress(data)
        else:
            self._loop.call_soon_threadsafe(self._on_progress, data)

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
