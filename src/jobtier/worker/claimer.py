"""Claiming: the claim loop, its wake-ups, and the limited queues' claim loops.

The claim loop asks the shards for as many jobs as there are free slots, in one pipelined
round trip (``_plan`` picks the shards), and sleeps on the shards' wake channels when every
queue it saw was empty: no polling, so an idle worker costs nothing, yet a new job reaches it
in one publish (``idle_poll`` is only the safety net). A limited queue (global concurrency or
rate) is claimed by its own loop (permits.py), which shares the slots through ``reserve``.

Races guarded here:

- a wake that arrives while a claim is in flight is newer than that claim's answer: each
  shard's ``_generation`` is bumped by every wake, and a reply only sets the shard's count of
  ready jobs if no wake came since it was asked;
- a (re)subscription may have missed wakes: ``on_reset`` marks every shard unknown;
- slots promised to claims in flight are reserved, so the main loop and the limited queues'
  loops never start more jobs than ``concurrency`` between them;
- a claim still in flight at the shutdown's deadline is abandoned: a Redis that stopped
  answering must not hold the shutdown past its bound;
- a claim whose reply was lost (the connection died: a failover) may have leased jobs: the
  next round sends the same calls again, with their claim tokens, and claim.lua answers a
  token it served with the jobs it leased then (store/calls.py claim_call), so they come to
  this worker rather than waiting out their lease, an attempt lost. Claims are sent once by
  the client library (``sent_once``): were it to send them again itself, an error reply to
  its second send (READONLY, from a master demoted meanwhile) would hide that the first may
  have run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from jobtier.runtime.backoff import CLAIM
from jobtier.runtime.loop import FAULTS, wait_any, wait_for
from jobtier.runtime.stopping import stop_task
from jobtier.store.calls import Call, claim_call, may_have_run, parse_claim
from jobtier.store.handback import hand_back
from jobtier.store.redis import sent_once
from jobtier.worker.launcher import Launcher
from jobtier.worker.permits import CUT_TIMEOUT, LimitedQueues, LostClaim
from jobtier.worker.state import WorkerState

log = logging.getLogger("jobtier.worker")

UNKNOWN = 1 << 30  # a shard whose queue length we don't know: worth asking
PROBE_MIN = 16  # fewest jobs asked of a shard whose count is unknown (see _plan)


@dataclass(frozen=True, slots=True)
class _Unanswered:
    """A claim whose reply was lost: the jobs it asked, the call, and until when (monotonic)
    it is sent again."""

    count: int
    call: Call
    until: float


class Claimer:
    """A worker's claim loops (see the module docstring); the ``Claims`` of its limited
    queues' loops."""

    def __init__(self, state: WorkerState, launcher: Launcher, limits: LimitedQueues) -> None:
        self.state = state
        self.id = state.id
        self.limits = limits
        self._start = launcher.start
        self._reporter = launcher.reporter
        self._scripts = state.scripts
        self._shards = state.keys.shards
        self._limited = limits.claimers
        self.wake = asyncio.Event()  # a shard has new jobs (or a stop)
        self.idle = False  # waiting for a wake: every queue it knows of was empty
        self._ready = [UNKNOWN] * self._shards  # known ready jobs per shard
        self._generation = [0] * self._shards  # bumped by each wake of the shard
        self._start_shard = 0  # where the next round of claims begins (see _plan)
        self._queue_turn = 0
        self._unblock: asyncio.TimerHandle | None = None  # a look when a queue's block ends
        self._unblock_ms = 0
        # shard -> the claim whose reply never came (see the module docstring): the next
        # rounds send it again
        self._unanswered: dict[int, _Unanswered] = {}
        # claims in flight when their loop was cancelled (see _give_back_cut)
        self._cut: list[Call] = []
        launcher.breakers.on_lift = self.on_reset  # held types come back: claim them

    def on_wake(self, channel: bytes, data: bytes) -> None:
        """``q <queue>``: a queue of the shard had no ready job and now has some;
        ``l <queue>``: a permit of a limited queue came free."""
        if data[2:] not in self.state.served:
            return
        claimer = self._limited.get(data[2:].decode())
        if claimer is not None:
            claimer.wake.set()
            return
        if data[:2] == b"q ":
            shard = int(channel[channel.index(b"{") + 1 : channel.index(b"}")])
            self._ready[shard] = UNKNOWN
            self._generation[shard] += 1
            self.wake.set()

    def on_reset(self) -> None:
        # (re)subscribed: wakes may have been missed while the connection was down
        self._ready = [UNKNOWN] * self._shards
        self._generation = [g + 1 for g in self._generation]
        self._wake_all()

    def stop(self) -> None:
        """Claim loops end (after their claim in flight, if any)."""
        self.wake.set()
        self.limits.end()

    def _wake_all(self) -> None:
        self.wake.set()
        self.limits.wake()

    # --- claiming ---------------------------------------------------------------------------
    async def run(self) -> None:
        """The claim loop until the worker stops (or a burst worker runs out of jobs), given up
        at the deadline if a claim is still in flight then (a Redis that stopped answering
        must not hold the shutdown past its bound); then the limited queues' loops end."""
        state = self.state
        claims = asyncio.create_task(self._claim_loop(), name="jobtier-claims")
        stopping = asyncio.ensure_future(state.stopping.wait())
        now = asyncio.ensure_future(state.stop_now.wait())
        cut_short = True  # run() cancelled (or a crash): the limited loops get CUT_TIMEOUT
        try:
            try:
                await asyncio.wait({claims, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if not claims.done():  # stopping: the loop ends after the claim in flight
                    left = max(0.0, (state.deadline or 0.0) - time.monotonic())
                    await asyncio.wait(
                        {claims, now}, timeout=left, return_when=asyncio.FIRST_COMPLETED
                    )
            finally:
                stopping.cancel()
                now.cancel()
            if not claims.done():
                log.warning("event=claim_abandoned worker=%s: a claim was still in flight", self.id)
                # a claim in flight is a Redis call, which can swallow the cancel
                # (runtime/stopping.py)
                await stop_task(claims, "claim loop")
            else:
                claims.result()  # a crash of the loop surfaces here
            cut_short = False
        finally:
            if not claims.done():  # run() itself was cancelled: its loop goes with it
                await stop_task(claims, "claim loop", timeout=CUT_TIMEOUT)
            await self.limits.stop(CUT_TIMEOUT if cut_short else None)
            await self._give_back_cut()

    async def _claim_loop(self) -> None:
        state = self.state
        slot_free = state.slot_free
        backoff = CLAIM.start()
        # a burst worker with nothing running and nothing found asks every shard (and its
        # limited queues' loops) once more before it ends, its outcomes all sent first: a job
        # its last jobs' ends made ready (its concurrency key admitted it) is in a shard it
        # last found empty, and the wake saying so may come after
        swept = False
        while not state.stopping.is_set():
            free = state.free_slots()
            if free <= 0:
                # every slot busy: wake for a free slot or for a stop, which must not wait
                # for a job to end (it would wait a whole job, past the grace): stop() sets
                # slot_free too. Waited on directly, so that the loop wakes in the turn the
                # slot frees, ahead of the reporter (reporter.py: _send)
                swept = False
                slot_free.clear()
                await slot_free.wait()
                continue
            self.wake.clear()
            reserved = state.reserve(free)
            failed: BaseException | None = None
            try:
                claimed = await self._claim(free)
            except FAULTS as exc:
                failed = exc
            finally:
                reserved()
            if failed is not None:
                # through the back-off, only the slots of the claims to send again stay held
                # (they may have leased jobs for them); a limited queue's loop takes the rest
                held = state.reserve(min(free, sum(u.count for u in self._unanswered.values())))
                try:
                    await state.claim_failed(backoff, failed)
                finally:
                    held()
                continue
            backoff.reset()
            if claimed or any(self._ready):
                if claimed:
                    swept = False  # what these jobs' ends admit needs a last round after them
                continue  # more to claim, or shards this round did not ask
            if state.burst:
                if not state.running and self.limits.idle():
                    if swept:
                        return
                    await self._reporter.flush()
                    swept = True
                    self._ready = [UNKNOWN] * self._shards
                    self.limits.wake()
                    continue
                swept = False  # a job runs: what its end admits needs a sweep after it
                slot_free.clear()
                await wait_any((slot_free, self.wake))  # a stop sets both
                continue
            # every queue we know of is empty: sleep until a wake (a stop sets it too), or
            # the safety net
            self.idle = True
            try:
                woke = await wait_for(self.wake, state.idle_poll)
            finally:
                self.idle = False
            if not woke:
                self._ready = [UNKNOWN] * self._shards

    async def _claim(self, free: int) -> int:
        """One pipelined round of claims over the shards believed to hold ready jobs, and
        the claims whose replies were lost sent again (``_resend``)."""
        kept = self._resend(free)
        asked = sum(u.count for u in kept.values())
        plan: list[tuple[int, int]] = []
        calls: list[Call] = []
        if free > asked:
            for (shard, n), call in zip(*self._new_round(free - asked), strict=True):
                if shard not in kept:  # asked again as it was, below
                    plan.append((shard, n))
                    calls.append(call)
        for shard, u in kept.items():
            plan.append((shard, u.count))
            calls.append(u.call)
        if not plan:
            return 0
        state = self.state
        generations = [self._generation[shard] for shard, _ in plan]
        try:
            # each shard's reply on its own: a cluster node that is down (a master failing
            # over) fails its shards' claims, the jobs claimed on the others start at once
            with sent_once():
                replies = await self._scripts.call_many_each(calls)
        except FAULTS as exc:
            replies = [exc] * len(calls)
        except asyncio.CancelledError:
            self._cut.extend(calls)
            raise
        # a failed claim may have run, its reply lost with the connection: sent again as it
        # was (its token) at the next round
        until = time.monotonic() + state.lease_ms / 2000
        for (shard, n), call, reply in zip(plan, calls, replies, strict=True):
            if isinstance(reply, FAULTS):
                first = kept.get(shard)
                if first is not None:
                    self._unanswered[shard] = first
                elif may_have_run(reply):
                    self._unanswered[shard] = _Unanswered(n, call, until)
        state.stats.claim_round_trips += 1
        failed = [reply for reply in replies if isinstance(reply, Exception)]
        if len(failed) == len(replies):
            raise failed[0]
        total = 0
        unaware = False
        for (shard, _), gen, reply in zip(plan, generations, replies, strict=True):
            if isinstance(reply, Exception):
                self._ready[shard] = UNKNOWN  # asked again at the next round
                continue
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
            await self.refresh_limits()  # a queue became limited: claim it with permits
        return total

    def _resend(self, free: int) -> dict[int, _Unanswered]:
        """The claims whose replies were lost, to send again as they were (their tokens), for
        half a lease at most: the jobs such a claim leased can still start under their lease,
        and the slots kept for them meanwhile do not stay idle long (a node down for longer).
        None of them if they asked for more jobs than the slots now free (a limited queue's
        loop took some): a call that did not run would lease more than there is room for."""
        unanswered, self._unanswered = self._unanswered, {}
        now = time.monotonic()
        kept = {shard: u for shard, u in unanswered.items() if u.until > now}
        if sum(u.count for u in kept.values()) > free:
            kept = {}
        dropped = [shard for shard in unanswered if shard not in kept]
        if dropped:
            log.warning(
                "event=claim_not_resent worker=%s shards=%s: its reply was lost too long ago, "
                "or fewer slots are free than it asked; jobs it leased, if any, return when "
                "their lease expires",
                self.id,
                ",".join(map(str, dropped)),
            )
        return kept

    def _new_round(self, free: int) -> tuple[list[tuple[int, int]], list[Call]]:
        """(plan, calls) of a round of claims over the shards believed to hold ready jobs;
        empty when there is nothing to ask."""
        plan = self._plan(free)
        if not plan:
            return [], []
        state = self.state
        served = state.queues
        turn = self._queue_turn
        self._queue_turn = (turn + 1) % len(served)
        queues = [(q, -1) for q in served[turn:] + served[:turn] if q not in self._limited]
        if not queues:
            self._ready = [0] * self._shards  # every queue is limited: their loops claim
            return [], []
        retention = state.settings.retention_seconds
        calls: list[Call] = [
            claim_call(shard, self.id, n, state.lease_ms, queues, state.types, None, retention)
            for shard, n in plan
        ]
        return plan, calls

    async def _give_back_cut(self) -> None:
        """A claim cancelled in flight (the worker's ``run`` cancelled, or its claim abandoned
        at the shutdown's deadline) may have run in Redis, its reply lost: the jobs it leased
        are this worker's, which will never start them, and would wait out their lease (30 s
        by default) as ``running``. Its token answers them (store/handback.py): they go back
        to the front of their queues now, their attempt not counted; within ``CUT_TIMEOUT``
        (a Redis that stopped answering leaves them to their lease, as before)."""
        cut, self._cut = self._cut, []
        if not cut:
            return
        retention = self.state.settings.retention_seconds
        leased = released = 0
        try:
            async with asyncio.timeout(CUT_TIMEOUT):
                for call in cut:
                    n, freed = await hand_back(self._scripts, call, self.id, retention)
                    leased, released = leased + n, released + freed
        except FAULTS as exc:  # (the bound's TimeoutError among them: an OSError)
            log.warning(
                "event=claim_hand_back_failed worker=%s claims=%d error=%r: the jobs a claim cut "
                "by the stop leased, if any, return when their lease expires",
                self.id,
                len(cut),
                exc,
            )
            return
        if leased:
            self.state.stats.released += released
            log.info(
                "event=claim_given_back worker=%s jobs=%d released=%d: the jobs of a claim cut "
                "by the stop are back in their queues",
                self.id,
                leased,
                released,
            )

    # --- limited queues (permits.py) --------------------------------------------------------
    def claimer_idle(self) -> None:
        """A limited queue's loop found nothing ready: a burst worker may be done."""
        if self.state.burst:
            self.wake.set()

    async def claim_limited(
        self,
        queue: str,
        plan: list[tuple[int, int]],
        permits: list[str],
        again: Sequence[LostClaim] = (),
    ) -> tuple[list[tuple[str, int]], list[LostClaim]]:
        """Claim jobs of a limited queue: (shard, cap) calls, capped by the permits held, and
        the claims ``again`` sent again as they were; each job started takes the next permit.
        Returns (permit, claimed at ms) of those used, and the claims that failed."""
        state = self.state
        until = time.monotonic() + state.lease_ms / 2000
        claims = [
            LostClaim(
                shard,
                cap,
                claim_call(
                    shard,
                    self.id,
                    cap,
                    state.lease_ms,
                    [(queue, cap)],
                    state.types,
                    None,
                    state.settings.retention_seconds,
                ),
                until,
            )
            for shard, cap in plan
        ]
        claims += again
        unanswered = list(claims)  # those whose jobs have not started here
        try:
            return await self._claim_limited(claims, len(plan), permits, unanswered)
        except asyncio.CancelledError:
            # cut by the stop: what those sends leased is given back (_give_back_cut)
            self._cut.extend(claim.call for claim in unanswered)
            raise

    async def _claim_limited(
        self,
        claims: list[LostClaim],
        planned: int,
        permits: list[str],
        unanswered: list[LostClaim],
    ) -> tuple[list[tuple[str, int]], list[LostClaim]]:
        state = self.state
        # each shard's reply on its own, as in the main loop: a node that is down fails its
        # shards' claims, the jobs the others leased start
        try:
            calls = [claim.call for claim in claims]
            with sent_once():
                replies = await self._scripts.call_many_each(calls)
        except FAULTS as exc:
            replies = [exc] * len(claims)
        state.stats.claim_round_trips += 1
        used: list[tuple[str, int]] = []
        lost: list[LostClaim] = []
        for i, (claim, reply) in enumerate(zip(claims, replies, strict=True)):
            if isinstance(reply, Exception):
                claim.failed(reply)
            if i < planned and claim.ran:
                # its reply may be lost with the connection: sent again as it was (its
                # token), with the client's own retries, it answers the jobs it leased; if it
                # fails again, the loop sends it again at its next rounds (permits.py), once
                # its node answers
                try:
                    reply = await self._scripts.call(*claim.call)
                except FAULTS as exc:
                    claim.failed(exc)
                    reply = exc
            if isinstance(reply, Exception):
                lost.append(claim)
                continue
            batch = parse_claim(claim.shard, reply)
            unanswered.remove(claim)
            if batch.handed_back:
                self._handed_back(batch.handed_back)
            for job in batch.jobs:
                permit = permits[len(used)]
                self._start(job, claim.shard, batch.now_ms, permit)
                used.append((permit, batch.now_ms))
        return used, lost

    async def refresh_limits(self) -> None:
        """Claim the limited queues with permits, and again here those no longer limited."""
        if await self.limits.refresh(self):
            self._ready = [UNKNOWN] * self._shards
            self.wake.set()

    def _wake_at(self, at_ms: int, now_ms: int) -> None:
        """Look at every shard again at ``at_ms`` (Redis's clock), once per moment."""
        if self._unblock is not None and self._unblock_ms <= at_ms:
            return  # an earlier (or the same) look is already due
        if self._unblock is not None:
            self._unblock.cancel()
        self._unblock_ms = at_ms

        def look() -> None:
            self._unblock = None
            self.on_reset()

        delay = max((at_ms - now_ms) / 1000, 0.0)
        self._unblock = asyncio.get_running_loop().call_later(delay, look)

    def _handed_back(self, ids: list[str]) -> None:
        """The claim script left jobs this worker cannot run in their queue (another pool
        serves the same queue, or a deploy is in progress): say so, loudly but not per job."""
        state = self.state
        state.stats.handed_back += len(ids)
        # (a circuit breaker's held types: parked on purpose, breaker_gate.py)
        log.log(
            logging.INFO if state.types_held else logging.WARNING,
            "event=jobs_handed_back worker=%s count=%d first=%s tasks=%s queues=%s: "
            "they stay queued for a worker that has their task",
            self.id,
            len(ids),
            ids[0],
            ",".join(state.types),
            ",".join(state.queues),
        )

    def _plan(self, free: int) -> list[tuple[int, int]]:
        """(shard, jobs to ask for) for one round of claims.

        Few shards per round, each asked for many jobs: a script call's fixed cost in Redis
        is several times what one job costs inside it. Shards whose count is unknown (just
        woken, or never asked) come first, ``PROBE_MIN`` jobs each (not an even share of
        the slots): a wake means new jobs, perhaps urgent ones, that a deep queue elsewhere
        must not hold back. Shards known to hold ready jobs then fill what is left, greedily;
        slots still free go to the probes. Each round starts one shard further on.
        """
        shards = self._shards
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
