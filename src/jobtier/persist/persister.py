"""The write-behind persister: shard log streams in Redis -> Postgres, in batches.

Every transition script appends its transitions to its shard's log stream, a call's in one
entry (``store/lua/lib.lua: write_log``).
Persisters read all shards' streams through one consumer group (their ``Consumer``), write
each batch in one Postgres transaction, and only then acknowledge the entries; acknowledged
entries are trimmed away. Everything downstream of the read is idempotent:

* a replayed entry (committed, then the persister died before XACK) hits the
  ``job_transitions`` key and the ``jobs`` version guard, and changes nothing (the straight
  COPY of a batch's new rows is refused, and the batch merged instead: ``batch.write_batch``);
* two persisters may commit versions of one job out of order (each holds different entries of
  the shard): the ``jobs`` row only moves forward, and what only the submit entry knows
  (payload, idempotency key) is filled in whenever it arrives;
* a persister that dies leaves its entries pending in the group: it reads them back itself on
  restart (same name), and any persister takes them over once idle for
  ``persist_claim_idle_seconds`` (XAUTOCLAIM).

Here: what goes into a batch and when, and what to do when it fails; ``batch.py``: the
writing; ``stats.py``: the counts and the metrics made from them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import asyncpg

from jobtier.config import Settings
from jobtier.core.keys import Keys
from jobtier.logs import Unforeseen
from jobtier.metrics.snapshot import Snapshot
from jobtier.persist.batch import (
    BATCH_TIMEOUT,
    POISON,
    JobRow,
    attached_meanwhile,
    collapse,
    write_on,
)
from jobtier.persist.db import UNAVAILABLE, Pool
from jobtier.persist.entry_parts import EntryParts
from jobtier.persist.holding import Batch, Holding
from jobtier.persist.outbox import OnEnded, OutboxRelay
from jobtier.persist.reconcile import run_reconciling
from jobtier.persist.retention import run_pruning
from jobtier.persist.stats import PersisterStats
from jobtier.runtime import tracing
from jobtier.runtime.backoff import PERSIST_POSTGRES
from jobtier.runtime.loop import FAULTS
from jobtier.store.faults import fault_event
from jobtier.store.redis import RedisClient
from jobtier.streams.consumer import Consumer
from jobtier.streams.entries import MALFORMED, LogEntry, age, parse_entries

log = logging.getLogger("jobtier.persist")


class Outcome(NamedTuple):
    """A committed batch: the entries whose history it wrote, those to acknowledge (a
    poisoned one, parked, in neither), and whether it was written again in parts
    (``_isolate``)."""

    written: Sequence[LogEntry]
    acks: Sequence[LogEntry]
    isolated: bool = False


READ_MIN = 32  # smallest per-shard XREADGROUP COUNT, in transitions
# most bytes of documents, payloads and results in one batch, whatever its count: a batch of
# jobs with large payloads or results is written in several (memory, the transaction's size),
# and reads ask for what fits at the entries' mean size (_read_count). Held rows a batch
# releases (JOBTIER_PERSIST_HOLD_SECONDS, off by default) come on top.
BATCH_BYTES = 32 * 1024 * 1024
ALONE = 4  # a part of a refused batch this small is written entry by entry (_isolate)
TRIM_EVERY = 1.0  # seconds between trims of acknowledged entries
FORGET_IDLE_MIN = 120.0  # least idle time (s) of a member forgotten (and 4x the claim idle)


class Persister:
    """One member of the persister consumer group. ``await run()`` until ``stop()``.

    ``name`` is its consumer name: a dead one's unfinished entries are taken over by the
    others after ``persist_claim_idle_seconds``; one restarted under its name (``--name``)
    picks up its own at once. ``on_commit(entries, wall_time)`` is called after each commit
    (benchmarks). It never stops on its own: whatever fails is logged, counted in
    ``stats.errors`` by class and retried after a back-off, except an entry Postgres refuses
    for its data, which is parked (``_poisoned``).
    """

    def __init__(
        self,
        settings: Settings,
        redis: RedisClient,
        pool: Pool,
        name: str,
        *,
        on_commit: Callable[[Sequence[LogEntry], float], None] | None = None,
        concurrency: int = 2,
        batch_timeout: float = BATCH_TIMEOUT,
        outbox_ended: OnEnded | None = None,
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.redis = redis
        self.name = name
        self.keys = keys = Keys(settings.prefix, settings.shards)
        self.batch_size = max(1, settings.persist_batch_size)
        self.interval = settings.persist_interval
        self.on_commit = on_commit
        self.concurrency = max(1, concurrency)  # batches written at once (connections used)
        self.batch_timeout = batch_timeout
        self.stats = PersisterStats()
        idle = settings.persist_claim_idle_seconds
        self.consumer = Consumer(
            redis,
            [keys.log(s) for s in range(keys.shards)],
            keys.persist_group(),
            name,
            claim_idle_ms=int(idle * 1000),
            log=log,
            counts=self.stats,
            forget_idle_ms=int(max(FORGET_IDLE_MIN, 4 * idle) * 1000),
            refused=[keys.log_refused(s) for s in range(keys.shards)],
        )
        self._buffer: list[LogEntry] = []
        self._buffered = 0  # their bytes (``_size``)
        # what an entry is thought to hold: the last batch's mean; before the first, as much
        # as makes the first read the smallest (READ_MIN a stream), whatever the entries hold
        self._entry_bytes = BATCH_BYTES / (READ_MIN * keys.shards)
        # (shard, id) buffered, being written, waiting for its job's held row (holding.py),
        # or written and its XACK not yet sent: a read must not take it again
        self._taken: set[tuple[int, bytes]] = set()
        # entries of several transitions (one script's): acknowledged once all are written
        self.parts = EntryParts(self.consumer.acks)
        # live jobs' rows held back; their entries stay pending meanwhile, so not so long that
        # another persister would take them over
        self.holding = Holding(min(settings.persist_hold_seconds, idle / 2))
        self._inflight: dict[asyncio.Task[None], Batch] = {}  # flushes being committed
        self._first_at = 0.0  # when the oldest buffered entry was read
        self._next_trim = 0.0
        self._explain = Unforeseen(log)  # a traceback once per error class
        self._tracer = tracing.tracer()  # a span per batch when tracing is on
        # jobs of SELECT jobtier.submit(...) into Redis (docs/outbox.md; JOBTIER_OUTBOX_RELAY)
        # (outbox_ended: the webhooks of the rows it refuses, webhooks/deliveries.py)
        self.relay = (
            OutboxRelay.of_persister(settings, redis, pool, outbox_ended)
            if settings.outbox_relay
            else None
        )

    # --- life cycle -----------------------------------------------------------------------
    def metrics(self) -> Snapshot:
        """This persister's part of its process's metrics snapshot (``PersisterStats``)."""
        snap = self.stats.snapshot()
        snap.counters["persister_rows_collapsed_total"] = {"": self.holding.collapsed}
        if self.relay is not None:
            snap.counters.update(self.relay.metrics().counters)
        return snap

    def stop(self) -> None:
        self.consumer.stop()
        if self.relay is not None:
            self.relay.stop()

    async def run(self) -> None:
        """Persist until ``stop()``; what is buffered then is written once more, without retries."""
        log.info("event=persister_started name=%s shards=%d", self.name, self.keys.shards)
        pruning = asyncio.create_task(run_pruning(self.settings, self.consumer.stopping))
        # after a failover, the jobs Redis lost and Postgres kept go back (persist/reconcile.py)
        reconciling = asyncio.create_task(
            run_reconciling(self.settings, self.redis, self.consumer.stopping, self.stats.repaired)
        )
        relay = asyncio.create_task(self.relay.run()) if self.relay is not None else None
        try:
            await self.consumer.run(self._round, self._failed)
            if self._inflight:  # they give up their retries now that we are stopping
                await asyncio.wait(self._inflight)
            self._reap()
            try:
                while self._buffer or self.holding:
                    await self._flush(self._take(release_all=True), retry=False)
                await self._ack()
            except Exception as exc:  # left pending in Redis: written by the next persister
                log.warning("event=final_flush_skipped error=%r", exc)
        finally:
            self._cancel_flushes()
            pruning.cancel()
            reconciling.cancel()
            if relay is not None:  # stopped with the consumer; cancelled if it failed first
                relay.cancel()
                await asyncio.gather(relay, return_exceptions=True)
        log.info("event=persister_stopped name=%s", self.name)

    def _failed(self, exc: Exception, wait: float) -> bool:
        """Logged (Redis away: one line; else its traceback once) and counted by class."""
        self.stats.failed(exc)
        if isinstance(exc, FAULTS):
            log.warning("event=%s retry_in=%.1fs error=%r", fault_event(exc), wait, exc)
        else:
            self._explain("event=loop_failed", exc, wait)
        return True

    async def _round(self) -> bool:
        """A step; idle (nothing buffered, none being written: its ack would wait too), a
        wait in Redis for the next entry."""
        if await self.step():
            return True
        if self._inflight or self._buffer:
            return False
        items = await self.consumer.wait(self._read_count())
        if items is None:
            return False
        for shard, entry_id, fields in items:
            self._accept(shard, entry_id, fields)
        return True

    async def step(self) -> bool:
        """One round: acknowledge, claim, read, start a flush, trim. False when idle. Up to
        ``concurrency`` batches are written at once, each on its own connection, while reading
        goes on: Postgres's time per batch, most of the cost, overlaps with decoding the next."""
        now = time.monotonic()
        self._reap()
        if self.consumer.acks:
            await self._ack()
        await self.consumer.claim_due(self._read_count(), self._accept)
        if not self.consumer.swept and not self._full():
            # a dead member's entries are taken a buffer's room at a time: the rest at once
            self.consumer.claim_soon()
        more = await self._read() if not self._full() else False
        moved = more
        # nothing buffered, but held rows whose hold ran out: written as a batch of their own
        due = not self._buffer and self.holding.due(time.monotonic())
        if self._buffer or due:
            waited = time.monotonic() - self._first_at if self._buffer else 0.0
            ready = due or self._full() or waited >= self.interval
            if ready and len(self._inflight) < self.concurrency:
                self._start_flush()
                moved = True
            elif ready and (self._full() or not more):
                # every connection busy: wait for a commit rather than poll Redis in a loop
                await asyncio.wait(
                    self._inflight, timeout=self.interval, return_when=asyncio.FIRST_COMPLETED
                )
                moved = True
            elif not ready and not more:
                # gather for the rest of the interval: fewer, larger transactions
                await self.consumer.sleep(self.interval - waited)
                moved = True
        if now >= self._next_trim:
            self._next_trim = now + TRIM_EVERY
            await self.consumer.trim()
        return moved

    async def drain(self) -> int:
        """Persist everything readable now (tests, `--burst`): no sleeping, one claim sweep
        (every stream's pending entries scanned once); returns the number of entries
        committed."""
        if not self.consumer.ready:
            await self.consumer.setup()
        before = self.stats.transitions
        try:
            await self.consumer.claim(self._read_count(), self._accept)
            while not self.consumer.swept:
                await self.consumer.claim(self._read_count(), self._accept)
            while True:
                self._reap()
                await self._ack()
                more = await self._read() if not self._full() else True
                if more and not self._full():
                    continue  # a whole batch gathered first, however small the reads
                # every row written, none held: what is readable now is all in Postgres after
                pending = self._buffer or self.holding
                if pending and len(self._inflight) < self.concurrency:
                    self._start_flush(release_all=True)
                elif self._inflight and (pending or not more):
                    await asyncio.wait(self._inflight, return_when=asyncio.FIRST_COMPLETED)
                elif not more and not pending:
                    break
            await self._ack()
            await self.consumer.trim()
        finally:
            self._cancel_flushes()
        return self.stats.transitions - before

    # --- reading --------------------------------------------------------------------------
    def _accept(self, shard: int, entry_id: bytes, fields: dict[bytes, bytes] | None) -> bool:
        if (shard, entry_id) in self._taken:
            return False  # ours still: being written (a long outage), or its XACK not yet sent
        if not fields:  # pending, but trimmed from the stream: nothing left to write
            self.parts.forget(shard, entry_id)
            self.consumer.acks.add(shard, entry_id)
            return False
        try:
            parts = parse_entries(shard, entry_id, fields)
        except MALFORMED as exc:
            # Left pending, never acknowledged: a persister that understands it (a newer
            # version, in a rolling deploy) takes it over after the idle timeout.
            self.stats.bad_entries += 1
            self.consumer.bad_entry(shard, entry_id, exc)
            return False
        if not self._buffer:
            self._first_at = time.monotonic()
        self._buffer.extend(parts)
        self._buffered += sum(map(_size, parts))
        self._taken.add((shard, entry_id))
        self.parts.taken(parts)
        return True

    async def _read(self) -> bool:
        """True if some shard may have more."""
        more, items = await self.consumer.read(self._read_count())
        for shard, entry_id, fields in items:
            self._accept(shard, entry_id, fields)
        return bool(more)

    def _full(self) -> bool:
        """Does the buffer hold a batch (``batch_size`` entries, or ``BATCH_BYTES``)?"""
        return len(self._buffer) >= self.batch_size or self._buffered >= BATCH_BYTES

    def _read_count(self) -> int:
        """Entries to ask each stream for: the room left in the buffer, in transitions and in
        bytes (at the larger of the last batch's and the buffer's mean transition), spread
        over them (``Consumer.entries_for``)."""
        entry = self._entry_bytes
        if self._buffer:
            entry = max(entry, self._buffered / len(self._buffer))
        room = min(self.batch_size - len(self._buffer), (BATCH_BYTES - self._buffered) / entry)
        entries = self.consumer.entries_for
        return max(-(-entries(room) // self.keys.shards), entries(READ_MIN))

    # --- writing --------------------------------------------------------------------------
    async def persist(
        self, entries: Sequence[LogEntry], rows: Sequence[JobRow] | None = None
    ) -> None:
        """Write entries in one transaction (``write_on``), no acknowledgement; ``rows``: the
        job rows with them, when not every one they make (``write_batch``)."""
        self.stats.jobs += await write_on(self.pool, entries, self.batch_timeout, rows)

    def _take(self, release_all: bool = False) -> Batch:
        """The next batch: up to ``batch_size`` buffered transitions (``BATCH_BYTES``), never
        cut inside a stream entry (its XACK waits for all its transitions: ``EntryParts``),
        their jobs' rows but those held, and the held rows whose hold ran out (every one with
        ``release_all``)."""
        # what stays behind keeps its _first_at: it has waited at least that long
        buffer = self._buffer
        n, size = len(buffer), self._buffered
        if n > self.batch_size or size > BATCH_BYTES:  # else all of it, as a rule
            n, size = 0, 0
            for entry in buffer[: self.batch_size]:  # at least one, however large
                size += _size(entry)
                if n and size > BATCH_BYTES:
                    size -= _size(entry)
                    break
                n += 1
            if n < len(buffer) and _same(buffer[n], buffer[n - 1]):
                # back to the start of the entry cut, or, when the batch is that entry,
                # on to its end: a batch over the bounds holds one entry alone
                start = n - 1
                while start and _same(buffer[start - 1], buffer[n]):
                    start -= 1
                if start:
                    n = start
                while n < len(buffer) and _same(buffer[n], buffer[n - 1]):
                    n += 1
                size = sum(map(_size, buffer[:n]))
        entries = buffer[:n]
        del buffer[:n]
        self._buffered -= size
        if n:
            self._entry_bytes = size / n
        return self.holding.take(entries, time.monotonic(), release_all)

    def _start_flush(self, release_all: bool = False) -> None:
        batch = self._take(release_all)
        self._inflight[asyncio.create_task(self._flush(batch))] = batch

    def _reap(self) -> None:
        """Forget finished flushes. One that failed (a bug of ours: its retries are inside it)
        is logged and counted, and its entries read back from our pending ones."""
        for task in [t for t in self._inflight if t.done()]:
            del self._inflight[task]
            if task.cancelled():
                continue
            exc = task.exception()
            if exc is not None:
                self.stats.failed(exc)
                log.error("event=flush_failed error=%r", exc, exc_info=exc)
                self.consumer.reread()  # held ones are skipped

    def _cancel_flushes(self) -> None:
        # a cancelled flush either committed (its entries stay pending: replayed harmlessly
        # later) or did not (they stay pending: written later); ours no more either way (one
        # cancelled before it began never reaches _write's own letting go)
        for task, batch in self._inflight.items():
            if not task.done():
                task.cancel()
                self._let_go((*batch.entries, *batch.released))
        self._inflight.clear()

    async def _flush(self, batch: Batch, retry: bool = True) -> None:
        """Commit a batch (retrying through outages), then queue its XACKs; a span of its
        own when tracing is on (what failed in it recorded: start_as_current_span)."""
        if self._tracer is None:
            await self._write(batch, retry)
            return
        with self._tracer.start_as_current_span(
            "persist batch",
            tracing.context_of(None),  # a batch holds many jobs' entries: no trace of its own
            attributes={"jobtier.batch.entries": len(batch.entries)},
        ) as span:
            written = await self._write(batch, retry)
            span.set_attribute("jobtier.batch.written", -1 if written is None else written)

    async def _write(self, batch: Batch, retry: bool) -> int | None:
        """``_flush``'s work: the entries written, None when stopped while Postgres was away
        (they stay pending). The entries of rows held on (``holding.py``) are acknowledged
        later, with the batch that writes their rows."""
        waited = age(batch.entries)
        started = time.monotonic()
        outcome: Outcome | None = None
        try:
            outcome = await self._commit(batch, retry)
        finally:
            # Committed, every entry it took is held on (its row's hold, when committed whole),
            # owed an XACK, or parked: ours until Redis has the XACK (``_ack``), else a read of
            # our pending entries (after a start, a takeover, a failure) meanwhile would take
            # it again and write it twice. Not committed, every one is let go (pending in
            # Redis: read back, or written by the next).
            if outcome is None:
                self._let_go((*batch.entries, *batch.released))
            elif not outcome.isolated and batch.held:
                self.holding.committed(batch, time.monotonic())
        if outcome is None:  # stopped while Postgres was away: the entries stay pending
            return None
        written, acks = outcome.written, outcome.acks
        self.parts.done(acks)
        stats = self.stats
        stats.batches += 1
        stats.transitions += len(written)
        if batch.entries:  # (not a batch of held rows alone)
            stats.batch_sizes.observe(len(batch.entries))
            stats.batch_waits.observe(waited)
        stats.batch_writes.observe(time.monotonic() - started)
        stats.job_counts.observe(written)
        if self.on_commit is not None:
            self.on_commit(written, time.time())
        return len(written)

    async def _commit(self, batch: Batch, retry: bool) -> Outcome | None:
        """Write the batch, retrying through Postgres outages with a back-off; None when
        stopped first (its entries stay pending). A batch refused for its data is written again
        in halves (``isolated``), each with its jobs' rows, down to the bad entries alone: its
        entries, those it released, and those of the rows it would hold, their holds dropped."""
        backoff, down_since, outage = PERSIST_POSTGRES.start(), 0.0, False
        size = len(batch.entries)
        while True:
            try:
                await self.persist(batch.entries, batch.rows)
                if backoff.failures:
                    self._written_on_retry(size, down_since, backoff.failures, outage)
                return Outcome(batch.entries, batch.acks)
            except Exception as exc:
                raced = attached_meanwhile(exc)
                if isinstance(exc, POISON) and not raced:
                    forgotten = self.holding.forget(batch.held)
                    alone = [*batch.entries, *batch.released, *forgotten]
                    if len(alone) == 1:
                        self._poisoned(alone[0], exc)
                        return Outcome([], [], isolated=True)
                    written: list[LogEntry] | None = None
                    try:
                        written = await self._isolate(alone, retry)
                    finally:  # no longer held: left pending, or written or parked (``_ack``)
                        if written is None:
                            self._let_go(forgotten)
                    if written is None:
                        return None
                    ids = {id(e) for e in batch.entries}
                    return Outcome([e for e in written if id(e) in ids], written, isolated=True)
                if not retry:
                    raise
                if not backoff.failures:
                    down_since = time.monotonic()
                wait = backoff.next()
                self.stats.retries += 1
                self.stats.failed(exc)
                outage = outage or isinstance(exc, UNAVAILABLE)
                if raced:  # not a failure of Postgres, nor of the data: batch_written_again
                    log.info(
                        "event=partition_attached_meanwhile table=%s retry_in=%.1fs batch=%d",
                        getattr(exc, "table_name", ""),
                        wait,
                        size,
                    )
                elif isinstance(exc, UNAVAILABLE):
                    log.warning(
                        "event=postgres_unavailable retry_in=%.1fs batch=%d error=%r",
                        wait,
                        size,
                        exc,
                    )
                elif isinstance(exc, asyncpg.PostgresError):  # e.g. no table: run jobtier migrate
                    log.warning(
                        "event=batch_failed retry_in=%.1fs batch=%d error=%r", wait, size, exc
                    )
                else:
                    self._explain("event=batch_failed", exc, wait, batch=size)
                if await self.consumer.sleep(wait):
                    return None

    def _written_on_retry(self, n: int, since: float, retries: int, outage: bool) -> None:
        """Log a batch committed after failed attempts as what it was: Postgres back after an
        outage, or the batch written again after failures of another kind (a partition
        attached meanwhile, a missing table), Postgres available all along."""
        took = time.monotonic() - since
        if outage:
            log.warning("event=postgres_available down_for=%.1fs retries=%d", took, retries)
        else:
            log.info("event=batch_written_again after=%.1fs retries=%d batch=%d", took, retries, n)

    async def _isolate(self, entries: Sequence[LogEntry], retry: bool) -> list[LogEntry] | None:
        """A batch was refused for its data: written again in halves, each with its jobs'
        rows, and a half refused halved again (``_commit``), down to ``ALONE`` entries, then
        entry by entry; the entries written, None when stopped first. One bad entry among n
        costs about 2·log2(n) commits, where entry by entry cost n (a batch of 8,000: 26, not
        8,000); when most are bad, about 1.5·n."""
        if len(entries) <= ALONE:
            parts = [[entry] for entry in entries]
        else:
            half = (len(entries) + 1) // 2
            parts = [list(entries[:half]), list(entries[half:])]
        written: list[LogEntry] = []
        for part in parts:
            done = await self._commit(Batch(part, collapse(part)), retry)
            if done is None:
                return None
            written.extend(done.acks)
        return written

    def _poisoned(self, entry: LogEntry, exc: BaseException) -> None:
        """Postgres refused this entry for its data, alone in its batch: parked (``Acks.park``).
        Left pending it would hold back trimming of its stream for good and keep the lag's age
        growing; parked, an operator can read it and, once the cause is fixed, send it back
        with ``jobtier persister --replay-refused``."""
        self.stats.bad_entries += 1
        log.error(
            "event=entry_refused stream=%s id=%s job=%s version=%d error=%r parked_in=%s",
            self.keys.log(entry.shard),
            entry.entry_id.decode(),
            entry.status.id,
            entry.status.version,
            exc,
            self.keys.log_refused(entry.shard),
        )
        self.parts.refused(entry, repr(exc))

    def _let_go(self, entries: Sequence[LogEntry]) -> None:
        """Entries not written (a batch not committed): pending in Redis, a read may take them
        again, every transition of their stream entries afresh."""
        for e in entries:  # (still unwritten in their entries' parts: EntryParts.taken)
            self._taken.discard((e.shard, e.entry_id))

    async def _ack(self) -> None:
        """Send what Redis is owed: parked copies of refused entries, then XACKs."""
        acks, taken = self.consumer.acks, self._taken
        try:
            for shard, ids in (await acks.flush()).items():
                for entry_id in ids:  # done with: a read may take it again only now
                    taken.discard((shard, entry_id))
        finally:
            self.stats.parked = acks.parked


def _same(a: LogEntry, b: LogEntry) -> bool:
    """Do ``a`` and ``b`` come in the same stream entry?"""
    return a.entry_id == b.entry_id and a.shard == b.shard


def _size(entry: LogEntry) -> int:
    """The bytes of an entry a batch carries (its document, payload and result)."""
    return len(entry.doc) + len(entry.payload or b"") + len(entry.result or b"")
