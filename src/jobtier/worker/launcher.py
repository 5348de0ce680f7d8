"""Starting attempts: each claimed job's context and asyncio task, the sync tasks' thread
pool, the result stores; at shutdown, the drain and the release of what still runs.

A cancel push can overtake its job's claim reply (it travels on the subscriber's
connection): ``cancel_when_started`` keeps it, and ``start`` delivers it once the attempt
has started.

Shutdown (``drain``) keeps to the deadline ``Worker.stop`` fixed: running jobs get until then
to finish, then are released to the fronts of their queues (no attempt used) and their tasks
cancelled. A sync task in the thread pool cannot be interrupted: its job is released all the
same, and whatever the thread produces later is dropped (the reporter), as Redis would refuse
it (the release moved the job past the attempt's fencing token). What did not end when asked
is counted (``Worker.stuck``), so the command can exit without joining it.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from jobtier.core.errors import ConfigError
from jobtier.core.model import ClaimedJob
from jobtier.persist.results import PostgresResultStore, open_store
from jobtier.runtime import tracing
from jobtier.runtime.loop import wait_any
from jobtier.worker import attempt_spans
from jobtier.worker.attempt import AttemptSink, deliver_cancel, run_attempt
from jobtier.worker.breaker_gate import BreakerGate, MakeAttempt
from jobtier.worker.checkpoint_saver import CheckpointSaver
from jobtier.worker.job_context import JobContext
from jobtier.worker.procpool import (
    Executor,
    ProcessOptions,
    ProcessPool,
    check_importable,
    runs_in_process,
)
from jobtier.worker.registry import Task
from jobtier.worker.reporter import Reporter
from jobtier.worker.state import Running, WorkerState
from jobtier.worker.stored import run_attempt_storing

log = logging.getLogger("jobtier.worker")

EARLY_CANCELS = 1000  # cancel pushes kept for jobs whose claim reply has not arrived yet
FINISH_AFTER_CANCEL = 1.0  # s a cancelled task gets to run its cleanup before we move on


class TaskThreads(ThreadPoolExecutor):
    """The sync tasks' thread pool, counting the calls still running in it: a thread cannot be
    interrupted, and a process that exits normally joins its pool's threads, so whoever
    stops the worker needs to know whether one is still busy (see ``Worker.stuck``)."""

    def __init__(self, max_workers: int, prefix: str) -> None:
        super().__init__(max_workers, prefix)
        self._busy = 0
        self._busy_lock = threading.Lock()
        self.carry_context = False  # run each call in its caller's context (tracing: its span)

    @property
    def busy(self) -> int:
        return self._busy

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        if self.carry_context:  # run_in_executor does not carry contextvars to the thread
            fn, args = contextvars.copy_context().run, (fn, *args)

        def counted() -> Any:
            with self._busy_lock:
                self._busy += 1
            try:
                return fn(*args, **kwargs)
            finally:
                with self._busy_lock:
                    self._busy -= 1

        return super().submit(counted)


async def _unreadable(ref: str) -> bytes | None:
    raise ConfigError("a result in the result store: reading it needs JOBTIER_DATABASE_URL")


class Launcher:
    """Runs each claimed job's attempt as an asyncio task that ends into the reporter."""

    loop: asyncio.AbstractEventLoop  # set by open()

    def __init__(
        self,
        state: WorkerState,
        reporter: Reporter,
        threads: int | None,
        executor: Executor = "thread",
        processes: ProcessOptions | None = None,
    ) -> None:
        self.state = state
        self.reporter = reporter
        self.id = state.id
        self.threads = TaskThreads(threads or min(32, state.concurrency), "jobtier-task")
        self.early_cancels: dict[str, None] = {}
        # where large results go (JOBTIER_RESULT_STORE), and where the dependencies' stored
        # results are read from (that store, else one on JOBTIER_DATABASE_URL)
        self.results: PostgresResultStore | None = None
        self._reader: PostgresResultStore | None = None
        self._read: Callable[[str], Awaitable[bytes | None]] = _unreadable
        self._running = state.running
        self._stats = state.stats
        self._on_progress = state.on_progress
        self._on_log = state.on_log  # bound once, not once per job
        self._save_checkpoint = CheckpointSaver(state).save
        self._task_of = state.registry.get
        self._max_result = state.settings.max_result_bytes
        self._keyring = state.store.keyring  # opens payloads, seals results (encrypted jobs)
        # their results sealed whoever made the job (Lua makes compensations and schedule
        # firings, with plain payloads)
        self._sealed_queues = state.settings.encrypted_queue_names()
        self._tracer: Any = None  # set by open() when tracing is on
        # the plain def tasks run in child processes (procpool.py), by name; a pool only
        # for a worker that has some
        in_process = [t for t in state.registry if runs_in_process(t, executor)]
        for t in in_process:
            check_importable(t)
        self.processes = ProcessPool(processes or ProcessOptions()) if in_process else None
        self._pool_of = {t.name: self.processes for t in in_process}.get
        self.breakers = BreakerGate(state)

    async def open(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._tracer = tracing.tracer()
        self.threads.carry_context = self._tracer is not None
        if self.processes is not None:
            self.processes.start()
        settings = self.state.settings
        self.results = await open_store(settings)
        if self.results is not None:
            self._read = self.results.get
        elif settings.database_url:
            self._reader = await PostgresResultStore.connect(settings.database_url)
            self._read = self._reader.get

    async def close(self) -> int:
        """Shut the thread pool down without joining it and close the stores; returns how
        many sync tasks are still running in it."""
        self.threads.shutdown(wait=False, cancel_futures=True)
        busy = self.threads.busy
        if self.processes is not None:
            await self.processes.close()
        for store in (self.results, self._reader):
            if store is not None:
                await store.close()
        return busy

    def start(self, job: ClaimedJob, shard: int, now_ms: int, permit: str | None = None) -> None:
        stats = self._stats
        stats.claimed += 1
        stats.claim_wait.observe(max(now_ms - job.queued_at_ms, 0) / 1000)
        on_progress = self._on_progress
        progress = functools.partial(on_progress, job.id)
        keyring = self._keyring
        ctx = JobContext(
            job,
            shard,
            self.id,
            self.loop,
            progress,
            self._on_log,
            self._read,
            keyring,
            self._save_checkpoint,
        )
        task = self._task_of(job.type)
        running = Running(job, shard, task, ctx, time.monotonic(), permit=permit)
        self._running[job.id] = running
        make = self._attempt(task, ctx)
        if task is not None and task.breaker is not None:  # its breaker first (breaker_gate.py)
            attempt = self.breakers.run(task, ctx, self.reporter, make)
        else:
            attempt = make(self.reporter)
        if self._tracer is None:
            running.handle = asyncio.create_task(attempt, name=f"job {job.id}")
        else:  # the task starts with the attempt's span current (create_task copies it)
            running.span = span = attempt_spans.start(self._tracer, job)
            token = tracing.attach(span, tracing.context_of(None))
            try:
                running.handle = asyncio.create_task(attempt, name=f"job {job.id}")
            finally:
                tracing.detach(token)
        if self.early_cancels and self.early_cancels.pop(job.id, False) is None:
            log.info("event=cancel_requested worker=%s job=%s via=push", self.id, job.id)
            # once the attempt has started: a task cancelled before its first step never
            # runs run_attempt, which then never reports, and the job would stay running
            self.loop.call_soon(deliver_cancel, ctx, task, running.handle)

    def _attempt(self, task: Task | None, ctx: JobContext) -> MakeAttempt:
        """The attempt's coroutine given where it ends (as ``start`` makes it): for a task
        with a breaker, whose gate ends it into a sink of its own first."""
        limit = self._max_result
        keyring = self._keyring
        in_sealed = ctx.job.queue in self._sealed_queues
        results = self.results
        procs = self._pool_of(ctx.job.type)

        def make(sink: AttemptSink) -> Coroutine[Any, Any, None]:
            if results is None:
                return run_attempt(task, ctx, self.threads, limit, sink, keyring, in_sealed, procs)
            return run_attempt_storing(
                task,
                ctx,
                self.threads,
                limit,
                sink,
                results,
                self.state.settings.result_store_threshold_bytes,
                keyring,
                in_sealed,
                procs,
            )

        return make

    def cancel_when_started(self, job_id: str) -> None:
        """A cancel push for a job not running (yet): its claim reply may be on its way."""
        self.early_cancels[job_id] = None
        if len(self.early_cancels) > EARLY_CANCELS:
            del self.early_cancels[next(iter(self.early_cancels))]

    async def drain(self) -> int:
        """After the claim loops: running jobs finish by the deadline, or are released.
        Returns how many of their tasks did not end when cancelled."""
        state = self.state
        while self._running and state.deadline is not None:
            left = state.deadline - time.monotonic()
            if left <= 0 or state.stop_now.is_set():
                break
            state.slot_free.clear()
            await wait_any((state.slot_free, state.stop_now), left)
        if not self._running:
            return 0
        handles = [r.handle for r in self._running.values() if r.handle is not None]
        self.release_all("stop_now" if state.stop_now.is_set() else "grace_over")
        # the cancelled tasks run their cleanup (finally blocks) while the releases are sent;
        # one that ignores its cancellation is left behind and counted in stuck (as are the
        # threads of sync tasks, whose awaiting end this cancel does stop)
        if not handles:
            return 0
        _, pending = await asyncio.wait(handles, timeout=FINISH_AFTER_CANCEL)
        return len(pending)

    def release_all(self, reason: str) -> None:
        """Give every running job back to its queue (the ``stopped`` script: queued again at
        the front, attempt not counted) and stop its task."""
        log.info(
            "event=worker_releasing worker=%s jobs=%d reason=%s",
            self.id,
            len(self._running),
            reason,
        )
        for r in list(self._running.values()):
            self.reporter.report("stopped", r, ())
            r.released = True
            if r.span is not None:
                attempt_spans.end(r.span, "released")
            del self._running[r.job.id]  # no more heartbeats for it
            # (event=job_released is logged once Redis has taken the release: reporter.py)
            # a sync task sees the request at its next ctx.check_cancelled(), if it makes one:
            # its thread cannot be interrupted
            r.ctx._request_cancel()
            if r.handle is not None:
                r.handle.cancel()
