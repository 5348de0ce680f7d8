"""The worker: claims jobs in batches, runs them with bounded concurrency, reports in batches.

``Worker`` wires its parts, a module each, over one ``WorkerState`` (state.py): the
``Claimer`` (claimer.py; limited queues: ``LimitedQueues``, permits.py) starts the jobs it
claims through the ``Launcher`` (launcher.py), whose attempts end into the ``Reporter``
(reporter.py); the ``Heartbeat`` (heartbeat.py) keeps the leases and hears cancel requests.
This module is the worker's life: start-up, the wake channel's listener, ``stop()``.

Every write carries the job's ``lease_version`` (fencing token from the claim): a refusal
means this worker lost the job (its lease expired and the job moved on); its result is
dropped, never applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

from jobtier.core.model import WORKER_BLOCKED_WARN_SECONDS, WORKER_CONCURRENCY
from jobtier.metrics.snapshot import Snapshot, labels
from jobtier.runtime.loop import FAULTS
from jobtier.runtime.stopping import stop_task, stop_tasks
from jobtier.store.context import Store
from jobtier.store.subscriber import ShardSubscriber
from jobtier.worker.claimer import Claimer
from jobtier.worker.heartbeat import Heartbeat
from jobtier.worker.launcher import Launcher
from jobtier.worker.loop_watch import LoopWatch
from jobtier.worker.permits import LimitedQueues
from jobtier.worker.procpool import Executor, ProcessOptions
from jobtier.worker.registry import TaskRegistry
from jobtier.worker.reporter import Reporter
from jobtier.worker.state import WorkerState, WorkerStats

__all__ = ["Worker", "WorkerStats"]

log = logging.getLogger("jobtier.worker")


class Worker:
    """Runs the tasks of ``registry`` for jobs claimed from ``store``'s shards.

    ``burst=True`` drains the ready queues and returns (tests, one-off runs). ``stats``:
    counters to add to (a burst run over several workers shares one).
    """

    def __init__(
        self,
        store: Store,
        registry: TaskRegistry,
        *,
        concurrency: int = WORKER_CONCURRENCY,
        burst: bool = False,
        name: str | None = None,
        shutdown_grace: float = 30.0,
        idle_poll: float = 5.0,
        threads: int | None = None,
        progress_interval: float = 0.2,
        queues: Sequence[str] | None = None,
        cancel_push: bool = True,
        stats: WorkerStats | None = None,
        executor: Executor = "thread",
        processes: ProcessOptions | None = None,
        blocked_warn: float = WORKER_BLOCKED_WARN_SECONDS,
    ) -> None:
        state = WorkerState(store, registry, concurrency, burst, name, idle_poll, queues, stats)
        self.state = state
        self.limits = LimitedQueues(state)
        self.limits.on_crash = self.stop  # a limited queue's loop crashed: the worker stops
        self.reporter = Reporter(state, self.limits)
        # executor "process": plain def tasks that name none run in child processes,
        # ``processes`` says how many and when they are replaced (procpool.py)
        self.launcher = Launcher(state, self.reporter, threads, executor, processes)
        self.claimer = Claimer(state, self.launcher, self.limits)
        self.heartbeat = Heartbeat(state, self.claimer, self.launcher, progress_interval)
        # a blocking call in an async def task, named when it holds the loop this long (0: off)
        self.loop_watch = LoopWatch(state, blocked_warn)
        self.id = state.id
        self.queues = state.queues  # served in turn
        self.shutdown_grace = shutdown_grace
        # act on cancel pushes (False: learn of requests at heartbeats only)
        self.cancel_push = cancel_push
        self.stuck = 0  # after run(): tasks and threads that did not end when asked (see stop)
        # set once run() has opened its stores and advertised its tasks: the API then knows
        # them (``jobtier run`` serves its API from then on)
        self.started = asyncio.Event()

    @property
    def stats(self) -> WorkerStats:
        return self.state.stats

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
            "",
            "",
            0.0,
            counters={
                "worker_jobs_started_total": {"": st.claimed},
                "worker_claim_round_trips_total": {"": st.claim_round_trips},
                "worker_outcomes_total": outcomes,
                "stale_writes_refused_total": {"": st.refused},
                "leases_lost_total": {"": st.leases_lost},
                "worker_handed_back_total": {"": st.handed_back},
                "worker_rate_limited_total": {"": st.rate_limited},
                "worker_checkpoints_total": {"": st.checkpoints},
                "worker_loop_blocked_total": {"": st.loop_blocked},
                "worker_breaker_holds_total": {
                    labels(breaker=b): n for b, n in self.launcher.breakers.holds.items()
                },
                "queue_limit_wait_seconds_total": {
                    labels(queue=q): c.stats.waited for q, c in self.limits.claimers.items()
                },
                **self._process_counters(),
            },
            gauges={
                "worker_running_jobs": {"": len(self.state.running)},
                "worker_concurrency": {"": self.state.concurrency},
            },
            histograms={
                "claim_wait_seconds": {"": st.claim_wait.snapshot()},
                "run_time_seconds": {"": st.run_time.snapshot()},
            },
        )

    def _process_counters(self) -> dict[str, dict[str, float]]:
        """The process pool's children started, recycled, ended and died (procpool.py)."""
        pool = self.launcher.processes
        if pool is None:
            return {}
        return {"worker_processes_total": {labels(event=k): v for k, v in pool.stats.items()}}

    @property
    def idle(self) -> bool:
        """True while the worker waits for a wake: every queue it knows of was empty (jobs
        it already runs may still be running)."""
        return self.claimer.idle

    def stop(self, *, now: bool = False) -> None:
        """Stop claiming. Jobs running get until ``shutdown_grace`` seconds after the first
        call to finish (a wall-clock bound, however busy the slots), then are cancelled and
        released to their queues. ``now=True``: release them at once (a second signal)."""
        at = time.monotonic()
        state = self.state
        if not state.stopping.is_set():
            state.deadline = at + self.shutdown_grace
            state.stopping.set()
            self.claimer.stop()
            state.slot_free.set()  # a claim loop waiting for a slot stops now (claimer.py)
            log.info(
                "event=worker_draining worker=%s running=%d grace=%gs",
                self.id,
                len(state.running),
                self.shutdown_grace,
            )
        if now and not state.stop_now.is_set():
            state.deadline = at
            state.stop_now.set()
            log.warning(
                "event=worker_stop_now worker=%s running=%d: releasing running jobs now",
                self.id,
                len(state.running),
            )

    async def run(self) -> WorkerStats:
        state = self.state
        subscriber = ShardSubscriber(
            state.redis,
            [state.keys.wake(s) for s in range(state.keys.shards)],
            self._on_wake,
            self.claimer.on_reset,
            name=f"worker-wake {self.id}",
        )
        await subscriber.start()
        try:
            await self.launcher.open()  # the result stores
            await self.heartbeat.advertise()
            await self.claimer.refresh_limits()
        except BaseException:  # not started: nothing of it outlives the failure
            await subscriber.stop()
            self.stuck += await self.launcher.close()
            raise
        reporter = asyncio.create_task(self.reporter.run(), name="jobtier-reporter")
        heart = asyncio.create_task(self.heartbeat.run(), name="jobtier-heartbeat")
        heart.add_done_callback(self._heart_ended)
        self.loop_watch.start()
        self.started.set()
        log.info(
            "event=worker_started worker=%s concurrency=%d queues=%s tasks=%s burst=%s",
            self.id,
            state.concurrency,
            ",".join(state.queues),
            ",".join(state.types),
            state.burst,
        )
        try:
            await self.claimer.run()
            self.stuck = await self.launcher.drain()
        except BaseException:  # cancelled, or a loop crashed: nothing of the worker goes on
            self.stop(now=True)
            raise
        finally:
            if state.running:  # the claim loop crashed: give back what we hold
                self.launcher.release_all("worker_failed")
            # stopped by a flag, not cancelled: a cancellation landing inside the Redis client
            # during a beat can be swallowed there, and run() would wait for it forever
            self.heartbeat.stop()
            self.loop_watch.stop()
            done, _ = await asyncio.wait({heart}, timeout=1.0 if state.stop_now.is_set() else 10.0)
            crash = None if not done or heart.cancelled() else heart.exception()
            if not done:  # stuck in a Redis call: cancelled, and waited for (within a bound)
                await stop_tasks([heart], "worker heartbeat", timeout=1.0)
            await self.reporter.flush()
            # its Redis writes can swallow a cancel the same way (runtime/stopping.py): cancelled
            # until it ends, left behind after STOP_TIMEOUT
            await stop_task(reporter, "worker metrics reporter")
            await subscriber.stop()
            with contextlib.suppress(*FAULTS):
                await state.redis.hdel(state.keys.workers(), self.id)
            self.stuck += await self.launcher.close()
            st = self.stats
            log.info(
                "event=worker_stopped worker=%s succeeded=%d failed=%d retried=%d released=%d "
                "stuck=%d",
                self.id,
                st.succeeded,
                st.failed,
                st.retried,
                st.released,
                self.stuck,
            )
        if crash is None:
            crash = self.limits.crash
        if crash is not None:
            raise crash  # a defect of ours in a loop, once the rest has stopped
        return self.stats

    def _heart_ended(self, heart: asyncio.Task[None]) -> None:
        """The heartbeat ended; if by a crash (a defect of ours, not Redis away: those it
        rides out), the worker cannot keep its leases: it stops now, its jobs released to
        their queues rather than left to run on leases that will expire, and ``run`` raises
        the crash once the rest has stopped."""
        if heart.cancelled() or heart.exception() is None or self.state.stop_now.is_set():
            return
        log.error(
            "event=heartbeat_crashed worker=%s error=%r: it cannot keep its jobs' leases; "
            "stopping now",
            self.id,
            heart.exception(),
        )
        self.stop(now=True)

    def _on_wake(self, channel: bytes, data: bytes) -> None:
        # "x <job id> <worker id>": a cancel was requested for a job that worker runs; the
        # rest is the claimer's
        if data[:2] == b"x ":
            if self.cancel_push:
                self.heartbeat.on_cancel_push(data)
            return
        self.claimer.on_wake(channel, data)
