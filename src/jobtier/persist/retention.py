"""Retention of the durable record: Postgres keeps what the settings say, not everything.

One pass (``prune``) does, in this order:

1. **Partitions ahead.** ``job_transitions`` is partitioned by UTC day on ``at``; a partition
   is kept ready from yesterday to ``PARTITIONS_AHEAD`` days ahead, so the default partition
   (which takes any row no daily one covers) stays empty. Each is created as a plain table
   and then attached: ATTACH takes only SHARE UPDATE EXCLUSIVE on the parent, which the
   persister's inserts do not conflict with (``CREATE TABLE … PARTITION OF`` would take
   ACCESS EXCLUSIVE). The default partition's rows for that day move in first (ATTACH would
   refuse them).
2. **History.** Partitions that end ``pg_history_retention_days`` ago are dropped (or
   detached, with ``pg_history_detach``). DETACH CONCURRENTLY is refused on a table with a
   default partition, and a plain DROP or DETACH takes ACCESS EXCLUSIVE on the parent: waiting
   for it would queue the persister's inserts behind it. So every DDL statement runs with a
   short ``lock_timeout``: behind a long transaction it gives up, and the partition is tried
   again later (reported as skipped). Old rows of the default partition go in small batches.
3. **Finished jobs** that finished ``pg_job_retention_days`` ago are deleted, in one pass over
   the jobs created before then in created_at order, a window per transaction (no index
   covers a job's state or when it finished), skipping rows a persister holds (SKIP LOCKED);
   their results go with them (ON DELETE CASCADE). Unfinished jobs are never deleted.

A partition per day: retention is set in days, and a history read by job id probes an
index per partition (hourly ones would burden every plan; weekly ones keep a week too long).

One pass at a time across every persister and ``jobtier prune``: a pass holds a session
advisory lock (``PRUNE_LOCK``), and another finds it taken and skips its turn. The persister
runs a pass at start and every ``prune_interval_seconds`` (``run_pruning``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta

import asyncpg

from jobtier.config import Settings
from jobtier.persist.db import (
    MIGRATION_LOCK,
    UNAVAILABLE,
    AnyConnection,
    Connection,
    close,
    connect,
    query,
    rows_affected,
)
from jobtier.runtime.loop import wait_for

log = logging.getLogger("jobtier.persist.retention")

PARTITIONS_AHEAD = 7  # days of daily history partitions kept ready beyond today
DELETE_BATCH = 1000  # rows deleted per transaction (jobs: rows read per window)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)  # before any job: where a pass's first window starts
LOCK_TIMEOUT_MS = 500  # the longest a DDL statement may hold up writes queued behind it
DDL_TRIES = 3  # attempts per partition and pass before it is reported as skipped
DDL_RETRY_PAUSE = 0.5  # seconds between them
RETRY_AFTER_FAILURE = 60.0  # seconds before the persister tries a failed pass again
PRUNE_LOCK = MIGRATION_LOCK + 1  # pg_try_advisory_lock key: one pass at a time
PARTITION_PREFIX = "job_transitions_p"


@dataclass(frozen=True, slots=True)
class Partition:
    """A partition of ``job_transitions``: [lower, upper), None for MINVALUE/MAXVALUE."""

    name: str
    lower: datetime | None
    upper: datetime | None
    is_default: bool = False


@dataclass(slots=True)
class PruneReport:
    """What a pass did (or, with ``dry_run``, would do)."""

    dry_run: bool
    history_cutoff: datetime | None  # None: history kept forever
    jobs_cutoff: datetime | None  # None: finished jobs kept forever
    detach: bool = False
    created: list[str] = field(default_factory=list)
    removed: dict[str, int | None] = field(default_factory=dict)  # partition -> rows if counted
    skipped: list[str] = field(default_factory=list)  # partitions whose lock timed out
    default_rows: int = 0  # old rows deleted from the default partition
    jobs: int = 0  # finished jobs deleted

    def lines(self) -> list[str]:
        """A human summary, one line per change (what would change, for a dry run)."""
        dry = self.dry_run
        verbs = ("detach", "detached") if self.detach else ("drop", "dropped")
        drop = f"would {verbs[0]}" if dry else verbs[1]
        delete, create = ("would delete", "would create") if dry else ("deleted", "created")
        out = []
        if self.history_cutoff is None:
            out.append("history: kept forever (JOBTIER_PG_HISTORY_RETENTION_DAYS=0)")
        else:
            out.append(f"history: rows before {self.history_cutoff:%Y-%m-%d %H:%M} UTC expire")
        for name, rows in self.removed.items():
            count = f" ({rows} rows)" if rows is not None else ""
            out.append(f"  {drop} partition {name}{count}")
        for name in self.skipped:
            out.append(f"  skipped partition {name}: its lock was busy; tried again next pass")
        out.append(f"  {delete} {self.default_rows} rows of the default partition")
        for name in self.created:
            out.append(f"  {create} partition {name}")
        if self.jobs_cutoff is None:
            out.append("finished jobs: kept forever (JOBTIER_PG_JOB_RETENTION_DAYS=0)")
        else:
            out.append(
                f"finished jobs: {delete} {self.jobs} that finished before "
                f"{self.jobs_cutoff:%Y-%m-%d %H:%M} UTC"
            )
        return out


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _literal(at: datetime) -> str:
    return "'" + at.astimezone(UTC).isoformat() + "'"


def _day_start(day: date) -> datetime:
    return datetime.combine(day, time(), tzinfo=UTC)


def partition_name(day: date) -> str:
    return f"{PARTITION_PREFIX}{day:%Y%m%d}"


async def partitions(conn: AnyConnection) -> list[Partition]:
    """Every partition of ``job_transitions`` with its bounds, from the catalog."""
    rows = await conn.fetch(query("history_partitions"))
    return [Partition(r["name"], r["lower"], r["upper"], r["is_default"]) for r in rows]


def _covered(parts: list[Partition], lo: datetime, hi: datetime) -> bool:
    return any(
        not p.is_default and (p.lower is None or p.lower < hi) and (p.upper is None or p.upper > lo)
        for p in parts
    )


class _Ddl:
    """Runs a pass's DDL, each statement in a transaction that waits at most
    ``lock_timeout_ms`` for a lock, a few tries each. Once one gives up, the rest of the
    pass's DDL is skipped (the same long transaction would hold it up)."""

    def __init__(self, conn: AnyConnection, lock_timeout_ms: int) -> None:
        self.conn, self.lock_timeout_ms, self.busy = conn, int(lock_timeout_ms), False

    async def run(self, sql: str) -> bool:
        for attempt in range(0 if self.busy else DDL_TRIES):
            try:
                async with self.conn.transaction():
                    await self.conn.execute(f"SET LOCAL lock_timeout = {self.lock_timeout_ms}")
                    await self.conn.execute(sql)
                return True
            except asyncpg.exceptions.LockNotAvailableError:
                if attempt + 1 < DDL_TRIES:
                    await asyncio.sleep(DDL_RETRY_PAUSE)
        if not self.busy:
            self.busy = True
            log.warning(
                "event=history_partitions_busy lock_timeout_ms=%d tries=%d "
                "hint=a_long_transaction_holds_job_transitions;tried_again_next_pass",
                self.lock_timeout_ms,
                DDL_TRIES,
            )
        return False


async def ensure_partitions(
    conn: AnyConnection,
    now: datetime,
    *,
    after: datetime | None = None,
    dry_run: bool = False,
    ddl: _Ddl | None = None,
) -> tuple[list[str], list[str]]:
    """Daily partitions from yesterday to ``PARTITIONS_AHEAD`` days after ``now``'s day,
    where none covers the day yet; only days ending after ``after`` (the history cutoff).
    Returns (created, skipped)."""
    ddl = ddl or _Ddl(conn, LOCK_TIMEOUT_MS)
    parts = await partitions(conn)
    created, skipped = [], []
    today = now.astimezone(UTC).date()
    for offset in range(-1, PARTITIONS_AHEAD + 1):
        day = today + timedelta(days=offset)
        lo, hi = _day_start(day), _day_start(day + timedelta(days=1))
        if (after is not None and hi <= after) or _covered(parts, lo, hi):
            continue
        name = partition_name(day)
        sql = query("create_history_partition").format(
            partition=_ident(name), lower=_literal(lo), upper=_literal(hi)
        )
        if dry_run:
            created.append(name)
        elif await ddl.run(sql):
            created.append(name)
            log.info("event=history_partition_created name=%s", name)
        else:
            skipped.append(name)
    return created, skipped


async def _delete_batches(conn: AnyConnection, sql: str, cutoff: datetime, batch: int) -> int:
    """Run a bounded DELETE (``$1`` cutoff, ``$2`` batch), each batch its own transaction,
    until it finds fewer than a batch."""
    total = 0
    while True:
        n = rows_affected(await conn.execute(sql, cutoff, batch))
        total += n
        if n < batch:
            return total


async def _delete_finished(conn: AnyConnection, cutoff: datetime, batch: int) -> int:
    """Delete the jobs finished before ``cutoff``, a window of ``batch`` jobs created before it
    per transaction."""
    if batch < 1:
        raise ValueError("batch must be 1 or more")
    total = 0
    after: tuple[datetime, str] = (EPOCH, "")
    while True:
        row = await conn.fetchrow(query("delete_finished_jobs"), cutoff, batch, *after)
        assert row is not None  # one row, always
        total += int(row["deleted"])
        if row["scanned"] < batch:
            return total
        after = (row["last_at"], row["last_id"])


async def prune(
    conn: Connection,
    settings: Settings,
    *,
    now: datetime | None = None,
    dry_run: bool = False,
    batch: int = DELETE_BATCH,
    lock_timeout_ms: int = LOCK_TIMEOUT_MS,
) -> PruneReport | None:
    """One retention pass on ``conn`` (a connection of its own: it holds the session advisory
    lock). Returns what it did, or None when another pass holds the lock. A dry run takes no
    lock and changes nothing."""
    now = now or datetime.now(UTC)
    days = settings.pg_history_retention_days
    history_cutoff = now - timedelta(days=days) if days else None
    job_days = settings.pg_job_retention_days
    report = PruneReport(
        dry_run=dry_run,
        history_cutoff=history_cutoff,
        jobs_cutoff=now - timedelta(days=job_days) if job_days else None,
        detach=settings.pg_history_detach,
    )
    if not dry_run and not await conn.fetchval(query("prune_lock"), PRUNE_LOCK):
        log.info("event=prune_skipped reason=another_pass_holds_the_lock")
        return None
    try:
        ddl = _Ddl(conn, lock_timeout_ms)
        report.created, report.skipped = await ensure_partitions(
            conn, now, after=history_cutoff, dry_run=dry_run, ddl=ddl
        )
        if history_cutoff is not None:
            await _prune_history(conn, report, history_cutoff, batch, ddl)
        if report.jobs_cutoff is not None:
            if dry_run:
                report.jobs = await conn.fetchval(query("count_finished_jobs"), report.jobs_cutoff)
            else:
                report.jobs = await _delete_finished(conn, report.jobs_cutoff, batch)
    finally:
        if not dry_run:
            # a broken or cancelled connection cannot unlock: its session's end does
            with contextlib.suppress(asyncpg.PostgresError, asyncpg.InterfaceError, OSError):
                await conn.fetchval(query("prune_unlock"), PRUNE_LOCK)
    if not dry_run and (report.removed or report.jobs or report.default_rows or report.skipped):
        log.info(
            "event=pruned partitions=%s skipped=%s default_rows=%d jobs=%d",
            ",".join(report.removed) or "-",
            ",".join(report.skipped) or "-",
            report.default_rows,
            report.jobs,
        )
    return report


async def _prune_history(
    conn: AnyConnection, report: PruneReport, cutoff: datetime, batch: int, ddl: _Ddl
) -> None:
    verb = "detach_history_partition" if report.detach else "drop_history_partition"
    for part in await partitions(conn):
        if part.is_default or part.upper is None or part.upper > cutoff:
            continue
        if report.dry_run:
            count = query("count_partition_rows").format(partition=_ident(part.name))
            report.removed[part.name] = await conn.fetchval(count)
        elif await ddl.run(query(verb).format(partition=_ident(part.name))):
            report.removed[part.name] = None
            log.info("event=history_partition_%s name=%s", verb.split("_")[0], part.name)
        else:
            report.skipped.append(part.name)
    if report.dry_run:
        report.default_rows = await conn.fetchval(query("count_old_default_history"), cutoff)
    else:
        report.default_rows = await _delete_batches(
            conn, query("delete_old_default_history"), cutoff, batch
        )


# a pass that failed for Postgres' sake (away, restarting, a lock wait): tried again later
PASS_FAILED: tuple[type[BaseException], ...] = (*UNAVAILABLE, asyncpg.PostgresError)


async def run_pruning(settings: Settings, stop: asyncio.Event) -> None:
    """A pass at once (partitions ahead before the first writes), then every
    ``prune_interval_seconds`` until ``stop`` is set; a failed pass is tried again after
    ``RETRY_AFTER_FAILURE`` seconds."""
    while not stop.is_set():
        wait = settings.prune_interval_seconds
        conn: Connection | None = None
        try:
            conn = await connect(settings.database_url, timeout=10)
            await prune(conn, settings)
        except PASS_FAILED as exc:
            wait = min(wait, RETRY_AFTER_FAILURE)
            log.warning("event=prune_failed retry_in=%.0fs error=%r", wait, exc)
        except Exception:  # a bug: its stack logged, and the schedule goes on
            wait = min(wait, RETRY_AFTER_FAILURE)
            log.exception("event=prune_failed retry_in=%.0fs", wait)
        finally:
            if conn is not None:
                await close(conn)
        await wait_for(stop, wait)
