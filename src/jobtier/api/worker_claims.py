"""The HTTP workers' claims: a bounded long poll that runs the Python worker's claim script.

A claim asks the shards for jobs in pipelined rounds (the script, its fencing and its lease
are claim.lua's, as for a Python worker) and, when every shard it knows of is empty, waits
for a wake on the shards' wake channels (``q <queue>``, the channel Python workers sleep
on), through one subscription this API process opens for all its waiting claims: no Redis
connection sits blocked for a waiting worker, and an idle API polls nothing. A safety-net
look (``IDLE_LOOK``) covers a wake lost between two subscriptions.

Races guarded here, as the Python claim loop (worker/claimer.py) guards them:

- a wake that arrives while a claim is in flight is newer than its answer: each waiter's
  ``gen`` per shard is bumped by every wake, and a reply sets the shard's count of ready
  jobs only if no wake came since it was asked;
- a (re)subscription may have missed wakes: ``_on_reset`` marks every shard unknown for
  every waiter;
- a blocked (rate-limited) queue may count ready jobs that no claim takes: a shard that
  gave nothing is not asked again before a wake, and the wait ends when the block does (or
  at once, when the shard's claim stopped at its bound on expired jobs it cancels);
- a claim whose reply was lost (the connection died: a failover) may have leased jobs: it is
  sent again as it was, with its token, which claim.lua answers with the jobs it leased then
  (store/calls.py claim_call), while the claim has no other job to answer and its ``wait``
  lasts (``RESEND_MIN`` at least, half a lease at most). Claims are sent once by the client
  library (``sent_once``): were it to send one again itself, an error reply to that second
  send (READONLY, from a master demoted meanwhile) would hide that the first may have run;
- a claim answered without the jobs of a send whose reply was lost (it had others to answer,
  its time ran out, its worker hung up) hands that send over (``_hand_back``): sent again in
  the background until the lease from its loss would end, the jobs it leased, which no worker
  heard of, go back to the front of their queues, their attempt not counted (stopped.lua),
  instead of waiting out their lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field

from jobtier.core.keys import Keys
from jobtier.core.model import ClaimedJob
from jobtier.runtime.backoff import CLAIM
from jobtier.runtime.loop import FAULTS, wait_for
from jobtier.runtime.stopping import stop_tasks
from jobtier.store.calls import Call, claim_call, may_have_run, parse_claim
from jobtier.store.handback import give_back, leased_by
from jobtier.store.redis import RedisClient, sent_once
from jobtier.store.scripts import Scripts
from jobtier.store.subscriber import ShardSubscriber

log = logging.getLogger("jobtier.api.workers")

UNKNOWN = 1 << 30  # a shard whose ready jobs we don't know: worth asking
IDLE_LOOK = 5.0  # s between looks at every shard while no wake comes (the safety net)
LIMITED_LOG_EVERY = 60.0  # s: a worker claiming from a limited queue is logged this often
LIMITED_KEPT = 10_000  # (worker, queue) pairs remembered for the log above, at most


class QueuesLimited(Exception):
    """Every queue a claim asked is limited: no HTTP worker can take their jobs."""

    def __init__(self, queues: list[str]) -> None:
        super().__init__(queues)
        self.queues = queues


RESEND_MIN = 5.0  # s a claim whose reply was lost is sent again for, however short its wait
# sends handed back at once at most (``_hand_back``): during an outage every claim may hand
# some back, each sent again for a lease; beyond it, their jobs wait out their lease
MAX_HANDBACKS = 256


@dataclass(eq=False)
class _Waiter:
    """A claim in progress: what it knows of each shard, and its wake-up."""

    queues: frozenset[str]
    ready: list[int]
    gen: list[int]
    event: asyncio.Event = field(default_factory=asyncio.Event)
    wake_at: float = 0.0  # monotonic time a blocked queue's block ends (0: none)
    limited: set[str] = field(default_factory=set)  # queues asked that are limited, as of
    # the last round that had an answer


@dataclass(frozen=True, slots=True)
class Claimed:
    job: ClaimedJob
    shard: int


class WorkerClaims:
    """The claims of the HTTP workers an API process serves (see the module docstring)."""

    def __init__(self, redis: RedisClient, keys: Keys, scripts: Scripts, retention_s: int) -> None:
        self.keys = keys
        self.scripts = scripts
        self.retention_s = retention_s  # of a job a hand-back finds cancelled (stopped.lua)
        self._handbacks: set[asyncio.Task[None]] = set()  # sends given back (``_hand_back``)
        self._waiters: dict[str, set[_Waiter]] = {}  # queue -> the claims waiting for it
        self._turn = 0  # the shard the next claim starts at: claims spread over the shards
        self._closing = False
        self._stopping = asyncio.Event()  # set with _closing: ends a claim's back-off
        self._waits_ended = False  # the API is told to stop: claims answer without waiting
        self._limited_warned: dict[tuple[str, str], float] = {}  # (worker, queue) -> when
        self.advertised: dict[str, float] = {}  # worker id -> when it was last advertised
        self.seen: dict[str, float] = {}  # worker id -> when a heartbeat last said it is live
        self._subscriber = ShardSubscriber(
            redis,
            [keys.wake(shard) for shard in range(keys.shards)],
            self._on_wake,
            self._on_reset,
            name="api-worker-claims",
        )

    async def start(self) -> None:
        await self._subscriber.start()

    async def stop(self) -> None:
        """Claims waiting end now with what they have (nothing): the API is stopping."""
        self._closing = True
        self._stopping.set()
        for waiters in self._waiters.values():
            for w in waiters:
                w.event.set()
        # the sends handed back: their jobs, if any, wait out their lease
        await stop_tasks(list(self._handbacks), "claim hand-backs")
        await self._subscriber.stop()

    def end_waits(self) -> None:
        """The API is told to stop (its server still answers the requests in flight): claims
        waiting answer now with what they have (nothing; the worker claims again, of another
        API), and later ones do not wait."""
        self._waits_ended = True
        for waiters in self._waiters.values():
            for w in waiters:
                w.event.set()

    def _warn_limited(self, worker: str, limited: Iterable[str]) -> None:
        """Logged once a minute at most per worker and queue: what its claims cannot take."""
        now = time.monotonic()
        for queue in limited:
            if now - self._limited_warned.get((worker, queue), -LIMITED_LOG_EVERY) < (
                LIMITED_LOG_EVERY
            ):
                continue
            if len(self._limited_warned) > LIMITED_KEPT:
                self._limited_warned.clear()
            self._limited_warned[(worker, queue)] = now
            log.warning(
                "event=http_claim_limited_queue worker=%s queue=%s: the queue has a "
                "concurrency or rate limit, whose permits only Python workers take; this "
                "HTTP worker gets none of its jobs",
                worker,
                queue,
            )

    def waiting(self) -> int:
        """Claims waiting for a wake now (tests wait for a claim to be parked)."""
        return len({w for ws in self._waiters.values() for w in ws})

    def _on_wake(self, channel: bytes, data: bytes) -> None:
        # "q <queue>": a queue of the shard had no ready job and now has some
        if data[:2] != b"q ":
            return
        waiters = self._waiters.get(data[2:].decode())
        if not waiters:
            return
        shard = int(channel[channel.index(b"{") + 1 : channel.index(b"}")])
        for w in waiters:
            w.ready[shard] = UNKNOWN
            w.gen[shard] += 1
            w.event.set()

    def _on_reset(self) -> None:
        for waiters in self._waiters.values():
            for w in waiters:
                w.ready = [UNKNOWN] * self.keys.shards
                w.gen = [g + 1 for g in w.gen]
                w.event.set()

    async def claim(
        self,
        worker: str,
        types: Sequence[str],
        queues: Sequence[str],
        count: int,
        lease_ms: int,
        wait: float,
        gone: Callable[[], Awaitable[bool]],
    ) -> tuple[list[Claimed], list[str]]:
        """Up to ``count`` jobs, as soon as there is one; none after ``wait`` seconds, or once
        ``gone()`` says the worker hung up while it waited (its jobs would wait for their
        leases to expire). With them, the queues asked that are limited (a global
        concurrency or rate limit): an HTTP worker takes none of their jobs, as only a
        Python worker takes their permits (limit.lua); a claim whose every queue is limited
        raises ``QueuesLimited`` at once, rather than wait for jobs it can never have."""
        shards = self.keys.shards
        w = _Waiter(frozenset(queues), [UNKNOWN] * shards, [0] * shards)
        deadline = time.monotonic() + wait
        for q in w.queues:
            self._waiters.setdefault(q, set()).add(w)
        try:
            while True:
                w.event.clear()
                jobs = await self._rounds(w, worker, types, queues, count, lease_ms, deadline, gone)
                if w.limited:
                    self._warn_limited(worker, w.limited)
                    if not jobs and w.limited >= w.queues:
                        raise QueuesLimited(sorted(w.limited))
                left = deadline - time.monotonic()
                if jobs or left <= 0 or self._closing or self._waits_ended:
                    return jobs, sorted(w.limited)
                if w.wake_at:
                    left = min(left, max(w.wake_at - time.monotonic(), 0.0))
                woke = await wait_for(w.event, min(left, IDLE_LOOK))
                if not woke:  # the safety net, or a block ended: look everywhere again
                    w.ready = [UNKNOWN] * shards
                    w.wake_at = 0.0
                if self._closing or self._waits_ended or await gone():
                    return [], sorted(w.limited)
        finally:
            for q in w.queues:
                waiters = self._waiters.get(q)
                if waiters is not None:
                    waiters.discard(w)
                    if not waiters:
                        del self._waiters[q]

    async def _rounds(
        self,
        w: _Waiter,
        worker: str,
        types: Sequence[str],
        queues: Sequence[str],
        count: int,
        lease_ms: int,
        deadline: float,
        gone: Callable[[], Awaitable[bool]],
    ) -> list[Claimed]:
        """Pipelined rounds of claims over the shards that may hold ready jobs, until
        ``count`` are claimed or no shard may hold more. A claim whose reply was lost is sent
        again as it was (its token) at the next rounds, after a back-off, while no other
        round has claimed a job, until ``deadline`` (``RESEND_MIN`` from its loss at least,
        half a lease at most)."""
        out: list[Claimed] = []
        limited: set[str] | None = None  # the limited queues, as the shards answering say
        asked = [(q, -1) for q in queues]
        down: set[int] = set()  # shards whose call failed: not asked anew by this claim
        lost: dict[int, tuple[int, Call]] = {}  # shard -> (jobs asked, call): may have run
        lost_at = until = 0.0  # the first loss, and when lost claims are no longer sent again
        backoff = CLAIM.start()
        while True:
            kept = sum(n for n, _ in lost.values())
            plan = self._plan(w, count - len(out) - kept) if len(out) + kept < count else []
            sends = [
                (
                    shard,
                    n,
                    claim_call(shard, worker, n, lease_ms, asked, types, None, self.retention_s),
                )
                for shard, n in plan
                if shard not in lost  # (a wake meanwhile) asked again as it was, below
            ]
            sends += [(shard, n, call) for shard, (n, call) in lost.items()]
            if not sends:
                break
            gens = [w.gen[shard] for shard, _, _ in sends]
            try:
                # each shard's reply on its own: a cluster node failing over fails its
                # shards' claims, the jobs leased on the healthy nodes are still answered
                with sent_once():
                    replies = await self.scripts.call_many_each([c for _, _, c in sends])
            except FAULTS as exc:
                replies = [exc] * len(sends)
            failed = [r for r in replies if isinstance(r, FAULTS)]
            for (shard, n, call), g, reply in zip(sends, gens, replies, strict=True):
                if isinstance(reply, FAULTS):
                    w.ready[shard] = 0
                    down.add(shard)
                    # its reply lost with the connection, it may have leased jobs; sent
                    # again, a later send's error reply does not say the first did not run
                    if shard in lost or may_have_run(reply):
                        lost[shard] = (n, call)
                    continue
                batch = parse_claim(shard, reply)
                if lost.pop(shard, None) is None:
                    # every shard says which queues are limited; one still flagged limited
                    # while its limit is lifted shard by shard counts as not limited (a
                    # resent claim is answered as it was, and says none)
                    unaware = set(batch.unaware)
                    limited = unaware if limited is None else limited & unaware
                else:
                    log.info(
                        "event=claim_resent worker=%s shard=%d jobs=%d: a claim whose reply "
                        "was lost, sent again, answered the jobs it leased",
                        worker,
                        shard,
                        len(batch.jobs),
                    )
                if w.gen[shard] == g:
                    # a shard that gave nothing may still count jobs no claim takes now (a
                    # blocked queue): asking it again before a wake would spin. (One that
                    # cancelled as many expired jobs as a call may says when to look: now.)
                    w.ready[shard] = batch.ready_left if batch.jobs else 0
                if batch.wake_at_ms > 0:
                    at = time.monotonic() + (batch.wake_at_ms - batch.now_ms) / 1000
                    w.wake_at = min(w.wake_at, at) if w.wake_at else at
                out.extend(Claimed(job, shard) for job in batch.jobs)
            if failed and not until:  # (once a claim: not at each of its resends)
                log.warning(
                    "event=claim_shards_failed worker=%s shards=%d resending=%d claimed=%d "
                    "error=%r",
                    worker,
                    len(failed),
                    len(lost),
                    len(out),
                    failed[0],
                )
            if lost:
                now = time.monotonic()
                lost_at = lost_at or now
                until = until or min(max(deadline, now + RESEND_MIN), now + lease_ms / 2000)
                # while it has no job to answer: one that has is answered at once, its jobs'
                # leases running (a node failing over in a cluster can take seconds)
                if not out and now < until and not self._closing and not await gone():
                    await wait_for(self._stopping, min(backoff.next(), until - now))
                    if not self._closing and not await gone():
                        continue
                if self._closing:
                    _not_resent(worker, lost, "the API is stopping")
                else:
                    self._hand_back(worker, lost, lost_at + lease_ms / 1000)
                lost.clear()
            if len(failed) == len(replies):
                if not out:
                    raise failed[0]
                # jobs an earlier round leased are the worker's: answer them, or they would
                # wait out their lease, an attempt lost
                break
        for shard in down:
            w.ready[shard] = UNKNOWN  # asked again at the next round of claims
        if limited is not None:
            w.limited = limited
        return out

    def _hand_back(self, worker: str, lost: dict[int, tuple[int, Call]], until: float) -> None:
        """The claims whose replies were lost and that their claim no longer waits for: sent
        again in the background (``_give_back``) until ``until``, the end of the lease from
        the claim's first loss (after it, their jobs are back in their queues anyway, and
        their tokens forgotten); ``MAX_HANDBACKS`` at once at most."""
        room = max(MAX_HANDBACKS - len(self._handbacks), 0)
        if room < len(lost):
            shards = sorted(lost)
            over = {shard: lost.pop(shard) for shard in shards[room:]}
            _not_resent(worker, over, f"{MAX_HANDBACKS} sends are being handed back already")
            if not lost:
                return
        log.warning(
            "event=claim_handed_back worker=%s shards=%s: a claim whose reply was lost is "
            "sent again in the background; the jobs it leased go back to their queues",
            worker,
            ",".join(map(str, sorted(lost))),
        )
        for shard, (_, call) in lost.items():
            task = asyncio.create_task(
                self._give_back(worker, shard, call, until), name=f"claim-hand-back {shard}"
            )
            self._handbacks.add(task)
            task.add_done_callback(self._handed_back)

    def _handed_back(self, task: asyncio.Task[None]) -> None:
        self._handbacks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("event=claim_hand_back_crashed error=%r", exc, exc_info=exc)

    async def _give_back(self, worker: str, shard: int, call: Call, until: float) -> None:
        """Send ``call`` again, asking for no job (claim.lua then answers its token with the
        jobs it leased, and leases none afresh if it never ran), until it is answered; then
        give those jobs back to the front of their queues: nobody heard of them (stopped.lua:
        released, their attempt not counted; fenced by their lease version)."""
        backoff = CLAIM.start()
        while True:
            try:
                jobs = await leased_by(self.scripts, call)
                break
            except FAULTS as exc:
                failed = exc
            left = until - time.monotonic()
            if left <= 0 or self._closing:
                why = "the API is stopping" if self._closing else f"its sends failed: {failed!r}"
                _not_resent(worker, [shard], why)
                return
            await wait_for(self._stopping, min(backoff.next(), left))
        try:
            released = await give_back(self.scripts, shard, worker, self.retention_s, jobs)
        except FAULTS as exc:
            log.warning(
                "event=claim_hand_back_failed worker=%s shard=%d jobs=%d error=%r: they "
                "return when their lease expires",
                worker,
                shard,
                len(jobs),
                exc,
            )
            return
        log.info(
            "event=claim_given_back worker=%s shard=%d jobs=%d released=%d: the jobs a claim "
            "whose reply was lost had leased are back in their queues",
            worker,
            shard,
            len(jobs),
            released,
        )

    def _plan(self, w: _Waiter, want: int) -> list[tuple[int, int]]:
        """(shard, jobs to ask of it) for one round: shards known to hold ready jobs first,
        then unknown ones, the ``want`` spread over them; never more than ``want`` in all, so
        that a claim takes no job it cannot hand to its worker."""
        shards = self.keys.shards
        start = self._turn
        self._turn = (start + 1) % shards
        order = [(start + i) % shards for i in range(shards)]
        known = [s for s in order if 0 < w.ready[s] < UNKNOWN]
        unknown = [s for s in order if w.ready[s] >= UNKNOWN]
        asks: dict[int, int] = {}
        left = want
        for s in known:
            if left <= 0:
                break
            asks[s] = min(w.ready[s], left)
            left -= asks[s]
        probes = unknown[:left]
        for i, s in enumerate(probes):
            # an even share of what is left, the first shards taking the remainder
            asks[s] = left // len(probes) + (1 if i < left % len(probes) else 0)
        return list(asks.items())


def _not_resent(worker: str, shards: Iterable[int], why: str) -> None:
    log.warning(
        "event=claim_not_resent worker=%s shards=%s: its reply was lost, and it is not sent "
        "again (%s); jobs it leased, if any, return when their lease expires",
        worker,
        ",".join(map(str, sorted(shards))),
        why,
    )
