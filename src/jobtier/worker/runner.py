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

Each loop has its own module, a layer of the one ``Worker`` class (state.py says how the
layers share their state): claiming.py, reporting.py and heartbeat.py. This module is the
worker's life: start-up (``run``), the wake channel's listener (``_on_wake``), ``stop()``,
and the drain and releases at shutdown.

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
import time

from redis.exceptions import RedisError

from jobtier.metrics.snapshot import Snapshot, labels
from jobtier.persist.results import open_store
from jobtier.runtime.stopping import stop_task
from jobtier.store.redis import ShardSubscriber
from jobtier.worker.heartbeat import Heartbeat
from jobtier.worker.state import UNKNOWN, WorkerStats

__all__ = ["Worker", "WorkerStats"]

log = logging.getLogger("jobtier.worker")

FINISH_AFTER_CANCEL = 1.0  # s a cancelled task gets to run its cleanup before we move on


class Worker(Heartbeat):
    """Runs the tasks of ``registry`` for jobs claimed from ``queue``'s shards.

    ``burst=True`` drains the ready queues and returns (tests, one-off runs).
    ``stop()`` (SIGTERM) stops claiming, lets running jobs finish until ``shutdown_grace``
    seconds after it was called, then releases the rest back to their queues;
    ``stop(now=True)`` releases them at once.
    """

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
            self._slot_free.set()  # a claim loop waiting for a slot stops now (claiming.py)
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
            # its Redis writes can swallow a cancel the same way (runtime/stopping.py): cancelled
            # until it ends, left behind after STOP_TIMEOUT
            await stop_task(reporter, "worker metrics reporter")
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
