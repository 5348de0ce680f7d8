"""The webhook dispatcher: shard log streams -> deliveries in Postgres -> signed HTTP POSTs.

It reads the transition logs (``jt:{s}:log``) as its own consumer group, beside the
persisters', so it never slows a transition: the scripts append to the log as they always
did, and the dispatcher follows in its own process. For each batch of entries it looks up
the targets (the tenants' subscriptions, the jobs' own callbacks) in Postgres, inserts one
delivery per (transition, target) with an id made of the job id, its version and the target,
and only then acknowledges the entries (through its ``Consumer``, as a persister does).
Deliveries are then leased from Postgres and sent (``attempts.py``).

Crash safety, at least once:

* an entry read but not yet turned into deliveries stays pending in the group: the same
  dispatcher reads it back on restart (same name), any other takes it over once idle for
  ``persist_claim_idle_seconds`` (XAUTOCLAIM), as persisters do;
* an entry turned into deliveries but not acknowledged is read again and makes the same ids,
  which the insert skips;
* a delivery leased by a dispatcher that died comes due again when its lease ends and is
  sent by whichever dispatcher leases it: the receiver may see it twice, with the same
  ``webhook-id``, which is what that header is for.

Most entries have no target: those of tenants not marked as possibly having one
(``webhooks/marks.py``) are acknowledged without being decoded or looked up in Postgres.

The persisters trim a log only below what every consumer group has acknowledged
(``group.trim``), so entries wait for the dispatcher too, however far behind it is.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from jobtier.config import Settings
from jobtier.core.keys import Keys
from jobtier.logs import Unforeseen
from jobtier.metrics.snapshot import Snapshot, labels
from jobtier.persist.db import Pool
from jobtier.runtime.loop import FAULTS, every
from jobtier.runtime.stopping import stop_tasks
from jobtier.store.faults import fault_event
from jobtier.store.redis import RedisClient
from jobtier.streams.consumer import Consumer, Taken
from jobtier.streams.entries import MALFORMED, LogEntry, parse_entries, tenants
from jobtier.webhooks import marks
from jobtier.webhooks.attempts import Attempts
from jobtier.webhooks.deliveries import PG_UNAVAILABLE, DeliveryStore, made_from
from jobtier.webhooks.safety import AddressPolicy
from jobtier.webhooks.sender import Sender

log = logging.getLogger("jobtier.webhooks")

# transitions per shard per XREADGROUP, and per XAUTOCLAIM (asked for in entries:
# Consumer.entries_for)
READ_COUNT = 200
CLAIM_COUNT = 500
UNMARK_FAULTS: tuple[type[BaseException], ...] = (*FAULTS, *PG_UNAVAILABLE)


class PostgresDown(Exception):
    """Postgres failed the reading loop (its cause): told apart from Redis's faults, which
    a connection refused by either would look like."""


@dataclass
class DispatcherStats:
    """What the dispatcher has read since it started (its metrics; the attempts': ``attempts``)."""

    entries: int = 0  # transitions read from the log and handled
    skipped: int = 0  # of which no delivery can be made for: their tenant is not marked
    lookups: int = 0  # target look-ups in Postgres (one per batch with a marked tenant)
    unmarked: int = 0  # tenants unmarked: they had no target left (webhooks/marks.py)
    claimed: int = 0  # entries taken over from idle dispatchers
    bad_entries: int = 0
    created: int = 0  # deliveries made


class Dispatcher:
    """One member of the dispatchers' consumer group. ``await run()`` until ``stop()``."""

    def __init__(self, settings: Settings, redis: RedisClient, pool: Pool, name: str) -> None:
        self.settings = settings
        self.redis = redis
        self.store = DeliveryStore(pool)
        self.name = name
        self.keys = keys = Keys(settings.prefix, settings.shards)
        self.policy = AddressPolicy(settings.webhook_allowed_hosts)
        self.sender = Sender(
            self.policy,
            timeout=settings.webhook_timeout_seconds,
            max_response_bytes=settings.webhook_max_response_bytes,
            max_connections=settings.webhook_concurrency,
        )
        self.stats = DispatcherStats()
        self.consumer = Consumer(
            redis,
            [keys.log(s) for s in range(keys.shards)],
            keys.dispatch_group(),
            name,
            claim_idle_ms=int(settings.persist_claim_idle_seconds * 1000),
            log=log,
            counts=self.stats,
        )
        self.attempts = Attempts(settings, self.store, self.sender, self.consumer.stopping)
        self._explain = Unforeseen(log)  # a traceback once per error class

    # --- life cycle -----------------------------------------------------------------------
    def metrics(self) -> Snapshot:
        """This dispatcher's part of its process's metrics snapshot."""
        st, at = self.stats, self.attempts.stats
        totals = {
            "dispatcher_entries_total": st.entries,
            "dispatcher_entries_skipped_total": st.skipped,
            "dispatcher_target_lookups_total": st.lookups,
            "dispatcher_tenants_unmarked_total": st.unmarked,
            "dispatcher_claimed_total": st.claimed,
            "dispatcher_bad_entries_total": st.bad_entries,
            "webhook_deliveries_created_total": st.created,
        }
        counters: dict[str, dict[str, float]] = {name: {"": n} for name, n in totals.items()}
        counters["webhook_attempts_total"] = {labels(outcome=k): v for k, v in at.attempts.items()}
        gauges: dict[str, dict[str, float]] = {
            "webhook_deliveries_pending": {"": at.pending},
            "webhook_attempts_in_flight": {"": len(self.attempts.running)},
        }
        histograms = {
            "webhook_delivery_latency_seconds": {"": at.latency.snapshot()},
            "webhook_attempt_seconds": {"": at.attempt_time.snapshot()},
        }
        return Snapshot("", "", 0.0, counters, gauges, histograms)

    def stop(self) -> None:
        self.consumer.stop()
        self.attempts.due()

    async def setup(self) -> None:
        """The marks of every tenant Postgres has targets for (webhooks made before the marks
        existed), and the group. Entries are read only once this has succeeded."""
        await marks.mark(self.redis, self.keys, await self.store.target_tenants())
        await self.consumer.setup()

    async def run(self) -> None:
        """Dispatch until ``stop()``; attempts in flight then get their time limit to end."""
        log.info("event=dispatcher_started name=%s shards=%d", self.name, self.keys.shards)
        consumer, attempts = self.consumer, self.attempts
        unmark_every = self.settings.webhook_unmark_interval_seconds
        parts = [
            asyncio.create_task(
                consumer.run(self._round, self._failed, setup=self.setup), name="dispatcher-read"
            ),
            asyncio.create_task(attempts.send(), name="dispatcher-send"),
        ]
        if unmark_every > 0:
            unmark = every(
                unmark_every,
                self._unmark,
                event="unmark",
                log=log,
                stop=consumer.stopping,
                faults=UNMARK_FAULTS,
                wait_first=True,
            )
            parts.append(asyncio.create_task(unmark, name="dispatcher-unmark"))
        recording = asyncio.create_task(attempts.record(), name="dispatcher-record")
        try:
            await consumer.stopping.wait()
            await asyncio.gather(*parts)
            await attempts.finish()
            await recording
        finally:
            # a part in a Redis or Postgres call can lose its cancellation (runtime/stopping.py)
            await stop_tasks([*parts, recording, *attempts.running], "dispatcher")
            await self.sender.close()
        log.info("event=dispatcher_stopped name=%s", self.name)

    async def _unmark(self) -> None:
        """Unmark the tenants left without a target (``marks.unmark_idle``: safe beside
        target creations and other dispatchers)."""
        interval = self.settings.webhook_unmark_interval_seconds
        removed = await marks.unmark_idle(self.redis, self.keys, self.store, interval)
        self.stats.unmarked += removed
        if removed:
            log.info("event=tenants_unmarked count=%d", removed)

    # --- the logs -> deliveries -----------------------------------------------------------
    def _failed(self, exc: Exception, wait: float) -> bool:
        if isinstance(exc, PostgresDown):  # first: its cause may be an OSError, as Redis's are
            log.warning("event=postgres_unavailable retry_in=%.1fs error=%r", wait, exc.__cause__)
            return False
        if isinstance(exc, FAULTS):
            log.warning("event=%s retry_in=%.1fs error=%r", fault_event(exc), wait, exc)
        elif isinstance(exc, PG_UNAVAILABLE):
            log.warning("event=postgres_unavailable retry_in=%.1fs error=%r", wait, exc)
            return False
        else:
            # anything else (Postgres refusing a statement, a bug of ours): never the end
            # of reading, which nothing else would do; its traceback once per class
            self._explain("event=read_failed", exc, wait)
        return True

    async def _round(self) -> bool:
        """A step; idle, a wait in Redis for the next entry, handling what comes."""
        if await self.step():
            return True
        items = await self.consumer.wait(self.consumer.entries_for(READ_COUNT))
        if items:
            await self.handle(items)
        return items is not None

    async def step(self) -> bool:
        """Claim idle entries now and then, read a batch, turn it into deliveries, acknowledge
        it. False when there was nothing to read."""
        taken = await self.consumer.claim_due(self.consumer.entries_for(CLAIM_COUNT))
        more, read = await self.consumer.read(self.consumer.entries_for(READ_COUNT))
        taken += read
        if taken:
            await self.handle(taken)
        return bool(more or taken)

    async def drain(self) -> int:
        """Turn every entry readable now into deliveries (tests); returns entries handled."""
        if not self.consumer.ready:
            await self.setup()
        before = self.stats.entries
        while await self.step():
            pass
        return self.stats.entries - before

    async def handle(self, taken: Sequence[Taken]) -> None:
        """Deliveries for a batch of entries, inserted, then the entries acknowledged.
        Entries of tenants not marked (``webhooks/marks.py``) alone are acknowledged
        undecoded."""
        # the marks are read in a round trip of their own, after the read's reply: so a mark
        # written before a job's submit is seen with its entries (why: marks.marked)
        named = [tenants(f) if f else [] for _, _, f in taken]
        wanted = await marks.marked(
            self.redis, self.keys, sorted({t for ts in named for t in ts if t is not None})
        )
        entries: list[LogEntry] = []
        for (shard, entry_id, fields), its in zip(taken, named, strict=True):
            if not fields:  # trimmed while pending: nothing left to deliver
                continue
            if None not in its and wanted.isdisjoint(its):
                self.stats.skipped += len(its)  # no target can exist: acknowledged below
                continue
            try:
                parts = parse_entries(shard, entry_id, fields)
            except MALFORMED as exc:
                # acknowledged all the same (below): a pending entry nobody can read would
                # hold back the log's trimming for good
                self.stats.bad_entries += 1
                self.consumer.bad_entry(shard, entry_id, exc)
                continue
            for e, tenant in zip(parts, its, strict=True):  # (a script's: of one tenant or more)
                if tenant in wanted:
                    entries.append(e)
                else:
                    self.stats.skipped += 1
        if entries:
            self.stats.lookups += 1
            try:
                subs, callbacks = await self.store.targets(
                    sorted({e.tenant for e in entries}), sorted({e.status.id for e in entries})
                )
                deliveries = made_from(entries, subs, callbacks)
                if deliveries:
                    self.stats.created += await self.store.insert(deliveries)
            except PG_UNAVAILABLE as exc:
                raise PostgresDown from exc
            if deliveries:
                self.attempts.due()
        await self.consumer.ack((shard, entry_id) for shard, entry_id, _ in taken)
        self.stats.entries += sum(len(its) or 1 for its in named)  # transitions
