"""The write-behind persister: shard log streams in Redis -> Postgres, in batches.

Every transition script appends an entry to its shard's log stream (``store/lua/lib.lua: commit``).
Persisters read all shards' streams through one consumer group, write each batch in one
Postgres transaction, and only then acknowledge the entries; acknowledged entries are trimmed
away. Everything downstream of the read is idempotent, which is what makes the rest simple:

* a replayed entry (committed, then the persister died before XACK) hits the
  ``job_transitions`` key and the ``jobs`` version guard, and changes nothing;
* two persisters may commit versions of one job out of order (each holds different entries of
  the shard): the ``jobs`` row only moves forward, and what only the submit entry knows
  (payload, idempotency key) is filled in whenever it arrives;
* a persister that dies leaves its entries pending in the group: it reads them back itself on
  restart (same name), and any persister takes them over once idle for
  ``persist_claim_idle_seconds`` (XAUTOCLAIM).

With nothing to read, a persister waits in Redis for the next entry (one blocking XREADGROUP
naming every stream, ``group.wait_idle``), so the first transition of a burst is read as it is
written; on a Redis Cluster, whose shards no one command can name, it naps between polls.

Each batch is one transaction: COPY into staging tables, then one upsert per table
(``batch.write_batch``; why COPY rather than array parameters is measured there). Here: what
goes into a batch and when, and what to do when it fails; ``acks.py``: what Redis is then
owed (XACKs, parked copies); ``stats.py``: the counts and the metrics made from them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import operator
import time
from collections.abc import Callable, Sequence

import asyncpg
from redis.exceptions import RedisError

from jobtier.config import Settings
from jobtier.core.keys import Keys
from jobtier.logs import Unforeseen
from jobtier.metrics.snapshot import Snapshot
from jobtier.persist.acks import Acks
from jobtier.persist.batch import BATCH_TIMEOUT, attached_meanwhile, write_on
from jobtier.persist.db import UNAVAILABLE, Pool
from jobtier.persist.retention import run_pruning
from jobtier.persist.stats import PersisterStats
from jobtier.runtime.backoff import PERSIST_POSTGRES, PERSIST_REDIS
from jobtier.store.redis import RedisClient
from jobtier.streams.consumer import (
    claim_idle,
    create_groups,
    forget_idle_consumers,
    read_group,
    replay_refused,
    trim,
    wait_idle,
)
from jobtier.streams.entries import MALFORMED, LogEntry, parse_entry

__all__ = ["Persister", "PersisterStats", "replay_refused"]

log = logging.getLogger("jobtier.persist")

IDLE_SLEEP_MIN = 0.005
IDLE_SLEEP_MAX = 0.1  # longest nap when every stream is empty: idle CPU stays near zero
READ_MIN = 32  # smallest per-shard XREADGROUP COUNT
TRIM_EVERY = 1.0  # seconds between trims of acknowledged entries
FORGET_EVERY = 60.0  # seconds between sweeps of the consumer group's stopped members
FORGET_IDLE_MIN = 120.0  # least idle time (s) of a member forgotten (and 4x the claim idle)

# This entry's data cannot be stored (no retry will help): isolate it, keep the others moving
# (but a row refused by a partition attached meanwhile is written again: attached_meanwhile).
POISON: tuple[type[BaseException], ...] = (
    asyncpg.exceptions.DataError,
    asyncpg.exceptions.IntegrityConstraintViolationError,
)
# Anything else (a missing table before `jobtier migrate`, an error nobody foresaw) is
# retried like an outage too, logged and counted by class: a persister never exits on its
# own, because nothing would drain the logs after it.


class Persister:
    """One member of the persister consumer group. ``await run()`` until ``stop()``.

    ``name`` is its consumer name. `jobtier persister` defaults to one with the pid in it, so
    two persisters on a host never share a name; a dead one's unfinished entries are then
    taken over by the others after ``persist_claim_idle_seconds``. A name kept stable across
    restarts (``--name``: host and slot) lets a restarted persister pick up its own at once.
    ``on_commit(entries, wall_time)`` is called after each commit (benchmarks).

    It never stops on its own: whatever fails — Redis, Postgres, a batch, a flush task — is
    logged, counted in ``stats.errors`` by class and retried after a back-off, except an
    entry Postgres refuses for its data, which is parked (see ``_poisoned``).
    """

    def __init__(
        self,
        settings: Settings,
        redis: RedisClient,
        pool: Pool,
        name: str,
        *,
        keys: Keys | None = None,
        on_commit: Callable[[Sequence[LogEntry], float], None] | None = None,
        concurrency: int = 2,
        batch_timeout: float = BATCH_TIMEOUT,
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.pool = pool
        self.name = name
        self.keys = keys or Keys(settings.prefix, settings.shards)
        self.group = self.keys.persist_group()
        self.batch_size = max(1, settings.persist_batch_size)
        self.interval = settings.persist_interval
        self.claim_idle_ms = int(settings.persist_claim_idle_seconds * 1000)
        self.on_commit = on_commit
        self.concurrency = max(1, concurrency)  # batches written at once (connections used)
        self.batch_timeout = batch_timeout
        self.forget_idle_ms = int(
            max(FORGET_IDLE_MIN, 4 * settings.persist_claim_idle_seconds) * 1000
        )
        self.stats = PersisterStats()
        self._streams = [self.keys.log(s) for s in range(self.keys.shards)]
        # b"0": still reading back this consumer's own pending entries (a previous life's)
        self._cursor = [b"0"] * self.keys.shards
        self._claim_cursor = [b"0-0"] * self.keys.shards
        self._buffer: list[LogEntry] = []
        self._held: set[tuple[int, bytes]] = set()  # (shard, id) buffered or being written
        self._inflight: set[asyncio.Task[None]] = set()  # flushes being committed
        self._first_at = 0.0  # when the oldest buffered entry was read
        self._acks = Acks(
            redis, self._streams, [self.keys.log_refused(s) for s in range(self.keys.shards)],
            self.group,
        )  # fmt: skip
        self._stop = asyncio.Event()
        self._ready = False
        self._next_claim = 0.0
        self._next_forget = 0.0
        self._next_trim = 0.0
        self._waited_in_vain = False  # the last wait in Redis found nothing
        self._explain = Unforeseen(log)  # a traceback once per error class

    # --- life cycle -----------------------------------------------------------------------
    def metrics(self) -> Snapshot:
        """This persister's part of its process's metrics snapshot (``PersisterStats``)."""
        return self.stats.snapshot()

    async def setup(self) -> None:
        """Create the consumer group on every shard stream (from the first entry) if missing."""
        await create_groups(self.redis, self._streams, self.group)
        self._ready = True

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        """Persist until ``stop()``; what is buffered then is written once more, without retries."""
        log.info("event=persister_started name=%s shards=%d", self.name, self.keys.shards)
        pruning = asyncio.create_task(run_pruning(self.settings, self._stop))  # retention.py
        backoff, idle = PERSIST_REDIS.start(), IDLE_SLEEP_MIN
        try:
            while not self._stop.is_set():
                try:
                    if not self._ready:
                        await self.setup()
                    # idle: wait in Redis for the next entry (here, so that its failures,
                    # a flushed or restarted Redis, are handled as the step's are)
                    moved = await self.step() or await self._wait_for_entries()
                    backoff.reset()
                except Exception as exc:
                    # Redis away or loading its data (one line), or anything else (its
                    # traceback once): never a reason to stop, nothing would drain the logs.
                    wait = backoff.next()
                    self.stats.failed(exc)
                    if isinstance(exc, RedisError | OSError):
                        log.warning("event=redis_unavailable retry_in=%.1fs error=%r", wait, exc)
                    else:
                        self._explain("event=loop_failed", exc, wait)
                    # A lost XREADGROUP reply leaves entries pending to us that we never saw:
                    # read our pending entries again (held ones are skipped). A restarted or
                    # flushed Redis may have lost the group: create it again.
                    self._reread()
                    self._ready = False
                    await self._sleep(wait)
                    continue
                if moved:
                    idle = IDLE_SLEEP_MIN
                else:
                    await self._sleep(idle)
                    idle = min(idle * 2, IDLE_SLEEP_MAX)
            if self._inflight:  # they give up their retries now that we are stopping
                await asyncio.wait(self._inflight)
            self._reap()
            try:
                while self._buffer:
                    await self._flush(self._take(), retry=False)
                await self._ack()
            except Exception as exc:  # left pending in Redis: written by the next persister
                log.warning("event=final_flush_skipped error=%r", exc)
        finally:
            self._cancel_flushes()
            pruning.cancel()
        log.info("event=persister_stopped name=%s", self.name)

    async def step(self) -> bool:
        """One round: acknowledge, claim, read, start a flush, trim. False when idle.

        Up to ``concurrency`` batches are written at once, each in its own transaction on its
        own connection, while reading goes on: Postgres's time per batch is most of the cost,
        and it overlaps with decoding the next batch (and with itself, on a second core).
        """
        now = time.monotonic()
        self._reap()
        if self._acks:
            await self._ack()
        if now >= self._next_claim:
            self._next_claim = now + max(0.05, self.claim_idle_ms / 2000)
            await self._claim()
        more = False
        if len(self._buffer) < self.batch_size and not self._waited_in_vain:
            more = await self._read()
        self._waited_in_vain = False
        moved = more
        if self._buffer:
            waited = time.monotonic() - self._first_at
            ready = len(self._buffer) >= self.batch_size or waited >= self.interval
            if ready and len(self._inflight) < self.concurrency:
                self._start_flush()
                moved = True
            elif ready and (len(self._buffer) >= self.batch_size or not more):
                # every connection busy: wait for a commit rather than poll Redis in a loop
                await asyncio.wait(
                    self._inflight, timeout=self.interval, return_when=asyncio.FIRST_COMPLETED
                )
                moved = True
            elif not ready and not more:
                # gather for the rest of the interval: fewer, larger transactions
                await self._sleep(max(0.0, self.interval - waited))
                moved = True
        if now >= self._next_trim:
            self._next_trim = now + TRIM_EVERY
            await self.trim()
        return moved

    async def drain(self) -> int:
        """Persist everything readable now; returns the number of entries committed.

        For tests and `jobtier persister --burst`: no sleeping, and no waiting for other
        consumers' entries to become idle beyond one XAUTOCLAIM pass.
        """
        if not self._ready:
            await self.setup()
        before = self.stats.transitions
        try:
            await self._claim()
            while True:
                self._reap()
                await self._ack()
                more = await self._read() if len(self._buffer) < self.batch_size else True
                if self._buffer and len(self._inflight) < self.concurrency:
                    self._start_flush()
                elif self._inflight and (self._buffer or not more):
                    await asyncio.wait(self._inflight, return_when=asyncio.FIRST_COMPLETED)
                elif not more and not self._buffer:
                    break
            await self._ack()
            await self.trim()
        finally:
            self._cancel_flushes()
        return self.stats.transitions - before

    async def _sleep(self, seconds: float) -> bool:
        """Sleep unless stopped; True once ``stop()`` was called."""
        if seconds > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), seconds)
        return self._stop.is_set()

    # --- reading --------------------------------------------------------------------------
    def _accept(self, shard: int, entry_id: bytes, fields: dict[bytes, bytes] | None) -> bool:
        if (shard, entry_id) in self._held:
            return False  # claimed back while we still hold it (a long Postgres outage)
        if not fields:  # pending, but trimmed from the stream: nothing left to write
            self._acks.add(shard, entry_id)
            return False
        try:
            entry = parse_entry(shard, entry_id, fields)
        except MALFORMED as exc:
            # Left pending, never acknowledged: a persister that understands it (a newer
            # version, in a rolling deploy) takes it over after the idle timeout.
            self.stats.bad_entries += 1
            log.error(
                "event=bad_log_entry stream=%s id=%s error=%r",
                self._streams[shard], entry_id.decode(), exc,
            )  # fmt: skip
            return False
        if not self._buffer:
            self._first_at = time.monotonic()
        self._buffer.append(entry)
        self._held.add((shard, entry_id))
        return True

    async def _read(self) -> bool:
        """XREADGROUP every shard in one pipeline. True if some shard may have more."""
        more, items = await read_group(
            self.redis, self.group, self.name, self._streams, self._cursor, self._read_count()
        )
        for shard, entry_id, fields in items:
            self._accept(shard, entry_id, fields)
        return more

    async def _wait_for_entries(self) -> bool:
        """Idle (nothing buffered, nothing more to read): wait in Redis for the next entry of
        any stream, up to ``IDLE_SLEEP_MAX`` (``group.wait_idle``), taking what comes; True
        once waited. False when it cannot wait so (a Redis Cluster; our own pending entries
        still being read back) or must not (stopping; a batch being written, whose
        acknowledgement would wait too): the caller naps instead."""
        if self._stop.is_set() or self._inflight or self._buffer:
            return False
        items = await wait_idle(
            self.redis, self.group, self.name, self._streams, self._cursor, self._read_count(),
            IDLE_SLEEP_MAX, self._sleep,
        )  # fmt: skip
        if items is None:
            return False
        for shard, entry_id, fields in items:
            self._accept(shard, entry_id, fields)
        # it read every stream and found nothing: no poll before the next wait (idle CPU)
        self._waited_in_vain = not items
        return True

    def _read_count(self) -> int:
        """Entries to ask each stream for: the room left in the buffer, spread over them."""
        room = self.batch_size - len(self._buffer)
        return max(-(-room // len(self._streams)), READ_MIN)

    async def _claim(self) -> None:
        """Take over entries idle longer than the claim timeout (their persister died)."""
        claimed = await claim_idle(
            self.redis, self.group, self.name, self._streams, self._claim_cursor,
            self.claim_idle_ms, self.batch_size,
        )  # fmt: skip
        for shard, items in enumerate(claimed):
            taken = sum(self._accept(shard, entry_id, fields) for entry_id, fields in items)
            if taken:
                self.stats.claimed += taken
                log.info("event=entries_claimed stream=%s count=%d", self._streams[shard], taken)
        if time.monotonic() >= self._next_forget:
            self._next_forget = time.monotonic() + FORGET_EVERY
            await self._forget_dead_consumers()

    async def _forget_dead_consumers(self) -> int:
        """Remove consumers that hold nothing and were idle ``forget_idle_ms``: persisters that
        stopped (a restart under a new name leaves the old one behind). One with pending
        entries is kept: ``_claim`` takes those over first."""
        return await forget_idle_consumers(
            self.redis, self._streams, self.group, self.name, self.forget_idle_ms
        )

    # --- writing --------------------------------------------------------------------------
    async def persist(self, entries: Sequence[LogEntry]) -> None:
        """Write entries to Postgres in one transaction (no acknowledgement): ``write_on``,
        with ``batch_timeout`` as the longest wait for a connection or for the commit."""
        self.stats.jobs += await write_on(self.pool, entries, self.batch_timeout)

    def _take(self) -> list[LogEntry]:
        # what stays behind keeps its _first_at: it has waited at least that long
        batch = self._buffer[: self.batch_size]
        del self._buffer[: self.batch_size]
        return batch

    def _start_flush(self) -> None:
        task = asyncio.create_task(self._flush(self._take()))
        self._inflight.add(task)

    def _reap(self) -> None:
        """Forget finished flushes. One that failed (its retries are inside it, so this is a
        bug of ours) is logged with its traceback and counted; its entries are read back
        from our pending ones and written again. It never takes the persister down."""
        for task in [t for t in self._inflight if t.done()]:
            self._inflight.discard(task)
            if task.cancelled():
                continue
            exc = task.exception()
            if exc is not None:
                self.stats.failed(exc)
                log.error("event=flush_failed error=%r", exc, exc_info=exc)
                self._reread()

    def _reread(self) -> None:
        """Read our own pending entries again from the start (held ones are skipped)."""
        self._cursor = [b"0"] * len(self._streams)
        self._waited_in_vain = False

    def _cancel_flushes(self) -> None:
        # a cancelled flush either committed (its entries stay pending: replayed harmlessly
        # later) or did not (they stay pending: written later)
        for task in self._inflight:
            task.cancel()
        self._inflight.clear()

    async def _flush(self, batch: list[LogEntry], retry: bool = True) -> None:
        """Commit a batch (retrying through outages), then queue its XACKs."""
        waited = _age(batch)
        started = time.monotonic()
        try:
            written = await self._commit(batch, retry)
        finally:
            for e in batch:
                self._held.discard((e.shard, e.entry_id))
        if written is None:  # stopped while Postgres was away: the entries stay pending
            return
        self._acks.add_many((e.shard, e.entry_id) for e in written)
        stats = self.stats
        stats.batches += 1
        stats.transitions += len(written)
        stats.batch_sizes.observe(len(batch))
        stats.batch_waits.observe(waited)
        stats.batch_writes.observe(time.monotonic() - started)
        stats.job_counts.observe(written)
        if self.on_commit is not None:
            self.on_commit(written, time.time())

    async def _commit(self, batch: Sequence[LogEntry], retry: bool) -> Sequence[LogEntry] | None:
        """Write the batch, retrying through Postgres outages with capped exponential back-off.

        Returns the entries written (a poisoned entry is left out: not written, not acked), or
        None when stopped before the batch could be committed: it stays pending in Redis.
        """
        backoff, down_since, outage = PERSIST_POSTGRES.start(), 0.0, False
        while True:
            try:
                await self.persist(batch)
                if backoff.failures:
                    self._written_on_retry(batch, down_since, backoff.failures, outage)
                return batch
            except Exception as exc:
                raced = attached_meanwhile(exc)
                if isinstance(exc, POISON) and not raced:
                    if len(batch) > 1:
                        return await self._isolate(batch, retry)
                    self._poisoned(batch[0], exc)
                    return []
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
                        getattr(exc, "table_name", ""), wait, len(batch),
                    )  # fmt: skip
                elif isinstance(exc, UNAVAILABLE):
                    log.warning(
                        "event=postgres_unavailable retry_in=%.1fs batch=%d error=%r",
                        wait, len(batch), exc,
                    )  # fmt: skip
                elif isinstance(exc, asyncpg.PostgresError):  # e.g. no table: run jobtier migrate
                    log.warning(
                        "event=batch_failed retry_in=%.1fs batch=%d error=%r",
                        wait, len(batch), exc,
                    )  # fmt: skip
                else:
                    self._explain("event=batch_failed", exc, wait, batch=len(batch))
                if await self._sleep(wait):
                    return None

    def _written_on_retry(
        self, batch: Sequence[LogEntry], since: float, retries: int, outage: bool
    ) -> None:
        """Log a batch committed after failed attempts as what it was: Postgres back after an
        outage (it could not be reached, or refused work), or the batch written again after
        failures of another kind (a partition attached meanwhile, a missing table), while
        Postgres was available all along."""
        took = time.monotonic() - since
        if outage:
            log.warning("event=postgres_available down_for=%.1fs retries=%d", took, retries)
        else:
            log.info(
                "event=batch_written_again after=%.1fs retries=%d batch=%d",
                took,
                retries,
                len(batch),
            )

    async def _isolate(self, batch: Sequence[LogEntry], retry: bool) -> Sequence[LogEntry] | None:
        """A batch was refused for its data: write entry by entry to find the bad ones."""
        written: list[LogEntry] = []
        for entry in batch:
            done = await self._commit([entry], retry)
            if done is None:
                return None
            written.extend(done)
        return written

    def _poisoned(self, entry: LogEntry, exc: BaseException) -> None:
        """Postgres refused this entry for its data, alone in its batch. It is parked: copied
        to the shard's ``log:refused`` stream with the error, then acknowledged. Left pending
        it would hold back trimming of its stream for good (Redis memory grows) and keep the
        persister lag's age growing; parked, an operator can read it and, once the cause is
        fixed, send it back with ``jobtier persister --replay-refused``."""
        self.stats.bad_entries += 1
        log.error(
            "event=entry_refused stream=%s id=%s job=%s version=%d error=%r parked_in=%s",
            self._streams[entry.shard], entry.entry_id.decode(), entry.status.id,
            entry.status.version, exc, self.keys.log_refused(entry.shard),
        )  # fmt: skip
        self._acks.park(entry.shard, entry.entry_id, repr(exc))

    async def _ack(self) -> None:
        """Send what Redis is owed: parked copies of refused entries, then XACKs (acks.py)."""
        try:
            await self._acks.flush()
        finally:
            self.stats.parked = self._acks.parked

    async def trim(self) -> None:
        """Drop log entries every consumer group has acknowledged (``group.trim``)."""
        await trim(self.redis, self._streams)


def _age(batch: Sequence[LogEntry]) -> float:
    """Seconds since the batch's oldest transition: its log entry's id, Redis's clock against
    ours, as ``pg_reader.lag`` reads it. The least id is the oldest, compared as bytes (their
    milliseconds have 13 digits until 2286), and only it is parsed: parsing every id took
    1.2 ms a 2,000-entry batch, comparing them 0.1 ms."""
    if not batch:
        return 0.0
    return max(0.0, time.time() - min(batch, key=_ENTRY_ID).ms / 1000)


_ENTRY_ID = operator.attrgetter("entry_id")
