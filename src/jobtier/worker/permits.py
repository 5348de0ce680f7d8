"""Claiming from limited queues: global concurrency and rate limits, across every worker.

A queue's jobs live in every shard, but its limits must hold across all of them, so they are
kept in the queue's home shard as permits (``store/lua/limit.lua``). For each limited queue it
serves, a worker runs one ``LimitedClaimer`` beside its main claim loop (which leaves limited
queues alone); ``LimitedQueues`` holds them, started and ended as the catalogue says which
queues are limited. A round:

1. read how many ready jobs of the queue each shard holds (an HMGET a shard, one pipeline
   per node; a node that is down leaves its shards out of the round);
2. take as many permits as there are free slots and ready jobs (limit.lua ``acquire``), less
   the slots of the lost claims sent again (below);
3. claim with the permits as caps, spread over the shards that hold jobs (claim.lua never
   gives more than its cap; each shard's reply taken on its own), and give back at once the
   permits that found no job.

A claim whose reply was lost (sent, and sent again at once, both failed: its node went away)
may have leased jobs: it keeps as many permits as it asked for, and the next rounds send it
again as it was (its token) once its node answers their reads and the slots it asked for are
free, for half a lease from its first send; claim.lua answers a token it served with the jobs
it leased then. One that Redis refused with an error reply every time leased nothing. A shard whose claim failed is planned after the others
for half a lease: one that answers reads but refuses writes (out of memory, a failing disk)
must not take every permit of every round.

A job keeps its permit while it runs; the worker's heartbeat extends it (heartbeat.py) and
the job's end returns it (reporter.py), which wakes the workers waiting for that queue
(``l <queue>`` on the wake channel). A worker that dies holds its permits only until their
lease runs out, like its jobs. When the rate allows no permit now, the claimer sleeps until
the next token is due; when the concurrency is used up, until a permit comes free.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from jobtier.core.keys import Keys
from jobtier.core.model import PRIORITIES
from jobtier.runtime.backoff import CLAIM
from jobtier.runtime.loop import FAULTS, wait_for
from jobtier.runtime.stopping import stop_tasks
from jobtier.store.calls import Call, claim_token, may_have_run
from jobtier.store.redis import commands_each
from jobtier.worker.state import WorkerState

# seconds a stop gives the claim loops still running, and then the give-back of what their
# cut claims leased (claimer.py: _give_back_cut), each
CUT_TIMEOUT = 2.0

log = logging.getLogger("jobtier.worker")


@dataclass(slots=True)
class LostClaim:
    """A limited queue's claim that failed: ``cap`` jobs asked of ``shard`` by ``call``. One
    that may have run (``ran``: a send of it failed as a lost connection does, not with an
    error reply) is sent again at the next rounds until ``until`` (monotonic), with the
    ``permits`` kept for it; one Redis refused (an error reply to every send: out of memory,
    the cluster down) leased nothing."""

    shard: int
    cap: int
    call: Call
    until: float
    error: BaseException | None = None
    ran: bool = False
    permits: list[str] = field(default_factory=list)

    def failed(self, error: BaseException) -> None:
        self.error = error
        self.ran = self.ran or may_have_run(error)  # (an earlier send may have, if not this)


class Claims(Protocol):
    """What a limited queue's loop asks of the worker's claimer (claimer.py)."""

    def claimer_idle(self) -> None: ...
    async def claim_limited(
        self,
        queue: str,
        plan: list[tuple[int, int]],
        permits: list[str],
        again: Sequence[LostClaim] = (),
    ) -> tuple[list[tuple[str, int]], list[LostClaim]]: ...


class LimitedQueues:
    """A worker's limited queues, by queue, each claimed by its own loop."""

    def __init__(self, state: WorkerState) -> None:
        self.state = state
        self.claimers: dict[str, LimitedClaimer] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.over = False  # the loops end: the worker stops, or a burst found nothing more
        # a loop's crash (a defect of ours: Redis away it rides out), and what it then calls
        self.crash: BaseException | None = None
        self.on_crash: Callable[[], None] | None = None

    def __contains__(self, queue: str) -> bool:
        return queue in self.claimers

    def idle(self) -> bool:
        return all(c.idle for c in self.claimers.values())

    def wake(self) -> None:
        for claimer in self.claimers.values():
            claimer.wake.set()

    async def refresh(self, claims: Claims) -> bool:
        """Read which of the worker's queues are limited (the catalogue jt:queues); start a
        loop for each new one, end those of queues no longer limited (True if any)."""
        state = self.state
        raw = await state.redis.hmget(state.keys.queue_limits(), state.queues)
        limited = {q for q, conf in zip(state.queues, raw, strict=True) if conf}
        for q in limited - self.claimers.keys():
            claimer = self.claimers[q] = LimitedClaimer(self, claims, q)
            loop = self._tasks[q] = asyncio.create_task(claimer.run(), name=f"claim {q}")
            loop.add_done_callback(self._ended)
            log.info("event=queue_limited worker=%s queue=%s", state.id, q)
        ended = set(self.claimers) - limited
        for q in ended:
            del self.claimers[q]
            task = self._tasks.pop(q, None)
            if task is not None:
                task.cancel()
            log.info("event=queue_unlimited worker=%s queue=%s", state.id, q)
        return bool(ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        """A loop ended; if by a crash, its queue is claimed no more: said, kept for the
        worker's ``run`` to raise, and ``on_crash`` called (the worker stops)."""
        if task.cancelled() or task.exception() is None:
            return
        if self.crash is None:
            self.crash = task.exception()
        log.error(
            "event=claim_loop_crashed worker=%s loop=%r error=%r: the worker stops",
            self.state.id,
            task.get_name(),
            task.exception(),
        )
        if self.on_crash is not None:
            self.on_crash()

    def end(self) -> None:
        """The loops end after their claim in flight, if any."""
        self.over = True
        self.wake()

    async def stop(self, bound: float | None = None) -> None:
        """End the loops and wait for them, not past the shutdown's deadline (a Redis that
        stopped answering), nor past ``bound`` seconds (the worker's run cancelled: no
        deadline was set)."""
        self.end()
        self.state.slot_free.set()
        tasks = list(self._tasks.values())
        if not tasks:
            return
        deadline = self.state.deadline
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if bound is not None:
            left = bound if left is None else min(left, bound)
        _, pending = await asyncio.wait(tasks, timeout=left)
        if pending:
            log.warning(
                "event=claim_abandoned worker=%s: a limited queue's claim in flight", self.state.id
            )
            # waited for (briefly): a cut claim is given back once every loop has ended
            # (claimer.py: _give_back_cut)
            await stop_tasks(pending, "limited queue's claim loop", timeout=CUT_TIMEOUT)


@dataclass(slots=True)
class LimitStats:
    rounds: int = 0
    permits: int = 0  # permits taken and used by a job
    unused: int = 0  # permits given back at once: no job where they were aimed
    waited: float = 0.0  # seconds spent waiting for the rate or for a permit to come free
    waits: int = 0


@dataclass(slots=True)
class Permits:
    """What one acquire call granted."""

    ids: list[str] = field(default_factory=list)
    wait_ms: int = -1  # when the next rate token is due (or a block ends); -1: not rate-bound
    # (monotonic) half a lease after the acquire was first sent: a resent one answers permits
    # granted then, whose lease is that much older
    half_lease: float = float("inf")


def spread(
    permits: int, ready: Sequence[tuple[int, int]], last: Collection[int] = ()
) -> list[tuple[int, int]]:
    """(shard, cap) for a claim round: ``permits`` spread over the shards that hold ready
    jobs (``ready``: (shard, jobs)), fullest first, those in ``last`` after the others, each
    capped at what it holds."""
    out = []
    left = permits
    for shard, n in sorted(ready, key=lambda item: (item[0] in last, -item[1])):
        if left <= 0:
            break
        take = min(n, left)
        out.append((shard, take))
        left -= take
    return out


class LimitedClaimer:
    """The claim loop of one limited queue inside a worker. ``wake`` is set when a job of
    the queue became ready, a permit came free, or the worker stops."""

    def __init__(self, limits: LimitedQueues, claims: Claims, queue: str) -> None:
        self.limits = limits
        self.claims = claims
        self.queue = queue
        self.state = state = limits.state
        self.keys = state.keys
        self.scripts = state.scripts
        self.home = self.keys.home(queue)
        self.stats = LimitStats()
        self.wake = asyncio.Event()
        self.wake.set()
        self.idle = False  # its last round found no ready job (a burst worker may finish)
        # the token of an acquire whose reply was lost, and until when it is sent again
        self._unanswered: tuple[str, float] | None = None
        self._lost: list[LostClaim] = []  # claims whose replies were lost, to send again
        self._failing: dict[int, float] = {}  # shard -> until when it is planned last
        self._release: Callable[[], None] | None = None  # the slots a back-off holds (_hold)
        self._held = 0

    async def run(self) -> None:
        try:
            await self._loop()
        finally:  # the worker stops: the jobs of lost claims, if any, wait out their lease
            self._let_go()
            if self._lost:
                await self._give_back([p for claim in self._lost for p in claim.permits])

    async def _loop(self) -> None:
        backoff = CLAIM.start()
        state = self.state
        while not self.limits.over:
            if state.free_slots() + self._held <= 0:
                await state.wait_for_slot()
                continue
            self.wake.clear()
            try:
                pause = await self.round()
                backoff.reset()
            except FAULTS as exc:
                self._hold()
                await state.claim_failed(backoff, exc, f" queue={self.queue}")
                continue
            self._let_go()
            if pause is None:
                continue  # claimed something: there may be more
            started = time.monotonic()
            await wait_for(self.wake, pause)
            if pause > 0:
                self.stats.waits += 1
                self.stats.waited += time.monotonic() - started

    def _hold(self) -> None:
        """Through a back-off, the slots of the lost claims stay held (they may have leased
        jobs for them), until the next round takes them (``_let_go`` and its reservation, in
        one turn); the main loop takes the rest."""
        self._let_go()
        n = max(0, min(self.state.free_slots(), sum(claim.cap for claim in self._lost)))
        if n:
            self._release, self._held = self.state.reserve(n), n

    def _let_go(self) -> None:
        if self._release is not None:
            release, self._release, self._held = self._release, None, 0
            release()

    async def round(self) -> float | None:
        """One claim round; None if it claimed jobs, else how long to wait (seconds) before
        the next, unless woken."""
        await self._drop_expired()
        ready, unread = await self._ready_by_shard()
        # a lost claim is sent again once its node answers (this round's read of its shard):
        # a node that is down would hold the round for the client's retries
        again = [claim for claim in self._lost if claim.shard not in unread]
        busy = {claim.shard for claim in self._lost}  # asked again as they were, or will be
        ready = [(shard, n) for shard, n in ready if shard not in busy]
        total = sum(n for _, n in ready)
        self.idle = total == 0 and not self._lost
        if self.idle:
            self.claims.claimer_idle()
            return self.state.idle_poll
        # the slots free now (the main loop may have taken some during the read), held from
        # here: the lost claims that fit, whole, then as many new permits as the rest allow
        self._let_go()  # (what a back-off held, taken over in this turn)
        free = self.state.free_slots()
        sent: list[LostClaim] = []
        for claim in again:
            if claim.cap <= free - sum(c.cap for c in sent):
                sent.append(claim)
        held = [p for claim in sent for p in claim.permits]
        room = min(free - len(held), total)
        if room <= 0 and not sent:
            # (every lost claim's node down and nothing else ready: the read raised, above)
            if free > 0:  # the lost claims wait for more slots than are free
                self.state.slot_free.clear()
                await wait_for(self.state.slot_free, self.state.idle_poll)
            return 0.0  # (none free: the loop waits for one)
        reserved = self.state.reserve(len(held) + max(room, 0))
        try:
            permits = await self._acquire(room) if room > 0 else Permits()
            if not permits.ids and not sent:
                if permits.wait_ms >= 0:
                    return permits.wait_ms / 1000  # the rate's next token (or a block's end)
                return self.state.idle_poll  # every permit is held: woken when one comes free
            ids = permits.ids + held
            reserved()  # down to what this round claims (no wait in between)
            reserved = self.state.reserve(len(ids))
            self.stats.rounds += 1
            now = time.monotonic()
            last = {shard for shard, until in self._failing.items() if until > now}
            plan = spread(len(permits.ids), ready, last)
            try:
                started, lost = await self.claims.claim_limited(self.queue, plan, ids, sent)
            except asyncio.CancelledError:
                # cut by the stop: its jobs are given back (claimer.py: _give_back_cut), and
                # the permits this round held for them go back too, else the queue's capacity
                # would wait out their lease; not those of the jobs it started before the cut
                # (each returns its own as its job ends, counted as a start)
                started_here = {r.permit for r in self.state.running.values()}
                await self._give_back([p for p in ids if p not in started_here])
                raise
        finally:
            reserved()
        used = {permit for permit, _ in started}
        unused = [permit for permit in ids if permit not in used]
        waiting = [claim for claim in self._lost if all(claim is not c for c in sent)]
        self._note(lost, [shard for shard, _ in plan] + [claim.shard for claim in sent], now)
        for claim in self._lost:  # lost this round: each keeps as many permits as it asked
            claim.permits, unused = unused[: claim.cap], unused[claim.cap :]
            # no later than the permits it may have taken: a claim's sent again, or a resent
            # acquire's
            claim.until = min([claim.until, permits.half_lease] + [c.until for c in sent])
        self._lost += waiting
        self.stats.permits += len(started)
        self.stats.unused += len(unused)
        if started or unused:
            # when each job really started (the rate's window counts from there), and the
            # permits that found no job back
            args: list[Any] = ["settle", self.queue, len(started)]
            for permit, at_ms in started:
                args += (permit, at_ms)
            args += unused
            await self.scripts.call("limit", self.home, args)
        failed = next((claim.error for claim in lost if claim.error is not None), None)
        if failed is not None and not started:
            raise failed  # a claim failed and no job started: the loop backs off
        return None if started else 0.0

    async def _drop_expired(self) -> None:
        """The lost claims are sent again for half a lease from their first send (the jobs
        such a claim leased can still start under their lease); after that their permits go
        back."""
        now = time.monotonic()
        dropped = [claim for claim in self._lost if claim.until <= now]
        if not dropped:
            return
        self._lost = [claim for claim in self._lost if claim.until > now]
        log.warning(
            "event=claim_not_resent worker=%s queue=%s shards=%s: its reply was lost, and its "
            "node did not answer, or the slots were taken, for half a lease; jobs it leased, if "
            "any, return when their lease expires",
            self.state.id,
            self.queue,
            ",".join(str(claim.shard) for claim in dropped),
        )
        await self._give_back([p for claim in dropped for p in claim.permits])

    def _note(self, lost: list[LostClaim], asked: list[int], now: float) -> None:
        """After a round that asked ``asked`` (shards): the lost claims to send again, and the
        shards planned last (those whose claims failed, for half a lease; those that
        answered, no more)."""
        self._lost = [claim for claim in lost if claim.ran]
        failed = {claim.shard for claim in lost}
        for shard in asked:
            if shard not in failed:
                self._failing.pop(shard, None)
        for shard in failed:
            self._failing[shard] = now + self.state.lease_ms / 2000

    async def _ready_by_shard(self) -> tuple[list[tuple[int, int]], set[int]]:
        """(shard, ready jobs of the queue) of the shards that hold some, read shard by shard,
        and the shards that could not be read: those of a node that is down (a master failing
        over) are left out of the round; if the others hold none (and no lost claim waits to
        be sent again), the first error is raised (the loop is not idle: jobs may wait on
        the shards it could not read)."""
        fields = [f"{self.queue}:{p.value}" for p in PRIORITIES]
        keys = [self.keys.queue_counts(shard) for shard in range(self.keys.shards)]
        replies = await commands_each(self.state.redis, [("HMGET", key, *fields) for key in keys])
        failed = [reply for reply in replies if isinstance(reply, Exception)]
        out = []
        unread = set()
        for shard, values in enumerate(replies):
            if isinstance(values, Exception):
                unread.add(shard)
                continue
            n = sum(max(int(v or 0), 0) for v in values)
            if n:
                out.append((shard, n))
        if failed and not out and all(claim.shard in unread for claim in self._lost):
            # nothing found, but not everywhere (and no lost claim to send again): not idle
            # (a burst worker would end)
            raise failed[0]
        return out, unread

    async def _acquire(self, wanted: int) -> Permits:
        """Take up to ``wanted`` permits. An acquire whose reply was lost (Redis went away
        after running it) is sent again at the next round, with its token, for half a lease
        at most: limit.lua answers it with the permits it granted then, which would otherwise
        hold the queue's capacity, unused, until their lease ran out. Those beyond what this
        round wants go straight back."""
        now = time.monotonic()
        lost = self._unanswered
        if lost is None or lost[1] <= now:  # half a lease from the first send, no more
            lost = self._unanswered = (claim_token(), now + self.state.lease_ms / 2000)
        args = ("acquire", self.queue, self.state.id, wanted, self.state.lease_ms, lost[0])
        reply = await self.scripts.call("limit", self.home, args)
        self._unanswered = None
        granted, wait_ms = int(reply[0]), int(reply[1])
        ids = [r.decode() for r in reply[2 : 2 + granted]]
        if len(ids) > wanted:
            extra, ids = ids[wanted:], ids[:wanted]
            await self._give_back(extra)  # this round's own go ahead, whatever becomes of them
        return Permits(ids, wait_ms, lost[1])

    async def _give_back(self, ids: list[str]) -> None:
        """Release permits that started no job; if Redis does not take them, they come back
        when their lease runs out."""
        try:
            await self.scripts.call("limit", self.home, ("release", self.queue, "1", *ids))
        except FAULTS as exc:
            log.warning(
                "event=permits_not_released worker=%s queue=%s permits=%d error=%r: "
                "they come back when their lease runs out",
                self.state.id,
                self.queue,
                len(ids),
                exc,
            )


def limit_calls(keys: Keys, op: str, by_queue: dict[str, list[str]], *extra: Any) -> list[Call]:
    """limit.lua calls (``extend`` or ``release``) for permits grouped by queue."""
    return [
        ("limit", keys.home(queue), (op, queue, *extra, *ids))
        for queue, ids in by_queue.items()
        if ids
    ]
