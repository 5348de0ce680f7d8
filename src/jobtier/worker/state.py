"""What the worker's parts share: its settings, the jobs it runs, its slots, and the events
that hand work from one of its loops to another.

``Worker`` (runner.py) is one object built in layers, a module each, each layer adding one
concern to the one below it:

- ``state`` (this module): the shared state, the sync tasks' thread pool, the sleep helpers;
- ``reporting``: how each attempt ended, sent to Redis in batches by the reporter loop;
- ``claiming``: the claim loop and its wake-ups, the limited queues' loops, starting attempts;
- ``heartbeat``: lease renewal, progress and log lines, cancel requests (by beat and by push);
- ``runner``: start-up, ``stop()``, the drain and the releases at shutdown.

The loops run on one event loop and share this state without locks; they hand work to each
other through the events made here: ``_slot_free`` (an attempt ended: the claim loops and the
drain look again; ``stop()`` sets it too, so that a claim loop waits on it alone and wakes in
the turn a slot frees, ahead of the reporter: see reporting.py), ``_wake`` (a shard has new
jobs), ``_progress`` (a task reported progress or logged lines: a progress beat is due),
``_outbox_ready`` / ``_outbox_idle`` (an outcome is queued; the shutdown's flush waits for
idle), ``_beat_idle`` (clear while a heartbeat is in flight: the reporter waits for it, so
that a job's last progress, carried by that beat, reaches Redis before the job's outcome,
which would make Redis refuse it) and ``_stopping`` / ``_stop_now`` (``stop()``).

Races guarded here: the thread pool counts its busy calls under a lock (its threads run off
the event loop), and ``_Running`` carries the flags that make a late outcome harmless: ``lost``
(a heartbeat was refused) and ``released`` (given back at shutdown) drop it rather than apply
it, its fencing token being stale.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from jobtier.core.errors import ConfigError
from jobtier.core.model import ClaimedJob
from jobtier.core.names import QUEUE_NAME_RE
from jobtier.engine.queue import Queue
from jobtier.metrics.histogram import Histogram
from jobtier.persist.results import PostgresResultStore
from jobtier.store.redis import ShardSubscriber
from jobtier.worker.context import JobContext
from jobtier.worker.permits import LimitedClaimer
from jobtier.worker.registry import Task, TaskRegistry

UNKNOWN = 1 << 30  # a shard whose queue length we don't know: worth asking


@dataclass(slots=True)
class WorkerStats:
    claimed: int = 0
    claim_round_trips: int = 0
    succeeded: int = 0
    retried: int = 0
    failed: int = 0
    cancelled: int = 0
    released: int = 0
    refused: int = 0  # stale writes refused by Redis (this worker had lost the job)
    leases_lost: int = 0
    handed_back: int = 0  # jobs of types this worker cannot run, left in their queue
    rate_limited: int = 0  # tasks that raised RateLimited
    claim_wait: Histogram = field(default_factory=Histogram)  # seconds, since start
    run_time: Histogram = field(default_factory=Histogram)


@dataclass(slots=True)
class _Running:
    job: ClaimedJob
    shard: int
    task: Task | None
    ctx: JobContext
    started: float
    handle: asyncio.Task[None] | None = None
    progress: bytes | None = None
    logged: bool = False  # the task logged lines not taken yet (ctx.log)
    lost: bool = False  # a heartbeat was refused: stop and drop the outcome
    released: bool = False  # given back at shutdown: any later outcome is dropped
    permit: str | None = None  # a limited queue's permit (limits.py), returned at the end


class _TaskThreads(ThreadPoolExecutor):
    """The sync tasks' thread pool, counting the calls still running in it: a thread cannot be
    interrupted, and a process that exits normally joins its pool's threads, so whoever
    stops the worker needs to know whether one is still busy (see ``Worker.stuck``)."""

    def __init__(self, max_workers: int, prefix: str) -> None:
        super().__init__(max_workers, prefix)
        self._busy = 0
        self._busy_lock = threading.Lock()

    @property
    def busy(self) -> int:
        return self._busy

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        def counted() -> Any:
            with self._busy_lock:
                self._busy += 1
            try:
                return fn(*args, **kwargs)
            finally:
                with self._busy_lock:
                    self._busy -= 1

        return super().submit(counted)


class WorkerState:
    """The state the worker's layers share (see the module docstring); ``Worker`` is the
    class to use."""

    # set by run(); hasattr() tells whether the worker is running (claiming._refresh_limits)
    _loop: asyncio.AbstractEventLoop

    def __init__(
        self,
        queue: Queue,
        registry: TaskRegistry,
        *,
        concurrency: int = 50,
        burst: bool = False,
        name: str | None = None,
        shutdown_grace: float = 30.0,
        idle_poll: float = 5.0,
        threads: int | None = None,
        progress_interval: float = 0.2,
        queues: Sequence[str] | None = None,
        cancel_push: bool = True,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        served = list(dict.fromkeys(queues)) if queues else registry.queues()
        for q in served:
            if not QUEUE_NAME_RE.fullmatch(q):
                raise ConfigError(f"queue {q!r} must match {QUEUE_NAME_RE.pattern}")
        if not served:
            raise ConfigError("a worker must serve at least one queue")
        self.queue = queue
        self.scripts = queue.scripts
        self.keys = queue.keys
        self.settings = queue.settings
        self.registry = registry
        self.queues = served  # served in turn: each claim round starts one queue further on
        self._served = {q.encode() for q in served}
        self._types = registry.names()  # the claim script hands back jobs of other types
        self._queue_turn = 0
        # limited queues (global concurrency or rate) are claimed by their own loops
        self._claimers: dict[str, LimitedClaimer] = {}
        self._claimer_tasks: dict[str, asyncio.Task[None]] = {}
        self._reserved = 0  # slots promised to claims in flight (the loops share the slots)
        self._claims_over = False
        self._background: set[asyncio.Task[None]] = set()
        self._unblock: asyncio.TimerHandle | None = None  # a look when a queue's block ends
        self._unblock_ms = 0
        self.concurrency = concurrency
        self.burst = burst
        self.id = name or f"{socket.gethostname()}:{os.getpid()}:{os.urandom(2).hex()}"
        self.shutdown_grace = shutdown_grace
        self.idle_poll = idle_poll
        self.progress_interval = progress_interval
        # act on cancel pushes (False: learn of requests at heartbeats only, as before the
        # push existed; bench/cancel.py measures one against the other)
        self.cancel_push = cancel_push
        # pushes naming this worker for a job it does not run (yet): the push travels on the
        # subscriber's connection and may overtake the claim reply on the command connection
        self._early_cancels: dict[str, None] = {}
        self.lease_ms = int(self.settings.lease_seconds * 1000)
        self.history_ms = int(self.settings.progress_history_seconds * 1000)
        # a running job's log lines live as long as the job could (a failure keeps it longer)
        self._lines_ttl = max(self.settings.retention_seconds, self.settings.dead_retention_seconds)
        self._log_sink = self._on_log  # bound once, not once per job
        self.stats = WorkerStats()
        self._threads = _TaskThreads(threads or min(32, concurrency), "jobtier-task")
        self._running: dict[str, _Running] = {}
        self._ready = [UNKNOWN] * self.keys.shards  # known ready jobs per shard
        self._generation = [0] * self.keys.shards  # bumped by each wake of the shard
        self._start_shard = 0  # where the next round of claims begins (see _plan)
        self._wake = asyncio.Event()
        self._slot_free = asyncio.Event()
        self._stopping = asyncio.Event()
        self._stop_now = asyncio.Event()  # the deadline moved to now (a second signal)
        self._deadline: float | None = None  # monotonic time running jobs must end by
        self.stuck = 0  # after run(): tasks and threads that did not end when asked (see stop)
        self._progress = asyncio.Event()
        # "progress" and "logs" first: _send_outbox sends the kinds in this order (_report)
        self._outbox: dict[str, dict[int, list[tuple[Any, ...]]]] = {
            "progress": defaultdict(list),
            "logs": defaultdict(list),
            "complete": defaultdict(list),
            "fail": defaultdict(list),
            "stopped": defaultdict(list),
        }
        # a limited queue's permits (queue -> ids): of jobs whose outcome is in the outbox,
        # then of jobs whose outcome Redis has (to give back)
        self._pending_permits: dict[str, list[str]] = defaultdict(list)
        self._to_release: dict[str, list[str]] = defaultdict(list)
        self._outbox_ready = asyncio.Event()
        self._outbox_idle = asyncio.Event()
        self._outbox_idle.set()
        self._beat_idle = asyncio.Event()  # clear while a heartbeat is in flight
        self._beat_idle.set()
        self._heart_stop = asyncio.Event()
        self._subscriber: ShardSubscriber | None = None
        self._idle = False
        self._results: PostgresResultStore | None = None

    # --- the job context's callbacks --------------------------------------------------------
    def _on_progress(self, job_id: str, data: bytes) -> None:
        r = self._running.get(job_id)
        if r is not None:
            r.progress = data
            self._progress.set()

    def _on_log(self, ctx: JobContext) -> None:
        """A task logged lines (ctx.log): the next progress beat (≤ 0.2 s) takes them."""
        r = self._running.get(ctx.job.id)
        if r is not None:
            r.logged = True
            self._progress.set()

    # --- helpers ----------------------------------------------------------------------------
    async def _sleep(self, seconds: float, event: asyncio.Event | None = None) -> bool:
        """Sleep up to ``seconds``; True if ``event`` (or a stop) ended it early."""
        waits = [self._stopping.wait()]
        if event is not None:
            waits.append(event.wait())
        return await self._first(*waits, timeout=seconds)

    @staticmethod
    async def _first(*aws: Any, timeout: float | None = None) -> bool:
        tasks = [asyncio.ensure_future(a) for a in aws]
        try:
            done, _ = await asyncio.wait(
                tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for t in tasks:
                t.cancel()
        return bool(done)
