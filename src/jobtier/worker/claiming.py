"""Claiming: the claim loop, its wake-ups, the limited queues' claim loops, starting attempts.

The claim loop asks the shards for as many jobs as there are free slots, in one pipelined
round trip (``_plan`` picks the shards), and sleeps on the shards' wake channels when every
queue it saw was empty: no polling, so an idle worker costs nothing, yet a new job reaches it
in one publish (``idle_poll`` is only the safety net). A limited queue (global concurrency or
rate) is claimed by its own loop (limits.py), which shares the slots through ``reserve``.

Races guarded here:

- a wake that arrives while a claim is in flight is newer than that claim's answer: each
  shard's ``_generation`` is bumped by every wake, and a reply only sets the shard's count of
  ready jobs if no wake came since it was asked;
- a (re)subscription may have missed wakes: ``_on_reset`` marks every shard unknown;
- slots promised to claims in flight are reserved, so the main loop and the limited queues'
  loops never start more jobs than ``concurrency`` between them;
- a claim still in flight at the shutdown's deadline is abandoned: a Redis that stopped
  answering must not hold the shutdown past its bound;
- a cancel push can overtake its job's claim reply (it travels on the subscriber's
  connection): ``_start`` delivers such an early cancel once the attempt has started.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from jobtier.core.model import ClaimedJob
from jobtier.runtime.backoff import CLAIM
from jobtier.runtime.stopping import stop_task
from jobtier.store.calls import Call, claim_call, parse_claim
from jobtier.worker.attempt import deliver_cancel, run_attempt
from jobtier.worker.context import JobContext
from jobtier.worker.permits import LimitedClaimer
from jobtier.worker.reporting import Reporting
from jobtier.worker.state import UNKNOWN, _Running
from jobtier.worker.stored import run_attempt_storing

log = logging.getLogger("jobtier.worker")

PROBE_MIN = 16  # fewest jobs asked of a shard whose count is unknown (see _plan)


class Claiming(Reporting):
    """The worker's claiming (see the module docstring); what ``LimitedClaimer`` calls."""

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
            # a claim in flight is a Redis call, which can swallow the cancel (runtime/stopping.py)
            await stop_task(claims, "claim loop")
        else:
            claims.result()  # a crash of the loop surfaces here

    async def _claim_loop(self) -> None:
        backoff = CLAIM.start()
        while not self._stopping.is_set():
            free = self.free_slots()
            if free <= 0:
                # every slot busy: wake for a free slot or for a stop, which must not wait
                # for a job to end (it would wait a whole job, past the grace): stop() sets
                # _slot_free too. Waited on directly, so that the loop wakes in the turn the
                # slot frees, ahead of the reporter (reporting.py: _send_outbox)
                self._slot_free.clear()
                await self._slot_free.wait()
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
            claim_call(shard, self.id, n, self.lease_ms, queues, self._types) for shard, n in plan
        ]
        replies = await self.scripts.call_many(calls)
        self.stats.claim_round_trips += 1
        total = 0
        unaware = False
        for (shard, _), gen, reply in zip(plan, generations, replies, strict=True):
            batch = parse_claim(shard, reply)
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
        await self._slot_free.wait()  # a stop sets it too (stop(), _stop_claimers)

    async def sleep(self, seconds: float, event: asyncio.Event | None = None) -> bool:
        return await self._sleep(seconds, event)

    async def claim_limited(
        self, queue: str, plan: list[tuple[int, int]], permits: list[str]
    ) -> list[tuple[str, int]]:
        """Claim jobs of a limited queue: (shard, cap) calls, capped by the permits held; each
        job started takes the next permit. Returns (permit, claimed at ms) of those used."""
        calls: list[Call] = [
            claim_call(shard, self.id, cap, self.lease_ms, [(queue, cap)], self._types)
            for shard, cap in plan
        ]
        replies = await self.scripts.call_many(calls)
        self.stats.claim_round_trips += 1
        used: list[tuple[str, int]] = []
        for (shard, _), reply in zip(plan, replies, strict=True):
            batch = parse_claim(shard, reply)
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
            self._log_sink, self.queue.jobs.stored_result,
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
