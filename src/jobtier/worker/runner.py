"""The worker: claims jobs in batches, runs them with bounded concurrency, reports in batches.

Three loops share one event loop:

- the claim loop asks the shards for as many jobs as there are free slots, in one pipelined
  round trip, and sleeps on the shards' wake channels when every queue it saw was empty
  (no polling: an idle worker costs nothing, yet a new job reaches it in one publish);
- the reporter sends finished jobs' outcomes (complete / fail / stopped), batched per shard
  in one pipeline, while the next ones accumulate;
- the heartbeat loop extends the leases of all running jobs every third of the lease,
  carries progress reports and the tasks' log lines, and learns of cancel requests and of
  lost leases.

A cancel request reaches the worker sooner than a heartbeat: ``cancel.lua`` publishes
``x <job id> <worker id>`` on the shard's wake channel, which every worker already listens
to, and the worker named there stops the task at once (``_on_wake``). Pub/sub can drop a
message (a reconnect); the heartbeat, which reports the request too, is the safety net.

Shutdown (``stop()``, SIGTERM) keeps to a deadline fixed when it is asked for: claiming stops
at once, running jobs get until then to finish, and the rest are released to the fronts of
their queues (no attempt used) by one ``stopped`` call per shard. ``stop(now=True)`` (a second
signal) moves the deadline to now. A sync task in the thread pool cannot be interrupted: its
job is released all the same and whatever the thread produces later is dropped here, and
would be refused by Redis anyway (the release moved the job past the attempt's fencing token).
``stuck`` then counts what is still running, so the command can exit without joining it.

Every write carries the job's ``lease_version`` (fencing token from the claim): a refusal
means this worker lost the job (its lease expired and the job moved on); its result is
dropped, never applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError

from jobtier.backoff import CLAIM, REPORT
from jobtier.catalog import publish as publish_tasks
from jobtier.connection import ShardSubscriber
from jobtier.errors import Code, ConfigError, RateLimited
from jobtier.metrics.histogram import Histogram
from jobtier.metrics.snapshot import Snapshot, labels
from jobtier.model import QUEUE_NAME_RE, ClaimedJob, encode_json
from jobtier.persist.results import PostgresResultStore, open_store
from jobtier.queue import Queue
from jobtier.scripts import Call
from jobtier.worker.attempt import (
    DEFAULT_POLICY,
    STOPPED,
    Failure,
    Stopped,
    deliver_cancel,
    run_attempt,
)
from jobtier.worker.context import LOG_LINES, JobContext
from jobtier.worker.limits import LimitedClaimer, limit_calls
from jobtier.worker.registry import Task, TaskRegistry
from jobtier.worker.stored import run_attempt_storing

log = logging.getLogger("jobtier.worker")

UNKNOWN = 1 << 30  # a shard whose queue length we don't know: worth asking
FINISH_AFTER_CANCEL = 1.0  # s a cancelled task gets to run its cleanup before we move on
FLUSH_AFTER_STOP_NOW = 5.0  # s the last reports (the releases) get after stop(now=True)
EARLY_CANCELS = 1000  # cancel pushes kept for jobs whose claim reply has not arrived yet
PROBE_MIN = 16  # fewest jobs asked of a shard whose count is unknown (see Worker._plan)


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


class Worker:
    """Runs the tasks of ``registry`` for jobs claimed from ``queue``'s shards.

    ``burst=True`` drains the ready queues and returns (tests, one-off runs).
    ``stop()`` (SIGTERM) stops claiming, lets running jobs finish until ``shutdown_grace``
    seconds after it was called, then releases the rest back to their queues;
    ``stop(now=True)`` releases them at once.
    """

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

    # --- lifecycle --------------------------------------------------------------------------
    def metrics(self) -> Snapshot:
        """This worker's part of its process's metrics snapshot."""
        st = self.stats
        outcomes: dict[str, float] = {
            labels(outcome="succeeded"): st.succeeded,
            labels(outcome="retried"): st.retried,
            labels(outcome="failed"): st.failed,
            labels(outcome="cancelled"): st.cancelled,
            labels(outcome="released"): st.released,
        }
        return Snapshot(
            "", "", 0.0,
            counters={
                "worker_jobs_started_total": {"": st.claimed},
                "worker_claim_round_trips_total": {"": st.claim_round_trips},
                "worker_outcomes_total": outcomes,
                "stale_writes_refused_total": {"": st.refused},
                "leases_lost_total": {"": st.leases_lost},
                "worker_handed_back_total": {"": st.handed_back},
                "worker_rate_limited_total": {"": st.rate_limited},
                "queue_limit_wait_seconds_total": {
                    labels(queue=q): c.stats.waited for q, c in self._claimers.items()
                },
            },
            gauges={
                "worker_running_jobs": {"": len(self._running)},
                "worker_concurrency": {"": self.concurrency},
            },
            histograms={
                "claim_wait_seconds": {"": st.claim_wait.snapshot()},
                "run_time_seconds": {"": st.run_time.snapshot()},
            },
        )  # fmt: skip

    @property
    def idle(self) -> bool:
        """True while the worker waits for a wake: every queue it knows of was empty (jobs
        it already runs may still be running)."""
        return self._idle

    def stop(self, *, now: bool = False) -> None:
        """Stop claiming. Jobs running get until ``shutdown_grace`` seconds after the first
        call to finish (a wall-clock bound, however busy the slots), then are cancelled and
        released to their queues. ``now=True``: release them at once (a second signal)."""
        at = time.monotonic()
        if not self._stopping.is_set():
            self._deadline = at + self.shutdown_grace
            self._stopping.set()
            self._wake.set()
            log.info(
                "event=worker_draining worker=%s running=%d grace=%gs",
                self.id, len(self._running), self.shutdown_grace,
            )  # fmt: skip
        if now and not self._stop_now.is_set():
            self._deadline = at
            self._stop_now.set()
            log.warning(
                "event=worker_stop_now worker=%s running=%d: releasing running jobs now",
                self.id, len(self._running),
            )  # fmt: skip

    async def run(self) -> WorkerStats:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._subscriber = ShardSubscriber(
            self.queue.redis,
            [self.keys.wake(s) for s in range(self.keys.shards)],
            self._on_wake,
            self._on_reset,
            name=f"worker-wake {self.id}",
        )
        await self._subscriber.start()
        self._results = await open_store(self.settings)  # JOBTIER_RESULT_STORE, if set
        await self._advertise()
        await self._refresh_limits()
        reporter = asyncio.create_task(self._report_loop(), name="jobtier-reporter")
        heart = asyncio.create_task(self._heartbeat_loop(), name="jobtier-heartbeat")
        log.info(
            "event=worker_started worker=%s concurrency=%d queues=%s tasks=%s burst=%s",
            self.id, self.concurrency, ",".join(self.queues), ",".join(self._types), self.burst,
        )  # fmt: skip
        try:
            await self._claim_until_stopped()
            await self._stop_claimers()
            await self._drain()
        finally:
            if self._running:  # the claim loop crashed: give back what we hold
                self._release_all("worker_failed")
            # stopped by a flag, not cancelled: a cancellation landing inside the Redis client
            # during a beat was seen to be swallowed there, the loop went on, and run()
            # waited for it forever
            self._heart_stop.set()
            self._progress.set()
            done, _ = await asyncio.wait({heart}, timeout=1.0 if self._stop_now.is_set() else 10.0)
            if done:
                heart.result()  # a crash of the loop surfaces here, as before
            else:
                heart.cancel()
            await self._flush_outbox()
            reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reporter
            await self._subscriber.stop()
            with contextlib.suppress(RedisError, OSError):
                await self.queue.redis.hdel(self.keys.workers(), self.id)
            self._threads.shutdown(wait=False, cancel_futures=True)
            self.stuck += self._threads.busy
            if self._results is not None:
                await self._results.close()
            log.info(
                "event=worker_stopped worker=%s succeeded=%d failed=%d retried=%d released=%d "
                "stuck=%d",
                self.id, self.stats.succeeded, self.stats.failed, self.stats.retried,
                self.stats.released, self.stuck,
            )  # fmt: skip
        return self.stats

    def _on_wake(self, channel: bytes, data: bytes) -> None:
        # "q <queue>": a queue of the shard had no ready job and now has some;
        # "l <queue>": a permit of a limited queue came free;
        # "x <job id> <worker id>": a cancel was requested for a job that worker runs
        if data[:2] == b"x ":
            if self.cancel_push:
                self._on_cancel_push(data)
            return
        if data[2:] not in self._served:
            return
        claimer = self._claimers.get(data[2:].decode())
        if claimer is not None:
            claimer.wake.set()
            return
        if data[:2] == b"q ":
            shard = int(channel[channel.index(b"{") + 1 : channel.index(b"}")])
            self._ready[shard] = UNKNOWN
            self._generation[shard] += 1
            self._wake.set()

    def _on_cancel_push(self, data: bytes) -> None:
        job_id, _, worker = data[2:].decode().partition(" ")
        if worker != self.id:
            return  # another worker's job (every worker hears every shard)
        r = self._running.get(job_id)
        if r is None:
            # its claim reply may still be on its way: _start delivers it then
            self._early_cancels[job_id] = None
            if len(self._early_cancels) > EARLY_CANCELS:
                del self._early_cancels[next(iter(self._early_cancels))]
            return
        if not r.ctx.cancel_requested:
            log.info("event=cancel_requested worker=%s job=%s via=push", self.id, job_id)
            deliver_cancel(r.ctx, r.task, r.handle)

    def _on_reset(self) -> None:
        # (re)subscribed: wakes may have been missed while the connection was down
        self._ready = [UNKNOWN] * self.keys.shards
        self._generation = [g + 1 for g in self._generation]
        self._wake.set()
        for claimer in self._claimers.values():
            claimer.wake.set()

    # --- claiming ---------------------------------------------------------------------------
    async def _claim_until_stopped(self) -> None:
        """The claim loop, given up at the deadline if a claim is still in flight then (a
        Redis that stopped answering must not hold the shutdown past its bound)."""
        claims = asyncio.create_task(self._claim_loop(), name="jobtier-claims")
        stopping = asyncio.ensure_future(self._stopping.wait())
        now = asyncio.ensure_future(self._stop_now.wait())
        try:
            await asyncio.wait({claims, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not claims.done():  # stopping: the loop ends after the claim in flight, if any
                left = max(0.0, (self._deadline or 0.0) - time.monotonic())
                await asyncio.wait({claims, now}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            now.cancel()
        if not claims.done():
            log.warning("event=claim_abandoned worker=%s: a claim was still in flight", self.id)
            claims.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await claims
        else:
            claims.result()  # a crash of the loop surfaces here

    async def _claim_loop(self) -> None:
        backoff = CLAIM.start()
        while not self._stopping.is_set():
            free = self.free_slots()
            if free <= 0:
                # every slot busy: wake for a free slot or for a stop, which must not wait
                # for a job to end (it would wait a whole job, past the grace)
                self._slot_free.clear()
                await self._first(self._slot_free.wait(), self._stopping.wait())
                continue
            self._wake.clear()
            reserved = self.reserve(free)
            try:
                claimed = await self._claim(free)
                backoff.reset()
            except (RedisError, OSError) as exc:
                wait = backoff.next()
                log.warning(
                    "event=claim_failed worker=%s error=%r retry_in=%.2fs", self.id, exc, wait
                )
                await self._sleep(wait)
                continue
            finally:
                reserved()
            if claimed or any(self._ready):
                continue  # more to claim, or shards this round did not ask
            if self.burst:
                if not self._running and all(c.idle for c in self._claimers.values()):
                    return
                self._slot_free.clear()
                await self._first(self._slot_free.wait(), self._wake.wait(), self._stopping.wait())
                continue
            # every queue we know of is empty: sleep until a wake (or the safety net)
            self._idle = True
            try:
                woke = await self._sleep(self.idle_poll, self._wake)
            finally:
                self._idle = False
            if not woke:
                self._ready = [UNKNOWN] * self.keys.shards

    async def _claim(self, free: int) -> int:
        """One pipelined round of claims over the shards believed to hold ready jobs."""
        plan = self._plan(free)
        if not plan:
            return 0
        turn = self._queue_turn
        self._queue_turn = (turn + 1) % len(self.queues)
        queues = [
            (q, -1) for q in self.queues[turn:] + self.queues[:turn] if q not in self._claimers
        ]
        if not queues:
            self._ready = [0] * self.keys.shards  # every queue is limited: their loops claim
            return 0
        generations = [self._generation[shard] for shard, _ in plan]
        calls: list[Call] = [
            self.scripts.claim_call(shard, self.id, n, self.lease_ms, queues, self._types)
            for shard, n in plan
        ]
        replies = await self.scripts.call_many(calls)
        self.stats.claim_round_trips += 1
        total = 0
        unaware = False
        for (shard, _), gen, reply in zip(plan, generations, replies, strict=True):
            batch = self.scripts.parse_claim(shard, reply)
            # a wake that arrived while this claim was in flight is newer than its answer
            if self._generation[shard] == gen:
                self._ready[shard] = batch.ready_left
            if batch.handed_back:
                self._handed_back(batch.handed_back)
            if batch.wake_at_ms > 0:  # a blocked queue: look again when its block ends
                self._wake_at(batch.wake_at_ms, batch.now_ms)
            for job in batch.jobs:
                self._start(job, shard, batch.now_ms)
            total += len(batch.jobs)
            unaware = unaware or bool(batch.unaware)
        if unaware:
            await self._refresh_limits()  # a queue became limited: claim it with permits
        return total

    # --- limited queues (limits.py) ----------------------------------------------------------
    @property
    def stopping(self) -> bool:
        """Claim loops stop: the worker is stopping, or a burst worker found nothing more."""
        return self._stopping.is_set() or self._claims_over

    def free_slots(self) -> int:
        return self.concurrency - len(self._running) - self._reserved

    def reserve(self, n: int) -> Callable[[], None]:
        """Hold ``n`` slots for a claim in flight; call the result when its jobs started."""
        self._reserved += n

        def done() -> None:
            self._reserved -= n

        return done

    def claimer_idle(self) -> None:
        """A limited queue's loop found nothing ready: a burst worker may be done."""
        if self.burst:
            self._wake.set()

    async def wait_for_slot(self) -> None:
        self._slot_free.clear()
        await self._first(self._slot_free.wait(), self._stopping.wait())

    async def sleep(self, seconds: float, event: asyncio.Event | None = None) -> bool:
        return await self._sleep(seconds, event)

    async def claim_limited(
        self, queue: str, plan: list[tuple[int, int]], permits: list[str]
    ) -> list[tuple[str, int]]:
        """Claim jobs of a limited queue: (shard, cap) calls, capped by the permits held; each
        job started takes the next permit. Returns (permit, claimed at ms) of those used."""
        calls: list[Call] = [
            self.scripts.claim_call(shard, self.id, cap, self.lease_ms, [(queue, cap)], self._types)
            for shard, cap in plan
        ]
        replies = await self.scripts.call_many(calls)
        self.stats.claim_round_trips += 1
        used: list[tuple[str, int]] = []
        for (shard, _), reply in zip(plan, replies, strict=True):
            batch = self.scripts.parse_claim(shard, reply)
            if batch.handed_back:
                self._handed_back(batch.handed_back)
            for job in batch.jobs:
                permit = permits[len(used)]
                self._start(job, shard, batch.now_ms, permit)
                used.append((permit, batch.now_ms))
        return used

    async def _refresh_limits(self) -> None:
        """Read which of our queues are limited (the catalogue jt:queues); start a claim loop
        for each new one, stop those of queues no longer limited."""
        raw = await self.queue.redis.hmget(self.keys.queue_limits(), self.queues)
        limited = {q for q, conf in zip(self.queues, raw, strict=True) if conf}
        for q in limited - self._claimers.keys():
            claimer = self._claimers[q] = LimitedClaimer(self, q)
            if hasattr(self, "_loop"):  # running: start its loop now
                self._claimer_tasks[q] = asyncio.create_task(claimer.run(), name=f"claim {q}")
            log.info("event=queue_limited worker=%s queue=%s", self.id, q)
        for q in set(self._claimers) - limited:
            del self._claimers[q]
            task = self._claimer_tasks.pop(q, None)
            if task is not None:
                task.cancel()
            self._ready = [UNKNOWN] * self.keys.shards  # the main loop claims it again
            self._wake.set()
            log.info("event=queue_unlimited worker=%s queue=%s", self.id, q)

    async def _stop_claimers(self) -> None:
        """End the limited queues' claim loops: they finish the claim in flight, if any, but
        not past the shutdown's deadline (a Redis that stopped answering)."""
        self._claims_over = True
        for claimer in self._claimers.values():
            claimer.wake.set()
        self._slot_free.set()
        tasks = list(self._claimer_tasks.values())
        if not tasks:
            return
        left = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
        _, pending = await asyncio.wait(tasks, timeout=left)
        for task in pending:
            log.warning(
                "event=claim_abandoned worker=%s: a limited queue's claim in flight", self.id
            )
            task.cancel()

    def _wake_at(self, at_ms: int, now_ms: int) -> None:
        """Look at every shard again at ``at_ms`` (Redis's clock), once per moment."""
        if self._unblock is not None and self._unblock_ms <= at_ms:
            return  # an earlier (or the same) look is already due
        if self._unblock is not None:
            self._unblock.cancel()
        self._unblock_ms = at_ms

        def look() -> None:
            self._unblock = None
            self._on_reset()

        self._unblock = self._loop.call_later(max((at_ms - now_ms) / 1000, 0.0), look)

    def _handed_back(self, ids: list[str]) -> None:
        """The claim script left jobs this worker cannot run in their queue (another pool
        serves the same queue, or a deploy is in progress): say so, loudly but not per job."""
        self.stats.handed_back += len(ids)
        log.warning(
            "event=jobs_handed_back worker=%s count=%d first=%s tasks=%s queues=%s: "
            "they stay queued for a worker that has their task",
            self.id, len(ids), ids[0], ",".join(self._types), ",".join(self.queues),
        )  # fmt: skip

    def _plan(self, free: int) -> list[tuple[int, int]]:
        """(shard, jobs to ask for) for one round of claims.

        Few shards per round, each asked for many jobs: a script call has a fixed cost in
        Redis (~30 µs for a claim, ~15 µs for the completion batch that follows it), several
        times what one job costs inside it, so 50 jobs from one or two shards cost Redis a
        third less than 3 or 4 from each of 16.

        Shards whose count is unknown (just woken, or never asked) come first: a wake means
        new jobs, perhaps urgent ones, and a deep queue elsewhere must not hold them back.
        Each is asked for ``PROBE_MIN`` jobs (not an even share: sixteen just-woken shards
        must not split a round into sixteen claims of three); shards known to hold ready
        jobs then fill what is left, greedily; slots still free go to the probes. Each round
        starts one shard further on, so every shard comes first at least once in ``shards``
        rounds.
        """
        shards = self.keys.shards
        start = self._start_shard
        self._start_shard = (start + 1) % shards
        unknown: list[int] = []
        known: list[int] = []
        for i in range(shards):
            shard = (start + i) % shards
            ready = self._ready[shard]
            if ready >= UNKNOWN:
                unknown.append(shard)
            elif ready > 0:
                known.append(shard)
        asks: dict[int, int] = {}
        left = free
        probes: list[int] = []
        for shard in unknown:
            if left <= 0:
                break
            asks[shard] = min(PROBE_MIN, left)
            left -= asks[shard]
            probes.append(shard)
        for shard in known:
            if left <= 0:
                break
            asks[shard] = min(self._ready[shard], left)
            left -= asks[shard]
        if left > 0 and probes:
            # slots that no known job can fill go to the probes, which may find more
            extra = -(-left // len(probes))
            for shard in probes:
                n = min(extra, left)
                asks[shard] += n
                left -= n
        return list(asks.items())

    def _start(self, job: ClaimedJob, shard: int, now_ms: int, permit: str | None = None) -> None:
        self.stats.claimed += 1
        waited = max(now_ms - job.queued_at_ms, 0) / 1000
        self.stats.claim_wait.observe(waited)
        ctx = JobContext(
            job, shard, self.id, self._loop, lambda data: self._on_progress(job.id, data),
            self._log_sink,
        )  # fmt: skip
        running = _Running(
            job, shard, self.registry.get(job.type), ctx, time.monotonic(), permit=permit
        )
        self._running[job.id] = running
        limit = self.settings.max_result_bytes
        if self._results is None:
            attempt = run_attempt(running.task, ctx, self._threads, limit, self)
        else:  # large results go to the result store before the success is reported
            attempt = run_attempt_storing(
                running.task, ctx, self._threads, limit, self, self._results,
                self.settings.result_store_threshold_bytes,
            )  # fmt: skip
        running.handle = asyncio.create_task(attempt, name=f"job {job.id}")
        if self._early_cancels and self._early_cancels.pop(job.id, False) is None:
            log.info("event=cancel_requested worker=%s job=%s via=push", self.id, job.id)
            # once the attempt has started: a task cancelled before its first step never
            # runs run_attempt, which then never reports, and the job would stay running
            self._loop.call_soon(deliver_cancel, ctx, running.task, running.handle)

    # --- running ----------------------------------------------------------------------------
    def attempt_ended(self, ctx: JobContext, end: bytes | Failure | Stopped) -> None:
        """Called by ``run_attempt`` as each job's attempt ends: report it, free the slot."""
        r = self._running.pop(ctx.job.id, None)
        if r is None:  # released at shutdown (_release_all): its stop is reported already
            return
        try:
            if isinstance(end, bytes):
                self._report("complete", r, (end,))
            elif isinstance(end, Failure):
                self._fail(r, end)
            elif end is STOPPED or not r.lost:
                # STOPPED: the task gave up for a cancel request; INTERRUPTED: a cancel
                # request, or a shutdown (release); a lost lease has nothing to report
                self._report("stopped", r, ())
        finally:
            self.stats.run_time.observe(time.monotonic() - r.started)
            if r.permit is not None:  # no outcome sent (a lost lease): give it back now
                self._to_release[r.job.queue].append(r.permit)
                self._outbox_ready.set()
            self._slot_free.set()

    def _fail(self, r: _Running, failure: Failure) -> None:
        if isinstance(failure.exc, RateLimited):
            self._rate_limited(r, failure, failure.exc)
            return
        delay_ms = failure.delay_ms(r.task.retry if r.task else DEFAULT_POLICY, r.job.attempt)
        # one record per failed attempt, with the traceback of what the task raised
        log.info(
            "event=job_failed job=%s type=%s attempt=%d/%d error=%s message=%r retry_in_ms=%d",
            r.job.id, r.job.type, r.job.attempt, r.job.max_attempts, failure.type,
            failure.message[:200], delay_ms,
            exc_info=failure.exc if failure.raised else None,
        )  # fmt: skip
        self._report("fail", r, (failure.error_json(), delay_ms))

    def _rate_limited(self, r: _Running, failure: Failure, exc: RateLimited) -> None:
        """The task says the downstream wants us to wait: the job runs again then, without
        using an attempt, and its queue starts nothing meanwhile, on every worker."""
        delay_ms = round(exc.retry_after * 1000)
        error = failure.error_json()
        log.info(
            "event=queue_rate_limited job=%s type=%s queue=%s retry_in_ms=%d",
            r.job.id, r.job.type, r.job.queue, delay_ms,
        )  # fmt: skip
        self._report("fail", r, (error, delay_ms, 1))
        self.stats.rate_limited += 1
        task = asyncio.create_task(self._block(r.job.queue, exc.retry_after))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _block(self, queue: str, seconds: float) -> None:
        try:
            await self.queue.block(queue, seconds)
            if queue in self._claimers:  # its permits wait too (limit.lua)
                await self.scripts.call(
                    self.scripts["limit"], self.keys.home(queue),
                    ("block", queue, round(seconds * 1000)),
                )  # fmt: skip
        except (RedisError, OSError) as exc:
            log.warning("event=queue_block_failed queue=%s error=%r", queue, exc)

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

    # --- reporting --------------------------------------------------------------------------
    def _report(self, kind: str, r: _Running, extra: tuple[Any, ...]) -> None:
        if r.released:
            # released at shutdown: the job is back in its queue under a newer version, and
            # this outcome's fencing token is stale (Redis would refuse it): drop it here
            if kind != "stopped":  # "stopped" is only the task's cancellation, which we caused
                log.info(
                    "event=late_outcome_dropped worker=%s job=%s report=%s: the job was "
                    "released at shutdown",
                    self.id, r.job.id, kind,
                )  # fmt: skip
            return
        # (_log is None unless the task ever logged: nothing to look at for most jobs)
        lines = r.ctx._take_logs() if r.ctx._log is not None else None
        if lines:
            # the last lines go ahead of the outcome, and expire with the job as it ends
            s = self.settings
            ttl = s.dead_retention_seconds if kind == "fail" else s.retention_seconds
            self._outbox["logs"][r.shard].append((r.job.id, ttl, lines))
        if r.progress is not None:
            # progress the heartbeat has not taken yet (reported just before the end) goes
            # ahead of the outcome in the same pipeline, one connection, so Redis applies
            # it first; sent later, it would find the job finished and be refused
            self._outbox["progress"][r.shard].append((r.job.id, r.job.lease_version, r.progress))
            r.progress = None
        self._outbox[kind][r.shard].append((r.job.id, r.job.lease_version, *extra))
        if r.permit is not None:
            # returned once the outcome is in Redis: before, a new job of the queue could
            # start while Redis still counts this one as running (over the limit)
            self._pending_permits[r.job.queue].append(r.permit)
            r.permit = None
        self._outbox_idle.clear()
        self._outbox_ready.set()

    async def _report_loop(self) -> None:
        while True:
            await self._outbox_ready.wait()
            self._outbox_ready.clear()
            await self._send_outbox()

    async def _send_outbox(self) -> None:
        """Send everything in the outbox in one pipeline; keep it on a Redis error."""
        backoff = REPORT.start()
        while True:
            # a heartbeat in flight may carry the last progress of a job reported here:
            # the outcome must reach Redis after it
            await self._beat_idle.wait()
            batches = {kind: dict(by_shard) for kind, by_shard in self._outbox.items() if by_shard}
            if not batches:
                if self._to_release and not await self._release_permits():
                    await asyncio.sleep(backoff.next())
                    continue
                self._outbox_idle.set()
                return
            for by_shard in self._outbox.values():
                by_shard.clear()
            permits = dict(self._pending_permits)
            self._pending_permits.clear()
            calls: list[Call] = []
            kinds: list[tuple[str, list[tuple[Any, ...]]]] = []
            s = self.settings
            for kind, by_shard in batches.items():
                for shard, items in by_shard.items():
                    if kind == "progress":
                        calls.append(
                            self.scripts.heartbeat_call(
                                shard, self.id, self.lease_ms, items, self.history_ms
                            )
                        )
                    elif kind == "logs":
                        calls.append(self.scripts.joblog_call(shard, LOG_LINES, items))
                    elif kind == "complete":
                        calls.append(
                            self.scripts.complete_call(shard, self.id, s.retention_seconds, items)
                        )
                    elif kind == "fail":
                        calls.append(
                            self.scripts.fail_call(shard, self.id, s.dead_retention_seconds, items)
                        )
                    else:
                        calls.append(
                            self.scripts.stopped_call(shard, self.id, s.retention_seconds, items)
                        )
                    kinds.append((kind, items))
            try:
                replies = await self.scripts.call_many(calls)
            except (RedisError, OSError) as exc:
                # nothing was lost: put the batch back and try again (a lease that expires
                # meanwhile makes the scheduler requeue the job; our late write is refused)
                for kind, by_shard in batches.items():
                    for shard, items in by_shard.items():
                        self._outbox[kind][shard][:0] = items
                for queue_name, ids in permits.items():
                    self._pending_permits[queue_name][:0] = ids
                wait = backoff.next()
                log.warning(
                    "event=report_failed worker=%s error=%r retry_in=%.2fs", self.id, exc, wait
                )
                await asyncio.sleep(wait)
                continue
            for (kind, items), reply in zip(kinds, replies, strict=True):
                self._account(kind, items, reply)
            for queue_name, ids in permits.items():
                self._to_release[queue_name] += ids

    async def _release_permits(self) -> bool:
        """Return the permits of finished jobs (limits.py); False if Redis refused (kept)."""
        by_queue = {q: ids for q, ids in self._to_release.items() if ids}
        self._to_release.clear()
        try:
            await self.scripts.call_many(
                limit_calls(self.scripts, self.keys, "release", by_queue, 0)
            )
        except (RedisError, OSError) as exc:
            for q, ids in by_queue.items():
                self._to_release[q] += ids
            log.warning("event=permit_release_failed worker=%s error=%r", self.id, exc)
            return False
        return True

    def _account(self, kind: str, items: list[tuple[Any, ...]], reply: list[Any]) -> None:
        if kind in ("progress", "logs"):
            return  # if refused, the outcome sent behind it is refused too, and counted
        st = self.stats
        if kind == "complete":  # a code per job; OK means succeeded
            codes, states = reply, [b"succeeded"] * len(reply)
        else:  # (code, state) per job
            codes, states = reply[0::2], reply[1::2]
        # codes stay ints on this path: a Code built per job only to be compared is waste
        for item, code, state in zip(items, codes, states, strict=True):
            if code != Code.OK:
                st.refused += 1
                log.warning(
                    "event=stale_write_refused worker=%s job=%s report=%s code=%s",
                    self.id, item[0], kind, Code(code).name,
                )  # fmt: skip
            elif state == b"succeeded":
                st.succeeded += 1
            elif state == b"scheduled":
                st.retried += 1
            elif state == b"failed":
                st.failed += 1
            elif state == b"cancelled":
                st.cancelled += 1
            elif state == b"queued":
                st.released += 1

    async def _flush_outbox(self) -> None:
        """Until every report is sent: 30 s at most, ``FLUSH_AFTER_STOP_NOW`` after a
        ``stop(now=True)`` (what is still unsent then is left to lease expiry)."""
        start = time.monotonic()
        while not self._outbox_idle.is_set() or any(self._outbox.values()):
            limit = FLUSH_AFTER_STOP_NOW if self._stop_now.is_set() else 30.0
            if time.monotonic() - start >= limit:
                log.warning(
                    "event=reports_unsent worker=%s: Redis did not take the last reports; "
                    "their jobs return to their queues when their leases expire", self.id,
                )  # fmt: skip
                return
            self._outbox_ready.set()
            await asyncio.sleep(0.005)

    # --- heartbeats -------------------------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        # Runs until cancelled, also while stopping: jobs finishing within the shutdown grace
        # still need their leases extended.
        interval = self.settings.lease_seconds / 3
        next_beat = time.monotonic() + interval
        while not self._heart_stop.is_set():
            timeout = next_beat - time.monotonic()
            if timeout > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout):
                        await self._progress.wait()
            if self._heart_stop.is_set():
                return
            full = time.monotonic() >= next_beat
            self._progress.clear()
            try:
                await self._beat(progress_only=not full)
                if full:
                    next_beat = time.monotonic() + interval
                    await self._advertise()
                    await self._refresh_limits()
            except (RedisError, OSError) as exc:
                log.warning("event=heartbeat_failed worker=%s error=%r", self.id, exc)
                if full:
                    next_beat = time.monotonic() + 1.0
            if not full:  # merge bursts of progress reports
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.progress_interval):
                        await self._heart_stop.wait()

    async def _beat(self, progress_only: bool) -> None:
        by_shard: dict[int, list[tuple[str, int, bytes]]] = defaultdict(list)
        lines_by_shard: dict[int, list[tuple[str, int, list[bytes]]]] = defaultdict(list)
        beating = []
        for r in list(self._running.values()):
            if r.logged:
                r.logged = False
                lines = r.ctx._take_logs()
                if lines:
                    lines_by_shard[r.shard].append((r.job.id, self._lines_ttl, lines))
            if progress_only and r.progress is None:
                continue
            by_shard[r.shard].append((r.job.id, r.job.lease_version, r.progress or b""))
            beating.append(r)
            r.progress = None
        if not by_shard and not lines_by_shard:
            return
        calls = [
            self.scripts.heartbeat_call(shard, self.id, self.lease_ms, items, self.history_ms)
            for shard, items in by_shard.items()
        ]
        permits: dict[str, list[str]] = defaultdict(list)
        if not progress_only:
            for r in beating:
                if r.permit is not None:
                    permits[r.job.queue].append(r.permit)
        beats = len(calls)
        calls += limit_calls(self.scripts, self.keys, "extend", permits, self.lease_ms)
        # log lines ride along; lost if this beat fails (they are a debugging aid, and the
        # lease, which matters, is retried at the next beat)
        calls += [
            self.scripts.joblog_call(shard, LOG_LINES, items)
            for shard, items in lines_by_shard.items()
        ]
        self._beat_idle.clear()
        try:
            replies = (await self.scripts.call_many(calls))[:beats]
        finally:
            self._beat_idle.set()
        index = {r.job.id: r for r in beating}
        for items, reply in zip(by_shard.values(), replies, strict=True):
            for (job_id, _, _), (code, cancel) in zip(
                items, self.scripts.parse_pairs(reply), strict=True
            ):
                r = index[job_id]
                if code is not Code.OK:
                    self.stats.leases_lost += 1
                    log.warning(
                        "event=lease_lost worker=%s job=%s code=%s: stopping it, its outcome will be dropped",
                        self.id, job_id, code.name,
                    )  # fmt: skip
                    r.lost = True
                    if r.handle is not None:
                        r.handle.cancel()
                elif cancel and not r.ctx.cancel_requested:
                    log.info(
                        "event=cancel_requested worker=%s job=%s via=heartbeat", self.id, job_id
                    )
                    deliver_cancel(r.ctx, r.task, r.handle)

    async def _advertise(self) -> None:
        info = encode_json(
            {
                "id": self.id,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "concurrency": self.concurrency,
                "running": len(self._running),
                "tasks": self.registry.names(),
                "queues": self.queues,
                "seen_at": time.time(),
            }
        )
        await self.queue.redis.hset(self.keys.workers(), self.id, info)
        # the tasks it runs, with their policies and payload schemas (catalog.py): what the
        # API checks and completes a submit with
        await publish_tasks(self.queue.redis, self.keys, [t.ad(self.id) for t in self.registry])

    # --- shutdown ---------------------------------------------------------------------------
    async def _drain(self) -> None:
        """After the claim loop: running jobs finish by the deadline, or are released."""
        while self._running and self._deadline is not None:
            left = self._deadline - time.monotonic()
            if left <= 0 or self._stop_now.is_set():
                break
            self._slot_free.clear()
            await self._first(self._slot_free.wait(), self._stop_now.wait(), timeout=left)
        if not self._running:
            return
        handles = [r.handle for r in self._running.values() if r.handle is not None]
        self._release_all("stop_now" if self._stop_now.is_set() else "grace_over")
        # the cancelled tasks run their cleanup (finally blocks) while the releases are sent;
        # one that ignores its cancellation is left behind and counted in stuck (as are the
        # threads of sync tasks, whose awaiting end this cancel does stop)
        if handles:
            _, pending = await asyncio.wait(handles, timeout=FINISH_AFTER_CANCEL)
            self.stuck = len(pending)

    def _release_all(self, reason: str) -> None:
        """Give every running job back to its queue (the ``stopped`` script: queued again at
        the front, attempt not counted) and stop its task."""
        log.info(
            "event=worker_releasing worker=%s jobs=%d reason=%s",
            self.id, len(self._running), reason,
        )  # fmt: skip
        for r in list(self._running.values()):
            self._report("stopped", r, ())
            r.released = True
            del self._running[r.job.id]  # no more heartbeats for it
            log.info("event=job_released worker=%s job=%s type=%s", self.id, r.job.id, r.job.type)
            # a sync task sees the request at its next ctx.check_cancelled(), if it makes one:
            # its thread cannot be interrupted
            r.ctx._request_cancel()
            if r.handle is not None:
                r.handle.cancel()

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
