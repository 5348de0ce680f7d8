"""The scheduler: promotes due jobs and reclaims expired leases, on time, on every shard.

It sleeps until the earliest thing it knows is due — a scheduled job's run-at, or a lease
deadline — rather than polling on a coarse interval. The scripts tell it the next due time
of each shard in every answer, and the shards' wake channels tell it when a submit or a
retry puts an earlier run-at in front (``"s <ms>"``). Times are Redis's clock: every answer
carries Redis's ``now``, and the scheduler keeps the offset to its own clock.

Several schedulers may run at once: promote and reclaim are atomic scripts that take each
due id out of its set exactly once, so nothing is promoted or reclaimed twice; there is no
leader to elect or to lose. Cron schedules are fired from here too, and each scheduler runs
a flow resolver (flows/resolver.py), woken by the same wake channels.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import msgspec
from redis.exceptions import RedisError

from jobtier.core.schedule import Schedule
from jobtier.engine.cron import CronMirror, Times, mirror_def, to_datetime
from jobtier.flows.resolver import Resolver
from jobtier.metrics.snapshot import Snapshot
from jobtier.persist.schedule_store import Busy, ScheduleStore, revision
from jobtier.runtime.backoff import SCHEDULER
from jobtier.runtime.loop import every
from jobtier.runtime.stopping import stop_task
from jobtier.store.calls import Call, parse_promote, parse_reclaim, promote_call, reclaim_call
from jobtier.store.context import Store
from jobtier.store.subscriber import ShardSubscriber

log = logging.getLogger("jobtier.scheduler")

NOW = 0  # "due now": check the shard on the next pass
# a pass's shards whose calls failed: shard -> (the first error, the steps that failed)
Failed = dict[int, tuple[BaseException, list[str]]]
RECONCILE_TIMEOUT = 30.0
# A shard's leases are looked at again at least this often (ms), whatever this scheduler's own
# lease: a worker run with a shorter JOBTIER_LEASE_SECONDS (a setting every part should share)
# makes claims that end before a full lease of ours, and its dead claims wait this long at most.
LEASE_RESCAN_MS = 5_000


@dataclass(slots=True)
class SchedulerStats:
    promoted: int = 0
    fired: int = 0  # jobs created by recurring schedules
    requeued: int = 0  # expired leases put back in their queue
    dead: int = 0  # expired leases with no attempts left
    passes: int = 0


class Scheduler:
    """Promote due jobs and reclaim expired leases on all shards until ``stop()``.

    ``batch`` bounds the jobs one script call moves (a burst of due jobs is promoted in
    several calls, each short, so other clients of Redis are not held up). ``max_sleep``
    is the safety net for wake messages missed while the subscription was down.
    """

    def __init__(
        self,
        store: Store,
        *,
        batch: int = 200,
        max_sleep: float = 5.0,
        min_pass_interval: float = 0.005,
        schedules: ScheduleStore | None = None,
        reconcile_every: float = 60.0,
        resolve: bool = True,
    ) -> None:
        self.store = store
        self.keys = store.keys
        self.scripts = store.scripts
        self.settings = store.settings
        self.batch = batch
        self.max_sleep = max_sleep
        self.min_pass_interval = min_pass_interval
        n = self.keys.shards
        self._next_due: list[float] = [NOW] * n
        self._next_lease: list[float] = [NOW] * n
        self._next_cron: list[float] = [NOW] * n
        # per shard: a shard whose node is down (a master failing over) is retried on its
        # own back-off while the other shards' jobs are promoted and reclaimed on time
        self._retry = [SCHEDULER.start() for _ in range(n)]
        self.cron = CronMirror(store.redis, store.keys, store.scripts)
        # Postgres holds the schedules' definitions: the mirror is checked against it
        self.schedules = schedules
        self.reconcile_every = reconcile_every
        self.misfire_grace_ms = int(self.settings.cron_misfire_grace_seconds * 1000)
        self._offset_ms = 0.0  # Redis clock minus ours
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self.stats = SchedulerStats()
        # the flow resolver shares this scheduler's wake subscription (resolve=False: none)
        self.resolver = Resolver(store) if resolve else None

    def metrics(self) -> Snapshot:
        """This scheduler's part of its process's metrics snapshot."""
        st = self.stats
        counters: dict[str, dict[str, float]] = {
            "scheduler_promoted_total": {"": st.promoted},
            "scheduler_requeued_total": {"": st.requeued},
            "scheduler_dead_lettered_total": {"": st.dead},
            "schedule_firings_total": {"": st.fired},
            "scheduler_passes_total": {"": st.passes},
        }
        if self.resolver is not None:
            counters.update(self.resolver.metrics().counters)
        return Snapshot("", "", 0.0, counters=counters)

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self.resolver is not None:
            self.resolver.stop()

    def redis_now_ms(self) -> float:
        return time.time() * 1000 + self._offset_ms

    def _on_wake(self, channel: bytes, data: bytes) -> None:
        if data == b"f":  # flow hand-offs in the shard's stream
            if self.resolver is not None:
                self.resolver.notify(int(channel[channel.index(b"{") + 1 : channel.index(b"}")]))
            return
        kind = data[:2]
        if kind == b"s " or kind == b"c ":
            shard = int(channel[channel.index(b"{") + 1 : channel.index(b"}")])
            at = int(data[2:])
            times = self._next_due if kind == b"s " else self._next_cron
            if at < times[shard] or times[shard] < 0:
                times[shard] = at
                self._wake.set()

    def _on_reset(self) -> None:
        # wake messages may have been missed: look at every shard again, but for those
        # waiting out a failure (their node down), whose back-off stands (a cluster's
        # subscription is made anew every few tens of ms while a node is down)
        for shard in range(self.keys.shards):
            if not self._retry[shard].failures:
                self._next_due[shard] = NOW
                self._next_cron[shard] = NOW
        self._wake.set()
        if self.resolver is not None:
            self.resolver.reset()

    async def run(self) -> SchedulerStats:
        subscriber = ShardSubscriber(
            self.store.redis,
            [self.keys.wake(s) for s in range(self.keys.shards)],
            self._on_wake,
            self._on_reset,
            name="scheduler-wake",
        )
        await subscriber.start()
        log.info("event=scheduler_started shards=%d", self.keys.shards)
        backoff = SCHEDULER.start()
        # Postgres is slow or down at times: reconciling must never hold up promotion
        reconciler = asyncio.create_task(self._reconcile_loop()) if self.schedules else None
        resolving = (
            asyncio.create_task(self.resolver.run(), name="jobtier-resolver")
            if self.resolver is not None
            else None
        )
        try:
            while not self._stopping.is_set():
                self._wake.clear()
                started = time.monotonic()
                try:
                    await self.run_once()
                    backoff.reset()
                except (RedisError, OSError) as exc:
                    wait = backoff.next()
                    log.warning("event=scheduler_pass_failed error=%r retry_in=%.2fs", exc, wait)
                    self._next_due = [NOW] * self.keys.shards
                    self._next_lease = [NOW] * self.keys.shards
                    self._next_cron = [NOW] * self.keys.shards
                    await self._sleep(wait)
                    continue
                # Passes at least min_pass_interval apart: jobs due within a few milliseconds
                # of each other are promoted by one call per shard, not one call per due
                # millisecond (a steady stream of due jobs would otherwise cost a pass a job).
                gap = self.min_pass_interval - (time.monotonic() - started)
                if gap > 0:
                    await asyncio.sleep(gap)
                await self._sleep(self._seconds_to_next())
        finally:
            # its Postgres and Redis calls can swallow a cancel (runtime/stopping.py)
            await stop_task(reconciler, "schedule reconciler")
            if resolving is not None:
                assert self.resolver is not None
                self.resolver.stop()
                # stopped by its flag between passes; a pass in flight is waited for (its
                # hand-offs are applied, not half-applied: not that it would matter)
                done, _ = await asyncio.wait({resolving}, timeout=10.0)
                if done:
                    resolving.result()
                else:
                    resolving.cancel()
            await subscriber.stop()
            log.info(
                "event=scheduler_stopped promoted=%d requeued=%d dead=%d",
                self.stats.promoted,
                self.stats.requeued,
                self.stats.dead,
            )
        return self.stats

    def _seconds_to_next(self) -> float:
        dues = [
            t
            for times in (self._next_due, self._next_lease, self._next_cron)
            for t in times
            if t >= 0
        ]
        if not dues:
            return self.max_sleep
        wait_ms = min(dues) - self.redis_now_ms()
        return min(max(wait_ms / 1000, 0.0), self.max_sleep)

    async def _sleep(self, seconds: float) -> None:
        if seconds <= 0:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._wake.wait()

    async def _fire_cron(self, now: float, failed: Failed) -> tuple[int, list[int]]:
        """Fire the recurring schedules that are due (before promoting: their jobs are
        created due now, so a worker can take them in this same pass); returns the jobs
        made and the shards tried. The shards go side by side, and not those waiting out a
        failure: their node down, a call to it is retried by the client for a second or
        more, which would hold up the pass (their promote call, sent once, finds out when
        the node is back: ``_settle``)."""
        fired = [
            shard
            for shard, due in enumerate(self._next_cron)
            if 0 <= due <= now and not self._retry[shard].failures
        ]
        if not fired:
            return 0, fired
        for shard in fired:
            self._next_cron[shard] = -1  # a wake during the call records itself (see below)
        at = int(self.redis_now_ms())
        replies = await asyncio.gather(
            *(self.cron.fire_due(shard, at, self.misfire_grace_ms) for shard in fired),
            return_exceptions=True,
        )
        created = 0
        for shard, reply in zip(fired, replies, strict=True):
            if isinstance(reply, (RedisError, OSError)):
                failed.setdefault(shard, (reply, []))[1].append("fire")
                continue
            if isinstance(reply, BaseException):
                raise reply
            made, nxt = reply
            created += made
            self.stats.fired += made
            woke = self._next_cron[shard]
            self._next_cron[shard] = nxt if woke < 0 else (woke if nxt < 0 else min(nxt, woke))
        return created, fired

    def _settle(self, failed: Failed, tried: set[int]) -> None:
        """After a pass: each shard whose call failed (its node down) is looked at again
        after its own back-off, in the steps that failed and in its promote call, sent once,
        which finds out when the node is back; one log line for them all. A shard whose
        calls all succeeded starts its back-off afresh."""
        for shard in tried - failed.keys():
            if self._retry[shard].failures:
                self._retry[shard].reset()
        if not failed:
            return
        now = self.redis_now_ms()
        times = {"fire": self._next_cron, "promote": self._next_due, "reclaim": self._next_lease}
        waits = []
        for shard, (_, steps) in failed.items():
            wait = self._retry[shard].next()
            at = now + wait * 1000
            for step in {*steps, "promote"}:
                woke = times[step][shard]
                times[step][shard] = at if woke < 0 else min(woke, at)
            waits.append(wait)
        log.warning(
            "event=scheduler_shards_failed shards=%s steps=%s error=%r retry_in=%.2fs",
            ",".join(map(str, sorted(failed))),
            ",".join(sorted({step for _, steps in failed.values() for step in steps})),
            next(iter(failed.values()))[0],
            min(waits),
        )

    async def reconcile(self) -> int:
        """Make Redis's copies of the schedules Postgres's: restore those Redis lost, write
        again those of another revision than their row's (a change whose Postgres commit
        failed after its Redis write), put back in their due set those missing from it, and
        remove those Postgres no longer has (a delete that failed half-way); then copy firing
        times back to Postgres. Returns how many were restored or written again."""
        if self.schedules is None:
            return 0
        listed = await self.cron.listed()  # first: a copy made after it has its row by then
        rows = await self.schedules.all()
        for orphan in sorted(listed - {s.id for s, _ in rows}):
            await self.cron.remove(orphan)
            log.warning("event=schedule_orphan_removed schedule=%s", orphan)
        ids = [s.id for s, _ in rows]
        copies = await self.cron.copies(ids)
        times = {i: t for i, (t, _) in copies.items()}
        revs = {i: rev for i, (_, rev) in copies.items()}
        restored = 0
        for schedule, _ in rows:
            kept = times.get(schedule.id)
            if kept is not None and revs.get(schedule.id) in ("", revision(schedule)):
                # ('': a copy from before revisions, left as it is)
                nxt, _, paused = kept
                if nxt is not None and not paused and schedule.id not in listed:
                    await self.cron.due(schedule.id, nxt)
                    log.warning("event=schedule_due_again schedule=%s", schedule.id)
                continue
            try:
                if not await self._rewrite(schedule, kept):
                    continue  # changed or deleted meanwhile: that wrote both
            except Busy:  # a change holds it: it writes both
                continue
            restored += 1
            was = "missing" if kept is None else "another revision"
            log.warning("event=schedule_restored schedule=%s was=%s", schedule.id, was)
        await self.schedules.sync_times(
            [
                (s, to_datetime(times[s.id][0]), to_datetime(times[s.id][1]))
                for s, _ in rows
                if s.id in times
            ]
        )
        return restored

    async def _rewrite(self, schedule: Schedule, kept: Times | None) -> bool:
        """Write Redis's copy of ``schedule`` (none: ``kept`` None) again as its row has it,
        under the row's lock, so that a change or delete under way is waited for (and then
        wrote both): False when the row has changed or gone since it was read. Its next
        firing: the row's (synced now and then from Redis), or the copy's (``kept``) when
        later and the copy fires by the same slots (a firing since the last sync); never one
        at or before the copy's last firing (then the slot after it, or none: it ended)."""
        assert self.schedules is not None
        async with self.schedules.locked(schedule.id, schedule.tenant) as locked:
            if locked is None or revision(locked.schedule) != revision(schedule):
                return False
            row = locked.schedule
            definition = mirror_def(row, self.settings.default_max_attempts)
            next_ms = None
            if not row.paused:
                timing = definition.timing()
                if row.next_fire_at is not None:
                    next_ms = round(row.next_fire_at.timestamp() * 1000)
                else:
                    next_ms = timing.next_after(int(self.redis_now_ms()))
                copy = await self.cron.definition(row.id) if kept and kept[0] else None
                if kept and kept[0] and copy and copy.timing() == timing:
                    next_ms = kept[0] if next_ms is None else max(next_ms, kept[0])
                if kept and kept[1] is not None and next_ms is not None and next_ms <= kept[1]:
                    # the row's time not synced since that slot fired (the last one, perhaps)
                    next_ms = timing.next_after(kept[1])
            payload = msgspec.json.encode(row.payload)
            await self.cron.put(row.id, definition, payload, next_ms, row.paused, revision(row))
        return True

    async def _reconcile_loop(self) -> None:
        # Postgres down or hung: firing goes on from Redis
        await every(
            self.reconcile_every,
            self.reconcile,
            event="schedule_reconcile",
            log=log,
            faults=(Exception,),
            timeout=RECONCILE_TIMEOUT,
        )

    async def run_once(self) -> int:
        """One pass over the shards that are due; returns the jobs moved."""
        self.stats.passes += 1
        now = self.redis_now_ms()
        failed: Failed = {}
        moved, fired = await self._fire_cron(now, failed)
        promote = [s for s, t in enumerate(self._next_due) if 0 <= t <= now]
        reclaim = [s for s, t in enumerate(self._next_lease) if 0 <= t <= now]
        if promote or reclaim:
            moved += await self._promote_and_reclaim(promote, reclaim, failed)
        self._settle(failed, {*fired, *promote, *reclaim})
        return moved

    async def _promote_and_reclaim(
        self, promote: list[int], reclaim: list[int], failed: Failed
    ) -> int:
        moved = 0
        calls: list[Call] = [promote_call(s, self.batch) for s in promote]
        s = self.settings
        calls += [
            reclaim_call(shard, self.batch, s.retention_seconds, s.dead_retention_seconds)
            for shard in reclaim
        ]
        for shard in promote:
            # a wake arriving while the call is in flight may name a job added after the
            # script looked: -1 lets _on_wake record it, and the answer below keeps it
            self._next_due[shard] = -1
        sent = time.time() * 1000
        # one pipeline per node, each call's reply on its own: while a node is down (a
        # master failing over) only its shards wait, on their own back-off (_settle)
        replies = await self.scripts.call_many_each(calls)
        received = time.time() * 1000
        lease_ms = s.lease_seconds * 1000
        for shard, reply in zip(promote, replies[: len(promote)], strict=True):
            if _failed(shard, reply, "promote", failed):
                continue
            r = parse_promote(reply)
            self._offset_ms = r.now_ms - (sent + received) / 2
            self.stats.promoted += r.moved
            moved += r.moved
            # a full batch means more may be due right now
            due = NOW if r.moved >= self.batch else r.next_ms
            woke = self._next_due[shard]
            self._next_due[shard] = due if woke < 0 else (woke if due < 0 else min(due, woke))
        for shard, reply in zip(reclaim, replies[len(promote) :], strict=True):
            if _failed(shard, reply, "reclaim", failed):
                continue
            r = parse_reclaim(reply)
            self._offset_ms = r.now_ms - (sent + received) / 2
            self.stats.requeued += r.moved
            self.stats.dead += r.dead
            moved += r.moved + r.dead
            if r.moved or r.dead:
                # each job with the worker whose lease it was (the first few of the call)
                jobs = ",".join(n.replace(" ", "@", 1) for n in r.named)
                more = r.moved + r.dead - len(r.named)
                log.warning(
                    "event=leases_expired shard=%d requeued=%d dead_lettered=%d jobs=%s%s: "
                    "their workers stopped heartbeating (died, or lost Redis)",
                    shard,
                    r.moved,
                    r.dead,
                    jobs or "-",
                    f" (+{more} more)" if more > 0 else "",
                )
            if r.moved + r.dead >= self.batch:
                self._next_lease[shard] = NOW
            else:
                # no lease is known to end sooner than its deadline; a claim made after this
                # answer ends no sooner than a full lease from now, if its worker's lease is
                # ours (else it is looked at within LEASE_RESCAN_MS)
                horizon = r.now_ms + min(lease_ms, LEASE_RESCAN_MS)
                self._next_lease[shard] = min(r.next_ms, horizon) if r.next_ms >= 0 else horizon
        return moved


def _failed(shard: int, reply: Any, step: str, failed: Failed) -> bool:
    """Whether ``reply`` is an error of Redis (a node down, or a call refused): recorded in
    ``failed``, for the shard to be looked at again after its back-off, as a whole failed pass
    was before. Any other error is a fault of ours, raised."""
    if isinstance(reply, (RedisError, OSError)):
        failed.setdefault(shard, (reply, []))[1].append(step)
        return True
    if isinstance(reply, BaseException):
        raise reply
    return False
