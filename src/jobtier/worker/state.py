"""What the worker's parts share: who it is, the jobs it runs and its slots, its counters,
and the events that hand work from one part to another.

The parts (claimer, launcher, reporter, heartbeat; ``Worker`` wires them in runner.py) run on
one event loop and share this without locks. The events: ``slot_free`` (an attempt ended:
the claim loops and the drain look again; a stop sets it too), ``stopping`` / ``stop_now``
(``Worker.stop``), ``progress`` (a task reported progress or logged lines: a progress beat is
due) and ``beat_idle`` (clear while a heartbeat is in flight: the reporter waits for it, so
that a job's last progress, carried by that beat, reaches Redis before the job's outcome).

A ``Running`` job carries the flags that make a late outcome harmless: ``lost`` (a heartbeat
was refused) and ``released`` (given back at shutdown) drop it, its fencing token being stale.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from jobtier.core.errors import ConfigError
from jobtier.core.model import ClaimedJob
from jobtier.core.names import QUEUE_NAME_RE
from jobtier.metrics.histogram import Histogram
from jobtier.runtime.backoff import Backoff
from jobtier.runtime.loop import wait_for
from jobtier.store.context import Store
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import Task, TaskRegistry

log = logging.getLogger("jobtier.worker")


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
    checkpoints: int = 0  # ctx.checkpoint states saved (checkpoint_saver.py)
    loop_blocked: int = 0  # stalls of the event loop past the watch's seconds (loop_watch.py)
    claim_wait: Histogram = field(default_factory=Histogram)  # seconds, since start
    run_time: Histogram = field(default_factory=Histogram)


@dataclass(slots=True)
class Running:
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
    permit: str | None = None  # a limited queue's permit (permits.py), returned at the end
    span: Any = None  # the attempt's span, when tracing is on (attempt_spans.py)


class WorkerState:
    """One worker's identity, settings and shared state (see the module docstring)."""

    def __init__(
        self,
        store: Store,
        registry: TaskRegistry,
        concurrency: int,
        burst: bool,
        name: str | None,
        idle_poll: float,
        queues: Sequence[str] | None,
        stats: WorkerStats | None,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        served = list(dict.fromkeys(queues)) if queues else registry.queues()
        for q in served:
            if not QUEUE_NAME_RE.fullmatch(q):
                raise ConfigError(f"queue {q!r} must match {QUEUE_NAME_RE.pattern}")
        if not served:
            raise ConfigError("a worker must serve at least one queue")
        sealed = [t.name for t in registry if t.encrypt]
        if sealed and store.keyring is None:
            raise ConfigError(
                f"task {sealed[0]} encrypts its payloads and results (encrypt=True): set "
                "JOBTIER_ENCRYPTION_KEYS (docs/encryption.md)"
            )
        self.store = store
        self.settings = store.settings
        self.redis = store.redis
        self.keys = store.keys
        self.scripts = store.scripts
        self.registry = registry
        self.queues = served  # served in turn: each claim round starts one queue further on
        self.served = {q.encode() for q in served}
        self.types = registry.names()  # the claim script hands back jobs of other types
        # some types are held back by an open circuit breaker (breaker_gate.py): their jobs
        # handed back are expected, not a deployment's mistake
        self.types_held = False
        self.concurrency = concurrency
        self.burst = burst
        self.id = name or f"{socket.gethostname()}:{os.getpid()}:{os.urandom(2).hex()}"
        self.idle_poll = idle_poll
        self.lease_ms = int(self.settings.lease_seconds * 1000)
        self.history_ms = int(self.settings.progress_history_seconds * 1000)
        self.stats = stats if stats is not None else WorkerStats()
        self.running: dict[str, Running] = {}
        self.reserved = 0  # slots promised to claims in flight (the claim loops share them)
        self.slot_free = asyncio.Event()
        self.stopping = asyncio.Event()
        self.stop_now = asyncio.Event()  # the deadline moved to now (a second signal)
        self.deadline: float | None = None  # monotonic time running jobs must end by
        self.progress = asyncio.Event()
        self.beat_idle = asyncio.Event()
        self.beat_idle.set()

    def free_slots(self) -> int:
        return self.concurrency - len(self.running) - self.reserved

    def reserve(self, n: int) -> Callable[[], None]:
        """Hold ``n`` slots for a claim in flight; call the result when its jobs started.
        Slots it did not fill are free again: a claim loop waiting for a slot looks again."""
        self.reserved += n

        def done() -> None:
            self.reserved -= n
            self.slot_free.set()

        return done

    async def wait_for_slot(self) -> None:
        self.slot_free.clear()
        await self.slot_free.wait()  # a stop sets it too

    async def claim_failed(self, backoff: Backoff, exc: BaseException, where: str = "") -> None:
        """Log a claim Redis refused and wait out its back-off (a stop ends the wait)."""
        wait = backoff.next()
        log.warning(
            "event=claim_failed worker=%s%s error=%r retry_in=%.2fs", self.id, where, exc, wait
        )
        await wait_for(self.stopping, wait)

    # the job context's callbacks (on the event loop's thread)
    def on_progress(self, job_id: str, data: bytes) -> None:
        r = self.running.get(job_id)
        if r is not None:
            r.progress = data
            self.progress.set()

    def on_log(self, ctx: JobContext) -> None:
        """A task logged lines (ctx.log): the next progress beat takes them."""
        r = self.running.get(ctx.job.id)
        if r is not None:
            r.logged = True
            self.progress.set()
