"""The outbox relay: jobs an application submitted in its own transaction -> Redis.

``jobtier.submit(...)`` (``migrations/0010_outbox.sql``) writes an outbox row in the caller's
transaction and notifies ``jobtier_outbox`` at its commit. The relay listens on that channel
and reads committed rows in batches (``FOR UPDATE SKIP LOCKED``: relays in several persisters
share them), submits each into Redis under the job id the row was given and an idempotency
key, then marks the rows relayed in the same Postgres transaction that locked them.

Crash safety: a relay that dies after its Redis submit and before its commit leaves the rows
unmarked (Postgres rolls the transaction back when the connection drops); the next pass
submits them again with the same id and key, and Redis answers with the job it made the
first time (``created`` false): one job, not two. The key is the caller's idempotency key,
else the job id itself (the outbox row's id).

What only the relay can check (the task catalogue: an unknown type, a payload the task's
schema refuses or too large, an encrypted task this persister has no keys for) is refused
here: the row keeps the reason, and the job reads as ``failed`` with it (``outbox_docs.py``).
A row waiting for a job that is itself a row not relayed yet (another relay holds it) stays
pending for a later pass. While the API would refuse every submit (too many jobs waiting,
Redis's memory nearly full: ``outbox_gate.py``) the relay takes no rows.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import msgspec

from jobtier.config import Settings
from jobtier.core.errors import ConfigError, IdempotencyConflict, InvalidRequest, UnknownTask
from jobtier.core.json_depth import MAX_JSON_DEPTH, nests_deeper
from jobtier.core.model import JobSpec, Priority, Submitted
from jobtier.core.sealing import KeysNotConfigured
from jobtier.engine.catalog import TaskCatalog
from jobtier.engine.produce import Producer
from jobtier.engine.validate import MAX_ATTEMPTS_LIMIT
from jobtier.logs import Unforeseen
from jobtier.metrics.snapshot import Snapshot, labels
from jobtier.persist.db import UNAVAILABLE, AnyConnection, Connection, Pool, connect, query
from jobtier.persist.outbox_docs import outbox_docs
from jobtier.persist.outbox_gate import RelayGate
from jobtier.runtime.backoff import PERSIST_POSTGRES
from jobtier.runtime.loop import FAULTS, wait_for
from jobtier.store import durable
from jobtier.store.calls import SubmitItem
from jobtier.store.context import Store
from jobtier.store.durable import Unreplicated
from jobtier.store.redis import RedisClient

log = logging.getLogger("jobtier.persist.outbox")

CHANNEL = "jobtier_outbox"
PAYLOAD_DEPTH = MAX_JSON_DEPTH - 1  # a payload as deep as a submit's body may hold it
PRUNE_EVERY = 60.0  # seconds between deletions of rows that served their time
PRUNE_BATCH = 5000  # rows deleted per statement (short locks, short transactions)
LISTEN_RETRY = 10.0  # seconds between attempts to listen again while Postgres refuses
# A row of a type no worker has advertised (with JOBTIER_REQUIRE_KNOWN_TYPES) waits this long
# from its call for one before it is refused: its caller's transaction has committed, and a
# producer deployed before the task's first worker would otherwise lose its jobs. It is
# left out of the relay's reads until then (0023_outbox_waiting_for_a_worker.sql), or until
# a worker advertises its type, which every pass looks for.
UNKNOWN_TYPE_PATIENCE = 600.0
# A row waiting for a row not relayed yet (its depends_on) is left out for a tenth of its
# age so far, within these bounds, so that such rows cannot fill every batch while what they
# wait for waits (a row waiting for a worker of its type: up to UNKNOWN_TYPE_PATIENCE), nor
# be written again five times a second all that while
DEPENDENT_RECHECK = (0.2, 5.0)
_payload = msgspec.json.Decoder()

# a pass that failed for Redis' or Postgres' sake, or for a Redis not fit to run on: the
# rows stay in the outbox, and the pass is tried again after a back-off
RETRIED: tuple[type[BaseException], ...] = (
    *UNAVAILABLE,
    *FAULTS,
    asyncpg.PostgresError,
    ConfigError,
)

AfterSubmit = Callable[[Sequence[str]], Awaitable[None] | None]
"""Called with the ids just submitted into Redis, before the rows are marked (tests inflict a
crash there)."""
OnEnded = Callable[[AnyConnection, Sequence[tuple[str, bytes]]], Awaitable[int]]
"""What the webhooks make of rows that end in the outbox, refused or cancelled, in the
transaction that ends them: (connection, [(tenant, status document)]) -> deliveries made
(webhooks/deliveries.py: deliver_ended; given by the process that runs the relay)."""


@dataclass(slots=True)
class RelayStats:
    """Counts since start: the ``jobtier_outbox_*`` metrics of the persister's process."""

    relayed: int = 0  # rows submitted into Redis and marked
    duplicates: int = 0  # of those, Redis already had (a pass after a crash)
    refused: int = 0  # rows refused for their content: their jobs are failed
    batches: int = 0
    # rows left pending: a job they wait for is a row not relayed yet, or no worker has
    # advertised their type yet
    deferred: int = 0
    paused: dict[str, int] = field(default_factory=dict)  # passes that took no rows, by why
    errors: dict[str, int] = field(default_factory=dict)  # failed passes, by error class

    def snapshot(self) -> Snapshot:
        counters: dict[str, dict[str, float]] = {
            name: {"": n}
            for name, n in (
                ("outbox_relayed_total", self.relayed),
                ("outbox_duplicates_total", self.duplicates),
                ("outbox_refused_total", self.refused),
                ("outbox_batches_total", self.batches),
                ("outbox_deferred_total", self.deferred),
            )
        }
        counters["outbox_paused_total"] = {labels(reason=k): v for k, v in self.paused.items()}
        counters["outbox_errors_total"] = {labels(error=k): v for k, v in self.errors.items()}
        return Snapshot("", "", 0.0, counters=counters)


class OutboxRelay:
    """Relays committed outbox rows until ``stop()``. ``drain()`` relays what is there now.

    ``producer`` prepares and submits (its task catalogue refuses unknown types and bad
    payloads, as the API's does). ``after_submit`` is the test hook of the crash window.
    """

    def __init__(
        self,
        settings: Settings,
        pool: Pool,
        producer: Producer,
        *,
        batch_size: int | None = None,
        poll: float | None = None,
        after_submit: AfterSubmit | None = None,
        on_relayed: Callable[[Sequence[str], float], None] | None = None,
        on_ended: OnEnded | None = None,
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.producer = producer
        self.batch_size = max(1, batch_size or settings.outbox_batch_size)
        self.poll = poll if poll is not None else settings.outbox_poll_seconds
        self.after_submit = after_submit
        self.on_relayed = on_relayed  # (ids, wall time of the commit) after each batch
        self.on_ended = on_ended  # the webhooks of refused rows
        self.stats = RelayStats()
        self.stopping = asyncio.Event()
        self._wake = asyncio.Event()
        self._recorded = False
        self.taken = 0  # rows the last pass took (handled or left for later)
        self._waiting_types: set[str] = set()  # types of rows left waiting for a worker
        self._catalog: TaskCatalog | None = None
        self._explain = Unforeseen(log)
        self.gate = RelayGate(settings, producer.store)

    @classmethod
    def of_persister(
        cls, settings: Settings, redis: RedisClient, pool: Pool, on_ended: OnEnded | None = None
    ) -> OutboxRelay:
        """The relay a persister runs, on its Redis client and Postgres pool: submits checked
        against the task catalogue as the API checks them."""
        store = Store(settings, redis)
        catalog = TaskCatalog(redis, store.keys, ttl=settings.task_catalog_ttl)
        producer = Producer(store, catalog, settings.require_known_types, None)
        relay = cls(settings, pool, producer, on_ended=on_ended)
        relay._catalog = catalog
        return relay

    def stop(self) -> None:
        self.stopping.set()
        self._wake.set()

    def metrics(self) -> Snapshot:
        return self.stats.snapshot()

    # --- the loop -------------------------------------------------------------------------
    async def run(self) -> None:
        """Listen, relay, prune until ``stop()``; Postgres or Redis away: retried after a
        back-off (the rows wait in the outbox meanwhile)."""
        log.info("event=outbox_relay_started batch=%d", self.batch_size)
        listener: Connection | None = None  # a connection of its own, for LISTEN
        listen_at = 0.0  # when to try to listen again after a failure
        backoff = PERSIST_POSTGRES.start()
        next_prune = 0.0
        ready = False
        try:
            while not self.stopping.is_set():
                if (listener is None or listener.is_closed()) and time.monotonic() >= listen_at:
                    listener = await self._listen()
                    if listener is None:
                        listen_at = time.monotonic() + LISTEN_RETRY
                    self._wake.set()  # rows committed while nobody listened
                try:
                    if not ready:  # the submit scripts, and what workers advertise
                        await self.producer.store.scripts.load()
                        if self._catalog is not None:
                            await self._catalog.load()
                            self._catalog.start()
                        ready = True
                    if time.monotonic() >= next_prune:
                        next_prune = time.monotonic() + PRUNE_EVERY
                        await self.prune()
                    self._wake.clear()
                    while True:  # as long as passes take full batches
                        await self.relay_once()
                        if self.taken < self.batch_size:
                            break
                        if self.stopping.is_set():
                            return
                    backoff.reset()
                except Exception as exc:
                    # Redis or Postgres away, or Redis refusing (a tenant over its waiting
                    # cap): the rows wait; anything else is a bug, its stack logged once a class
                    wait = backoff.next()
                    self._count(exc)
                    if isinstance(exc, RETRIED):
                        log.warning("event=outbox_relay_failed retry_in=%.1fs error=%r", wait, exc)
                    else:
                        self._explain("event=outbox_relay_failed", exc, wait)
                    await self._sleep(wait)
                    continue
                # a notification, or the poll interval as a safety net for a lost one
                await wait_for(self._wake, self.poll)
        finally:
            if listener is not None:
                listener.terminate()
            if ready and self._catalog is not None:
                await self._catalog.stop()
            log.info("event=outbox_relay_stopped relayed=%d", self.stats.relayed)

    async def _listen(self) -> Connection | None:
        """A connection of its own listening for commits (not the pool's: it would hold one
        of the persister's for good); None when Postgres cannot be reached now: the relay
        polls every ``poll`` seconds meanwhile."""
        conn: Connection | None = None
        try:
            conn = await connect(self.settings.database_url, timeout=10)
            await conn.add_listener(CHANNEL, self._notified)
        except RETRIED as exc:
            if conn is not None:
                conn.terminate()
            log.warning(
                "event=outbox_listen_failed retry_in=%.0fs polling_every=%.1fs error=%r",
                LISTEN_RETRY, self.poll, exc,
            )  # fmt: skip
            return None
        return conn

    def _notified(self, *_: Any) -> None:
        self._wake.set()

    async def _sleep(self, seconds: float) -> None:
        await wait_for(self.stopping, seconds)

    def _count(self, exc: BaseException) -> None:
        name = type(exc).__name__
        self.stats.errors[name] = self.stats.errors.get(name, 0) + 1

    async def drain(self) -> int:
        """Relay every row committed now (tests, benchmarks); the rows handled (rows left
        pending, for a dependency not relayed yet or a worker of their type, are not: they
        may remain)."""
        total = 0
        while True:
            total += await self.relay_once()
            if not self.taken:
                return total

    # --- one batch ------------------------------------------------------------------------
    async def relay_once(self) -> int:
        """Lock a batch of committed rows, submit them into Redis, mark them, commit; the rows
        handled (0: none waiting). An error (Redis or Postgres away) leaves every row of the
        batch as it was: the next pass submits them again, idempotently."""
        record = not self._recorded
        self.taken = 0
        done = Pass()
        released: list[str] = []
        paused = await self.gate.closed()
        if paused is not None:
            self.stats.paused[paused] = self.stats.paused.get(paused, 0) + 1
            if not record:
                return 0
        rows: Sequence[asyncpg.Record] = ()
        async with self.pool.acquire() as conn, conn.transaction():
            if record:  # jobtier.submit makes ids of this many shards and checks these limits
                s = self.settings  # (it cannot read ours)
                limits = (
                    s.shards, s.max_payload_bytes, s.max_flow_jobs, s.max_future_seconds,
                    MAX_ATTEMPTS_LIMIT,
                )  # fmt: skip
                await conn.execute(query("outbox_record_config"), *limits)
                # rows an earlier relay left waiting for a worker of their type
                self._waiting_types.update(await self._waiting_for_a_worker(conn))
            if paused is None:
                released = await self._release_known(conn)
                rows = await conn.fetch(query("outbox_take"), self.batch_size)
            if rows:
                done = await self._submit(conn, rows)
                if done.waiting:
                    ids = [job_id for job_id, _ in done.waiting]
                    await conn.execute(query("outbox_wait"), ids, UNKNOWN_TYPE_PATIENCE)
                if done.later:
                    ids, waited = [i for i, _ in done.later], [w for _, w in done.later]
                    least, most = DEPENDENT_RECHECK
                    later = [min(max(w / 10, least), most) for w in waited]
                    await conn.execute(query("outbox_later"), ids, later)
                if self.after_submit is not None:
                    submitted = self.after_submit(done.relayed)
                    if submitted is not None:
                        await submitted
                if done.relayed:
                    await conn.execute(query("outbox_relayed"), done.relayed)
                if done.refused:
                    ids, reasons = [i for i, _ in done.refused], [r for _, r in done.refused]
                    await conn.execute(query("outbox_refused"), ids, reasons)
                    if self.on_ended is not None:  # their webhooks, in this transaction
                        ended = await outbox_docs(ids, conn, relayed=False)
                        await self.on_ended(conn, list(ended.values()))
        self._recorded = True  # committed
        self._waiting_types.difference_update(released)
        self.taken = len(rows)
        if not rows:
            return 0
        self._waiting_types.update(job_type for _, job_type in done.waiting)
        stats = self.stats
        stats.batches += 1
        stats.relayed += len(done.relayed)
        stats.duplicates += done.duplicates
        stats.refused += len(done.refused)
        stats.deferred += len(done.later) + len(done.waiting)
        self.gate.admitted(len(done.relayed))
        for job_id, job_type in done.waiting:
            log.info(
                "event=outbox_job_waiting job=%s type=%s: no worker has advertised its type "
                "yet; it waits for one up to %gs from its submit",
                job_id,
                job_type,
                UNKNOWN_TYPE_PATIENCE,
            )
        for job_id, reason in done.refused:
            log.warning("event=outbox_job_refused job=%s reason=%r", job_id, reason)
        if self.on_relayed is not None:
            self.on_relayed(done.relayed, time.time())
        # rows left pending are not counted: a pass of only those is "nothing to do now"
        return len(done.relayed) + len(done.refused)

    @staticmethod
    async def _waiting_for_a_worker(conn: AnyConnection | Pool) -> list[str]:
        """The types of rows left out until a worker of their type comes (outbox_wait)."""
        types: list[str] = await conn.fetchval(query("outbox_waiting_types"), UNKNOWN_TYPE_PATIENCE)
        return types

    async def _release_known(self, conn: AnyConnection) -> list[str]:
        """The types of rows left waiting that a worker has advertised since: their rows
        are read again from now on."""
        if not self._waiting_types:
            return []
        await self.producer.ensure_known(self._waiting_types)
        known = [t for t in self._waiting_types if self.producer.known(t)]
        if known:
            await conn.execute(query("outbox_release"), known)
        return known

    async def _submit(self, conn: AnyConnection, rows: Sequence[asyncpg.Record]) -> Pass:
        """Submit ``rows`` into Redis: what became of each."""
        done = Pass()
        refused = done.refused
        plain: list[SubmitItem] = []
        linked: list[SubmitItem] = []
        waited = {r["id"]: r["waited"] for r in rows}
        await self.producer.ensure_known({r["type"] for r in rows})
        for row in rows:
            try:
                item = self._prepare(row)
            except UnknownTask as exc:
                if row["waited"] < UNKNOWN_TYPE_PATIENCE:
                    done.waiting.append((row["id"], row["type"]))
                    continue
                reason = f"{exc} (it waited {row['waited']:.0f}s for one)"
                refused.append((row["id"], _reason(InvalidRequest(reason))))
                continue
            except (InvalidRequest, KeysNotConfigured) as exc:
                # the row's own fault, or an encrypted task without keys here: refused alone,
                # not a failed pass that would hold back every row after it for good
                refused.append((row["id"], _reason(exc)))
                continue
            except ROW_FAULTS as exc:  # a row no check foresaw: refused alone all the same
                log.exception("event=outbox_row_unreadable job=%s", row["id"])
                refused.append((row["id"], _reason(Unreadable(exc))))
                continue
            # anything else fails the pass, as a fault of ours would: the rows wait, unrefused
            # a job waiting for others is checked against them in Redis, which may be rows of
            # this very batch: those go one by one, after the others, in the order written
            (linked if item.depends_on else plain).append(item)
        relayed = done.relayed
        groups: list[list[SubmitItem]] = _by_tenant(plain) + [[item] for item in linked]
        for group in groups:
            try:
                outcomes = await self._submit_group(group)
            except InvalidRequest as exc:  # a dependency unknown in Redis (one item)
                item = group[0]
                # a row another relay holds (or this pass left pending) is not relayed yet
                deps = list(item.depends_on)
                if await conn.fetchval(query("outbox_unrelayed"), deps, item.tenant):
                    done.later.append((item.job_id, waited[item.job_id]))
                    continue
                # one that never reached Redis, refused or cancelled: named as such
                ended = await conn.fetchval(query("outbox_ended"), deps, item.tenant)
                why = exc if ended is None else InvalidRequest(f"depends_on names {ended}")
                refused.append((item.job_id, _reason(why)))
                continue
            for item, outcome in zip(group, outcomes, strict=True):
                if outcome.job_id != item.job_id:  # the key names a job submitted otherwise
                    what = (
                        str(outcome)
                        if isinstance(outcome, IdempotencyConflict)
                        else f"idempotency key {item.idempotency_key!r} already names job "
                        f"{outcome.job_id}, submitted another way"
                    )
                    refused.append((item.job_id, f"refused by the outbox relay: {what}"))
                    continue
                relayed.append(item.job_id)
                # ours, from a pass that died before its commit (a conflict: its spec then
                # differed, e.g. a run-at that has since come)
                if isinstance(outcome, IdempotencyConflict) or not outcome.created:
                    done.duplicates += 1
        return done

    async def _submit_group(self, group: list[SubmitItem]) -> list[Submitted | IdempotencyConflict]:
        """Submit ``group``; with JOBTIER_SUBMIT_REPLICAS, only once its writes reached that
        many replicas (``store/durable.py``), else ``Unreplicated``: the pass fails and its
        rows stay in the outbox, relayed again later (the same ids: no second job)."""
        wanted = self.settings.submit_replicas
        with durable.waiting(wanted, self.settings.submit_replicas_timeout_ms) as state:
            outcomes = await self.producer.submit_prepared(group, batch=len(group) > 1)
        if state.short:
            raise Unreplicated(
                f"{state.confirmed or 0} of {wanted} replicas confirmed the relayed jobs within "
                f"{state.timeout_ms} ms (JOBTIER_SUBMIT_REPLICAS)"
            )
        return outcomes

    def _prepare(self, row: asyncpg.Record) -> SubmitItem:
        run_at = _run_at(row["run_at"])
        if nests_deeper(row["payload"], PAYLOAD_DEPTH):
            raise InvalidRequest(
                f"payload nests arrays and objects deeper than {PAYLOAD_DEPTH} levels (the "
                f"limit of a submit's body, {MAX_JSON_DEPTH}, less the body's own)",
                field="payload",
            )
        try:
            payload = _payload.decode(row["payload"])
        except msgspec.DecodeError as exc:  # Postgres checked it is JSON: not ours to read
            raise InvalidRequest(f"payload: {exc}", field="payload") from None
        spec = JobSpec(
            type=row["type"],
            payload=payload,
            priority=Priority(row["priority"]),
            run_at=run_at,
            max_attempts=row["max_attempts"],
            queue=row["queue"],
            depends_on=list(row["depends_on"]) if row["depends_on"] is not None else None,
            # the outbox row's id when the caller gave none: a relay's second submit of the
            # row finds its first
            idempotency_key=row["idempotency_key"] or row["id"],
        )
        return self.producer.prepare(spec, row["tenant"], row["id"])

    async def prune(self) -> int:
        """Delete rows whose idempotency keys Redis has forgotten, and refused rows once
        finished jobs' retention is over; the rows deleted. The types of rows left waiting
        for a worker are read again: a type whose rows were all refused (no worker came) or
        relayed by another relay is no longer looked for in the catalogue at every pass."""
        self._waiting_types = set(await self._waiting_for_a_worker(self.pool))
        now = datetime.now(UTC)
        relayed = now - timedelta(seconds=self.settings.idempotency_ttl_seconds)
        days = self.settings.pg_job_retention_days
        refused = now - timedelta(days=days) if days > 0 else None
        total = 0
        while True:
            status = await self.pool.execute(query("outbox_prune"), relayed, refused, PRUNE_BATCH)
            deleted = int(status.rsplit(" ", 1)[-1])
            total += deleted
            if deleted < PRUNE_BATCH or self.stopping.is_set():
                return total

    async def pending(self) -> int:
        """Rows committed and not yet relayed."""
        return int(await self.pool.fetchval(query("outbox_pending")))


@dataclass(slots=True)
class Pass:
    """What a pass made of the rows it took: relayed (ids), refused (id, reason), how many
    of those relayed Redis had already, and the rows left for later: ``later``, waiting for
    a row not relayed yet; ``waiting`` (id, type), for a worker of their type."""

    relayed: list[str] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)
    duplicates: int = 0
    later: list[tuple[str, float]] = field(default_factory=list)  # (id, seconds since its call)
    waiting: list[tuple[str, str]] = field(default_factory=list)


def _reason(exc: Exception) -> str:
    return f"refused by the outbox relay: {exc}"


# What a row's own content can raise in ``_prepare`` that no check of its names: refused alone.
# (No I/O happens there: an outage cannot raise these. A defect of ours raising something
# else fails the pass instead, and every row waits for a fix rather than failing for good.)
ROW_FAULTS = (ValueError, TypeError, OverflowError, RecursionError, msgspec.MsgspecError)


class Unreadable(Exception):
    """A row the relay could not make a job of, for a reason no check of its foresaw."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(f"the row could not be read ({type(cause).__name__}: {cause})")


def _run_at(epoch: float | None) -> datetime | None:
    """The row's run-at (seconds since the epoch, as ``outbox_take`` reads it); None when
    none was given or its time came while it waited in the outbox (due now). A time no job
    can have (an infinity, past what a date holds) is the row's fault: refused alone."""
    if epoch is None or epoch <= time.time():  # -infinity and years BC: past, due now
        return None
    try:
        return datetime.fromtimestamp(epoch, UTC)  # later than allowed: the producer says so
    except (OverflowError, OSError, ValueError):  # infinity, or past year 9999
        raise InvalidRequest(
            "run_at is not a time a job can have (infinity, or past year 9999)", field="run_at"
        ) from None


def _by_tenant(items: Sequence[SubmitItem]) -> list[list[SubmitItem]]:
    """A submit goes for one tenant (its dependencies and callbacks are checked as its)."""
    groups: dict[str, list[SubmitItem]] = {}
    for item in items:
        groups.setdefault(item.tenant, []).append(item)
    return list(groups.values())
