"""The webhook dispatcher: shard log streams -> deliveries in Postgres -> signed HTTP POSTs.

It reads the transition logs (``jt:{s}:log``) as its own consumer group, beside the
persisters', so it never slows a transition: the scripts append to the log as they always
did, and the dispatcher follows in its own process. For each batch of entries it looks up
the targets (the tenants' subscriptions, the jobs' own callbacks) in Postgres, inserts one
delivery per (transition, target) with an id made of the job id, its version and the target,
and only then acknowledges the entries. Deliveries are then leased from Postgres and sent;
each attempt's outcome is recorded; failed ones wait there for their next attempt. With
nothing to read, it waits in Redis for the next entry, as a persister does
(``persist.group.wait_idle``).

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
(``Persister.trim``), so entries wait for the dispatcher too, however far behind it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import msgspec
from redis.exceptions import RedisError

from jobtier.config import Settings
from jobtier.core.keys import Keys
from jobtier.core.model import TERMINAL
from jobtier.logs import Unforeseen
from jobtier.metrics.histogram import Histogram
from jobtier.metrics.snapshot import Snapshot, labels
from jobtier.persist.db import UNAVAILABLE, Pool
from jobtier.runtime.backoff import PERSIST_POSTGRES, PERSIST_REDIS
from jobtier.runtime.stopping import stop_tasks
from jobtier.store.redis import RedisClient
from jobtier.streams.consumer import Fields, claim_idle, create_groups, read_group, wait_idle
from jobtier.streams.entries import MALFORMED, LogEntry, parse_entry
from jobtier.webhooks import marks, signing
from jobtier.webhooks.deliveries import Attempt, DeliveryStore, NewDelivery, Outcome
from jobtier.webhooks.safety import AddressPolicy, Resolver
from jobtier.webhooks.sender import Answer, Sender

log = logging.getLogger("jobtier.webhooks")

READ_COUNT = 200  # entries per shard per XREADGROUP
IDLE_SLEEP_MIN = 0.005
IDLE_SLEEP_MAX = 0.1
DUE_POLL = 1.0  # longest wait before looking for due retries again
RECORD_EVERY = 0.05  # outcomes are recorded in batches, at most this long after the attempt
SECRETS_TTL = 5.0  # a rotation reaches deliveries within this (the old secret still signs)
GAUGE_EVERY = 5.0
LEASE_MARGIN = 10.0  # a lease outlives the attempt's time limit by this much
JITTER = 0.1

# Postgres is unreachable or refusing work for now: keep the entries and try again later
PG_UNAVAILABLE: tuple[type[BaseException], ...] = (*UNAVAILABLE, asyncpg.PostgresError)
UNMARK_FAULTS: tuple[type[BaseException], ...] = (RedisError, *PG_UNAVAILABLE)


def group_name(keys: Keys) -> str:
    """The dispatchers' consumer group on every shard log."""
    return f"{keys.prefix}-dispatcher"


async def ensure_group(redis: RedisClient, keys: Keys, start: str = "0") -> None:
    """Create the dispatchers' group on every shard log if missing. The API calls it (with
    ``$``) before it accepts the first webhook, so that the logs keep the entries a
    dispatcher will need even before one first runs."""
    streams = [keys.log(s) for s in range(keys.shards)]
    await create_groups(redis, streams, group_name(keys), start)


def event_type(entry: LogEntry) -> str:
    """``job.<state>`` for a change of state (the submit included), ``job.updated`` for a
    change within one (progress, a cancel request)."""
    state = entry.status.state.value
    return f"job.{state}" if entry.from_state != state else "job.updated"


def delivery_id(job_id: str, version: int, target: str | None) -> str:
    """The webhook-id: one per (transition, target), the same however often it is made."""
    return f"msg_{job_id}_{version}_{target or 'job'}"


def body_of(entry: LogEntry, event: str) -> bytes:
    """``{"type", "timestamp", "data"}`` (the Standard Webhooks shape); data is the status
    document exactly as the status tier serves it."""
    stamp = msgspec.json.encode(entry.status.updated_at)
    return (
        b'{"type":"' + event.encode() + b'","timestamp":' + stamp + b',"data":' + entry.doc + b"}"
    )


@dataclass
class DispatcherStats:
    """What the dispatcher has done since it started (its metrics)."""

    entries: int = 0  # log entries read and handled
    skipped: int = 0  # of which acknowledged undecoded: their tenant is not marked
    lookups: int = 0  # target look-ups in Postgres (one per batch with a marked tenant)
    unmarked: int = 0  # tenants unmarked: they had no target left (webhooks/marks.py)
    claimed: int = 0  # entries taken over from idle dispatchers
    bad_entries: int = 0
    created: int = 0  # deliveries made
    attempts: dict[str, int] = field(default_factory=dict)  # by outcome
    pending: int = 0  # deliveries waiting in Postgres (refreshed every few seconds)
    latency: Histogram = field(default_factory=Histogram, repr=False)  # transition -> 2xx
    attempt_time: Histogram = field(default_factory=Histogram, repr=False)


class Dispatcher:
    """One member of the dispatchers' consumer group. ``await run()`` until ``stop()``.

    ``resolver`` replaces the system's DNS for the address checks (tests).
    """

    def __init__(
        self,
        settings: Settings,
        redis: RedisClient,
        pool: Pool,
        name: str,
        *,
        keys: Keys | None = None,
        resolver: Resolver | None = None,
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.store = DeliveryStore(pool)
        self.name = name
        self.keys = keys or Keys(settings.prefix, settings.shards)
        self.group = group_name(self.keys)
        self.policy = AddressPolicy(settings.webhook_allowed_hosts, resolver)
        self.sender = Sender(
            self.policy,
            timeout=settings.webhook_timeout_seconds,
            max_response_bytes=settings.webhook_max_response_bytes,
            max_connections=settings.webhook_concurrency,
        )
        self.schedule = settings.webhook_retry_delays()
        self.concurrency = settings.webhook_concurrency
        self._refill = max(1, self.concurrency // 4)
        self._more_due = False
        self.lease_seconds = settings.webhook_timeout_seconds + LEASE_MARGIN
        self.claim_idle_ms = int(settings.persist_claim_idle_seconds * 1000)
        self.stats = DispatcherStats()
        self._streams = [self.keys.log(s) for s in range(self.keys.shards)]
        self._cursor = [b"0"] * self.keys.shards  # b"0": own pending entries first
        self._claim_cursor = [b"0-0"] * self.keys.shards
        self._stop = asyncio.Event()
        self._waited_in_vain = False  # the last wait in Redis found nothing
        self._explain = Unforeseen(log)  # a traceback once per error class
        self._due = asyncio.Event()  # new deliveries were inserted: lease them now
        self._attempts: set[asyncio.Task[None]] = set()
        self._outcomes: list[Outcome] = []
        self._recorded = asyncio.Event()
        self._secrets: dict[str, tuple[float, list[str]]] = {}
        self._ready = False
        self._next_claim = 0.0

    # --- life cycle -----------------------------------------------------------------------
    def metrics(self) -> Snapshot:
        """This dispatcher's part of its process's metrics snapshot."""
        st = self.stats
        return Snapshot(
            "", "", 0.0,
            counters={
                "dispatcher_entries_total": {"": st.entries},
                "dispatcher_entries_skipped_total": {"": st.skipped},
                "dispatcher_target_lookups_total": {"": st.lookups},
                "dispatcher_tenants_unmarked_total": {"": st.unmarked},
                "dispatcher_claimed_total": {"": st.claimed},
                "dispatcher_bad_entries_total": {"": st.bad_entries},
                "webhook_deliveries_created_total": {"": st.created},
                "webhook_attempts_total": {labels(outcome=k): v for k, v in st.attempts.items()},
            },
            gauges={
                "webhook_deliveries_pending": {"": st.pending},
                "webhook_attempts_in_flight": {"": len(self._attempts)},
            },
            histograms={
                "webhook_delivery_latency_seconds": {"": st.latency.snapshot()},
                "webhook_attempt_seconds": {"": st.attempt_time.snapshot()},
            },
        )  # fmt: skip

    def stop(self) -> None:
        self._stop.set()
        self._due.set()

    async def setup(self) -> None:
        """The group, and the marks of every tenant Postgres has targets for (webhooks made
        before the marks existed). Entries are read only once this has succeeded."""
        await ensure_group(self.redis, self.keys)
        await marks.mark(self.redis, self.keys, await self.store.target_tenants())
        self._ready = True

    async def run(self) -> None:
        """Dispatch until ``stop()``; attempts in flight then get their time limit to end."""
        log.info("event=dispatcher_started name=%s shards=%d", self.name, self.keys.shards)
        parts = [
            asyncio.create_task(self._read_loop(), name="dispatcher-read"),
            asyncio.create_task(self._send_loop(), name="dispatcher-send"),
            asyncio.create_task(self._record_loop(), name="dispatcher-record"),
            asyncio.create_task(self._unmark_loop(), name="dispatcher-unmark"),
        ]
        try:
            await self._stop.wait()
            await asyncio.gather(parts[0], parts[1], parts[3])
            if self._attempts:
                await asyncio.wait(self._attempts, timeout=self.sender.timeout + 1)
            self._recorded.set()
            await parts[2]
        finally:
            # a part in a Redis or Postgres call can lose its cancellation (runtime/stopping.py)
            await stop_tasks([*parts, *self._attempts], "dispatcher")
            await self.sender.close()
        log.info("event=dispatcher_stopped name=%s", self.name)

    async def _sleep(self, seconds: float) -> bool:
        if seconds > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), seconds)
        return self._stop.is_set()

    async def _unmark_loop(self) -> None:
        """Every ``webhook_unmark_interval_seconds``, unmark the tenants left without a
        target (``marks.unmark_idle``: safe beside target creations and other dispatchers)."""
        every = self.settings.webhook_unmark_interval_seconds
        while every > 0 and not await self._sleep(every):
            try:
                removed = await marks.unmark_idle(self.redis, self.keys, self.store, every)
            except UNMARK_FAULTS as exc:  # the next round tries again
                log.warning("event=unmark_failed error=%r", exc)
                continue
            except Exception:  # a clean-up that fails must not stop the deliveries
                log.exception("event=unmark_crashed")
                continue
            self.stats.unmarked += removed
            if removed:
                log.info("event=tenants_unmarked count=%d", removed)

    # --- the logs -> deliveries -----------------------------------------------------------
    async def _read_loop(self) -> None:
        redis_backoff, pg_backoff = PERSIST_REDIS.start(), PERSIST_POSTGRES.start()
        idle = IDLE_SLEEP_MIN
        while not self._stop.is_set():
            try:
                if not self._ready:
                    await self.setup()
                # idle: wait in Redis for the next entry (as the persister does)
                moved = await self.step() or await self._wait_for_entries()
                redis_backoff.reset()
                pg_backoff.reset()
            except (RedisError, OSError) as exc:
                wait = redis_backoff.next()
                log.warning("event=redis_unavailable retry_in=%.1fs error=%r", wait, exc)
                self._reread()
                self._ready = False
                await self._sleep(wait)
                continue
            except PG_UNAVAILABLE as exc:
                wait = pg_backoff.next()
                log.warning("event=postgres_unavailable retry_in=%.1fs error=%r", wait, exc)
                self._reread()
                await self._sleep(wait)
                continue
            except Exception as exc:
                # anything else (Postgres refusing a statement, a bug of ours): never the end
                # of reading, which nothing else would do; its traceback once per class
                wait = pg_backoff.next()
                self._explain("event=read_failed", exc, wait)
                self._reread()
                self._ready = False
                await self._sleep(wait)
                continue
            if moved:
                idle = IDLE_SLEEP_MIN
            else:
                await self._sleep(idle)
                idle = min(idle * 2, IDLE_SLEEP_MAX)

    async def step(self) -> bool:
        """Claim idle entries now and then, read a batch, turn it into deliveries, acknowledge
        it. False when there was nothing to read."""
        taken: list[tuple[int, bytes, dict[bytes, bytes] | None]] = []
        now = time.monotonic()
        if now >= self._next_claim:
            self._next_claim = now + max(0.05, self.claim_idle_ms / 2000)
            taken += await self._claim()
        more = False
        if not self._waited_in_vain:  # else every stream was read just now, and had nothing
            more, read = await self._read()
            taken += read
        self._waited_in_vain = False
        if taken:
            await self.handle(taken)
        return more or bool(taken)

    async def drain(self) -> int:
        """Turn every entry readable now into deliveries (tests); returns entries handled."""
        if not self._ready:
            await self.setup()
        before = self.stats.entries
        while await self.step():
            pass
        return self.stats.entries - before

    async def _read(self) -> tuple[bool, list[tuple[int, bytes, Fields]]]:
        return await read_group(
            self.redis, self.group, self.name, self._streams, self._cursor, READ_COUNT
        )

    def _reread(self) -> None:
        """Read our own pending entries again from the start (after a failure: what was read
        but not acknowledged is among them)."""
        self._cursor = [b"0"] * len(self._streams)
        self._waited_in_vain = False

    async def _wait_for_entries(self) -> bool:
        """Idle: wait in Redis for the next entry of any stream, up to ``IDLE_SLEEP_MAX``
        (``group.wait_idle``), and handle what comes; True once waited. False when it cannot
        wait so (a Redis Cluster; our own pending entries still being read back) or must not
        (stopping): the caller naps instead."""
        if self._stop.is_set():
            return False
        items = await wait_idle(
            self.redis, self.group, self.name, self._streams, self._cursor, READ_COUNT,
            IDLE_SLEEP_MAX, self._sleep,
        )  # fmt: skip
        if items is None:
            return False
        if items:
            await self.handle(items)
        self._waited_in_vain = not items
        return True

    async def _claim(self) -> list[tuple[int, bytes, Fields]]:
        """Entries idle longer than the claim timeout in another member (it died)."""
        claimed = await claim_idle(
            self.redis, self.group, self.name, self._streams, self._claim_cursor,
            self.claim_idle_ms, 500,
        )  # fmt: skip
        out: list[tuple[int, bytes, Fields]] = []
        for shard, items in enumerate(claimed):
            mine = [(shard, entry_id, fields) for entry_id, fields in items]
            if mine:
                self.stats.claimed += len(mine)
                log.info(
                    "event=entries_claimed stream=%s count=%d", self._streams[shard], len(mine)
                )
            out += mine
        return out

    async def handle(self, taken: Sequence[tuple[int, bytes, dict[bytes, bytes] | None]]) -> None:
        """Deliveries for a batch of entries, inserted, then the entries acknowledged.
        Entries of tenants not marked (``webhooks/marks.py``) are acknowledged undecoded."""
        # the marks are read in a round trip of their own, after the read's reply: so a mark
        # written before a job's submit is seen with its entries (why: marks.marked)
        tenants = {f[b"tn"] for _, _, f in taken if f and b"tn" in f}
        wanted = await marks.marked(self.redis, self.keys, sorted(tenants))
        entries: list[LogEntry] = []
        for shard, entry_id, fields in taken:
            if not fields:  # trimmed while pending: nothing left to deliver
                continue
            tenant = fields.get(b"tn")
            if tenant is not None and tenant not in wanted:
                self.stats.skipped += 1  # no target can exist for it: acknowledged below
                continue
            try:
                entries.append(parse_entry(shard, entry_id, fields))
            except MALFORMED as exc:
                # acknowledged all the same (below): a pending entry nobody can read would
                # hold back the log's trimming for good
                self.stats.bad_entries += 1
                log.error(
                    "event=bad_log_entry stream=%s id=%s error=%r",
                    self._streams[shard], entry_id.decode(), exc,
                )  # fmt: skip
        deliveries = await self._deliveries(entries) if entries else []
        if deliveries:
            self.stats.created += await self.store.insert(deliveries)
            self._due.set()
        pipe = self.redis.pipeline(transaction=False)
        by_shard: dict[int, list[bytes]] = {}
        for shard, entry_id, _ in taken:
            by_shard.setdefault(shard, []).append(entry_id)
        for shard, ids in by_shard.items():
            pipe.xack(self._streams[shard], self.group, *ids)
        await pipe.execute()
        self.stats.entries += len(taken)

    async def _deliveries(self, entries: Sequence[LogEntry]) -> list[NewDelivery]:
        self.stats.lookups += 1
        subs, callbacks = await self.store.targets(
            sorted({e.tenant for e in entries}), sorted({e.status.id for e in entries})
        )
        by_tenant: dict[str, list[Any]] = {}
        for s in subs:
            by_tenant.setdefault(s["tenant"], []).append(s)
        by_job = {c["job_id"]: c for c in callbacks}
        out: list[NewDelivery] = []
        for e in entries:
            terminal = e.status.state in TERMINAL
            at = datetime.fromtimestamp(e.ms / 1000, UTC)
            targets: list[tuple[str | None, str]] = []
            cb = by_job.get(e.status.id)
            if cb is not None and cb["tenant"] == e.tenant and (terminal or cb["events"] == "all"):
                targets.append((None, cb["url"]))
            for s in by_tenant.get(e.tenant, ()):
                # a subscription sees the transitions made after it was created
                if (terminal or s["events"] == "all") and s["created_at"] <= at:
                    targets.append((s["id"], s["url"]))
            if not targets:
                continue
            event = event_type(e)
            body = body_of(e, event)
            for sub_id, url in targets:
                out.append(NewDelivery(
                    delivery_id(e.status.id, e.status.version, sub_id), e.tenant, e.status.id,
                    e.status.version, sub_id, url, event, body, at,
                ))  # fmt: skip
        return out

    # --- deliveries -> HTTP ---------------------------------------------------------------
    async def _send_loop(self) -> None:
        backoff = PERSIST_POSTGRES.start()
        next_gauge = 0.0
        while not self._stop.is_set():
            self._due.clear()
            try:
                if time.monotonic() >= next_gauge:
                    next_gauge = time.monotonic() + GAUGE_EVERY
                    self.stats.pending, _ = await self.store.pending()
                free = self.concurrency - len(self._attempts)
                asked = min(free, 500)
                leased = await self.store.lease_due(asked, self.lease_seconds)
                # a full lease may have left due ones behind: freed slots ask again
                self._more_due = asked > 0 and len(leased) == asked
                backoff.reset()
            except PG_UNAVAILABLE as exc:
                wait = backoff.next()
                log.warning("event=postgres_unavailable retry_in=%.1fs error=%r", wait, exc)
                await self._sleep(wait)
                continue
            for attempt in leased:
                task = asyncio.create_task(self._attempt(attempt), name=f"webhook {attempt.id}")
                self._attempts.add(task)
                task.add_done_callback(self._attempt_done)
            if leased and len(leased) == free:
                continue  # more may be due: look again as soon as a slot frees
            if not leased or len(self._attempts) < self.concurrency:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._due.wait(), DUE_POLL)

    def _attempt_done(self, task: asyncio.Task[None]) -> None:
        self._attempts.discard(task)
        if self._more_due and self.concurrency - len(self._attempts) >= self._refill:
            # lease again once a quarter of the slots are free, not per slot (one query
            # per freed slot would cost more than the attempts) and not at the next poll
            self._due.set()
        if not task.cancelled() and task.exception() is not None:
            log.error("event=attempt_crashed error=%r", task.exception())

    async def _secrets_for(self, tenant: str) -> list[str]:
        now = time.monotonic()
        cached = self._secrets.get(tenant)
        if cached is None or cached[0] < now:
            found = await self.store.secrets([tenant])
            cached = (now + SECRETS_TTL, found.get(tenant, []))
            self._secrets[tenant] = cached
        return cached[1]

    async def _attempt(self, a: Attempt) -> None:
        """One attempt: sign, POST, and queue its outcome for recording."""
        try:
            secrets = await self._secrets_for(a.tenant)
        except PG_UNAVAILABLE as exc:
            log.warning("event=secrets_unavailable delivery=%s error=%r", a.id, exc)
            return  # the lease runs out and the delivery comes due again
        if secrets:
            headers = signing.headers(secrets, a.id, int(time.time()), a.body)
            answer = await self.sender.post(a.url, headers, a.body)
        else:
            answer = Answer(None, 0.0, "the tenant has no signing secret")
        self.stats.attempt_time.observe(answer.duration_ms / 1000)
        self._outcome(a, answer)

    def _outcome(self, a: Attempt, answer: Answer) -> None:
        now = datetime.now(UTC)
        made = a.attempts + 1
        status = answer.status
        next_at: datetime | None = None
        if status is not None and 200 <= status < 300:
            state, kind = "delivered", "delivered"
            self.stats.latency.observe(max(0.0, (now - a.occurred_at).total_seconds()))
        elif status == 410:
            # the receiver wants no more (Standard Webhooks): its subscription is disabled
            state, kind = "failed", "gone"
            if a.subscription_id is not None:
                task = asyncio.create_task(self._disable(a.subscription_id))
                self._attempts.add(task)
                task.add_done_callback(self._attempts.discard)
        elif made > len(self.schedule):
            state, kind = "failed", "failed"
        else:
            delay = self.schedule[made - 1] * random.uniform(1 - JITTER, 1 + JITTER)
            if answer.retry_after is not None:
                delay = min(max(delay, answer.retry_after), max(self.schedule))
            state, kind = "pending", "refused" if answer.refused else "retried"
            next_at = now + timedelta(seconds=delay)
        self.stats.attempts[kind] = self.stats.attempts.get(kind, 0) + 1
        log.log(
            logging.DEBUG if state == "delivered" else logging.INFO,
            "event=webhook_attempt delivery=%s job=%s attempt=%d status=%s outcome=%s error=%s",
            a.id, a.job_id, made, status, kind, answer.error,
        )  # fmt: skip
        self._outcomes.append(Outcome(
            a.id, a.lease, state, now, answer.duration_ms, status, answer.error, answer.body,
            next_at,
        ))  # fmt: skip
        if len(self._outcomes) >= 200:
            self._recorded.set()

    async def _disable(self, subscription_id: str) -> None:
        with contextlib.suppress(*PG_UNAVAILABLE):
            await self.store.disable_subscription(subscription_id)
            log.info("event=subscription_disabled id=%s reason=410", subscription_id)

    async def _record_loop(self) -> None:
        """Record outcomes in batches. An outcome Postgres will not take stays queued; if the
        dispatcher dies first, the delivery's lease runs out and it is attempted again."""
        backoff = PERSIST_POSTGRES.start()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._recorded.wait(), RECORD_EVERY)
            self._recorded.clear()
            stopping = self._stop.is_set() and not self._attempts
            todo, self._outcomes = self._outcomes, []
            if todo:
                try:
                    await self.store.record(todo)
                    backoff.reset()
                    self._due.set()  # a retry due at once (a schedule of 0 s) goes now
                except PG_UNAVAILABLE as exc:
                    self._outcomes[:0] = todo
                    if stopping:
                        return
                    wait = backoff.next()
                    log.warning("event=record_failed retry_in=%.1fs error=%r", wait, exc)
                    await asyncio.sleep(wait)
                    continue
            if stopping and not self._outcomes:
                return
