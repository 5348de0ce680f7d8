"""One batch of log entries: decoding, collapsing per job, and the write transaction.

Pure functions over decoded entries plus ``write_batch``, the one transaction a batch is
written in, and ``write_on``, which runs it on a pool's connection and never hands a doubtful
connection back; the persister (``persister.py``) decides what goes into a batch and when,
and what to do when a write fails.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import asyncpg
import msgspec

from jobtier.core.model import State, is_ref, json_encoder, ref_of
from jobtier.persist.db import AnyConnection, Pool, query, rows_affected
from jobtier.streams.entries import LogEntry

INLINE_RESULT_MAX = 64 * 1024  # larger results go to job_results
# A batch not committed within this many seconds is on a connection that will not answer (a
# Postgres host gone without closing it: a failover, a partition). Its connection is
# terminated — which fails whatever waits on it, a ROLLBACK included — and the batch is
# written again on a new one. A healthy batch commits in well under a second.
BATCH_TIMEOUT = 60.0


class JobRow(msgspec.Struct, gc=False):
    """A job's entries in one batch, collapsed: its latest version plus the fields that only
    the submit entry (payload, idempotency key) or the success entry (result) carry.
    ``created``: the batch holds the entry that created the job, so Postgres has no row of it
    yet unless this batch is a replay or another persister wrote a later version first."""

    latest: LogEntry
    payload: bytes | None
    idempotency_key: str | None
    result: bytes | None
    created: bool


def collapse(entries: Iterable[LogEntry]) -> list[JobRow]:
    """One row per job id, sorted by id: a fixed lock order across concurrent batches. (The
    order of the code points, which is the byte order of UTF-8: the statements that take
    these rows' locks in Postgres order them by ``id COLLATE "C"``, whatever the database's
    collation.)"""
    rows: dict[str, JobRow] = {}
    for e in entries:
        row = rows.get(e.status.id)
        if row is None:
            rows[e.status.id] = JobRow(
                e, e.payload, e.idempotency_key, e.result, e.from_state is None
            )
            continue
        if e.status.version > row.latest.status.version:
            row.latest = e
        if e.payload is not None:
            row.payload, row.idempotency_key = e.payload, e.idempotency_key
        if e.result is not None:
            row.result = e.result
        if e.from_state is None:
            row.created = True
    return [rows[job_id] for job_id in sorted(rows)]


# The staging tables' column order (queries.sql: create_staging, upsert_jobs, …).
JOB_COLUMNS = (
    "id", "tenant", "type", "priority", "state", "version", "attempt", "max_attempts",
    "created_at", "updated_at", "run_at", "payload", "idempotency_key", "result", "result_size",
    "error", "progress", "cancel_requested", "worker", "doc", "queue", "result_ref",
)  # fmt: skip
TRANSITION_COLUMNS = (
    "job_id", "version", "prev_version", "from_state", "to_state", "at", "worker", "attempt",
    "error", "progress", "cancel_requested",
)  # fmt: skip


def job_records(rows: Sequence[JobRow]) -> list[tuple[Any, ...]]:
    """``jobs_staging`` records (JOB_COLUMNS order), one per collapsed job."""
    out = []
    ts = datetime.fromisoformat
    for row in rows:
        latest = row.latest
        s = latest.status
        result = size = ref = None
        if (r := row.result) is not None:
            if is_ref(r):  # kept in the result store already (persist/results.py)
                ref = ref_of(r)
            else:
                size = len(r)
                result = (r or b"null") if size <= INLINE_RESULT_MAX else None
        out.append((
            s.id, latest.tenant, s.type, s.priority, s.state, s.version, s.attempt,
            s.max_attempts, ts(s.created_at), ts(s.updated_at),
            None if s.run_at is None else ts(s.run_at), row.payload, row.idempotency_key,
            result, size, None if s.error is None else json_encoder.encode(s.error),
            None if s.progress is None else json_encoder.encode(s.progress),
            s.cancel_requested, s.worker, latest.doc, s.queue, ref,
        ))  # fmt: skip
    return out


# The transitions that record an error of their own: an attempt failed (running -> failed,
# scheduled for a retry, or queued again when its lease expired), or a cancel, which gives
# its reason. Every other one (a claim, a promotion, a success) shows in its document the
# error an earlier attempt left, which in the history would read as a failure of its own.
ENDS_IN_ERROR = frozenset({State.FAILED, State.CANCELLED})
RETRIED = frozenset({State.SCHEDULED, State.QUEUED})


def own_error(e: LogEntry) -> bool:
    """Whether the error in ``e``'s document is its transition's (see ENDS_IN_ERROR)."""
    to = e.status.state
    if to in ENDS_IN_ERROR:
        return True
    return e.from_state == State.RUNNING and to in RETRIED and not e.released


def transition_records(entries: Sequence[LogEntry]) -> list[tuple[Any, ...]]:
    """``transitions_staging`` records (TRANSITION_COLUMNS order), one per entry; the error
    only on the transitions that record one (``own_error``)."""
    out = []
    ts = datetime.fromisoformat
    for e in entries:
        s = e.status
        error = None if s.error is None or not own_error(e) else json_encoder.encode(s.error)
        out.append((
            s.id, s.version, e.prev_version, e.from_state, s.state, ts(s.updated_at), e.actor,
            s.attempt, error,
            None if s.progress is None else json_encoder.encode(s.progress),
            s.cancel_requested,
        ))  # fmt: skip
    return out


async def write_batch(
    conn: AnyConnection, entries: Sequence[LogEntry], rows: Sequence[JobRow] | None = None
) -> int:
    """Write entries in one transaction; returns the number of job rows in it. ``rows``: the
    job rows to write with them (in id order), when not the ones ``collapse(entries)`` makes:
    the persister holds some back and writes some it held before (``holding.py``).

    What is new to Postgres is COPYed (binary) straight into its table: the rows of the jobs
    this batch creates, and every transition (``copy_new``). Only when one of them is there
    already (a replay; a job whose later version another persister wrote first) do they take
    the way every other row takes: COPY into per-session temporary staging tables, then one
    statement per table that skips or merges what Postgres has (queries.sql). Both are
    cheaper than array parameters (``unnest``), whose every element asyncpg checks against
    collection ABCs (bench/results/persist.md); the straight COPY also spares the staging
    copy and the conflict checks (bench/results/persist-direct.md).
    """
    if rows is None:
        rows = collapse(entries)
    async with conn.transaction():
        merged, created = split_created(rows)
        if merged:
            await _merge_jobs(conn, merged)
        if created and not await copy_new(conn, "jobs", job_records(created), JOB_COLUMNS):
            if merged:
                await conn.execute(query("clear_jobs_staging"))
            await _merge_jobs(conn, created)
        large = [
            r
            for r in rows
            if r.result is not None and len(r.result) > INLINE_RESULT_MAX and not is_ref(r.result)
        ]
        if large:
            await conn.execute(
                query("insert_results"),
                [r.latest.status.id for r in large],
                [r.result for r in large],
                [len(r.result or b"") for r in large],
            )
        # in key order, as insert_transitions takes its locks: concurrent batches that hold
        # entries of one job (a replay) wait for each other instead of deadlocking
        history = transition_records(sorted(entries, key=_key))
        if history and not await copy_new(conn, "job_transitions", history, TRANSITION_COLUMNS):
            await conn.execute(query("create_staging"))
            await conn.copy_records_to_table(
                "transitions_staging", records=history, columns=TRANSITION_COLUMNS
            )
            await conn.execute(query("insert_transitions"))
        deps = dependency_records(entries)
        if deps[0]:
            await conn.execute(query("insert_dependencies"), *deps)
        checkpoints = checkpoint_records(entries)
        if checkpoints[0]:
            await conn.execute(query("insert_checkpoints"), *checkpoints)
    return len(rows)


def _key(e: LogEntry) -> tuple[str, int]:
    return e.status.id, e.status.version


def split_created(rows: Sequence[JobRow]) -> tuple[Sequence[JobRow], Sequence[JobRow]]:
    """(the rows to merge into what Postgres has, the rows of new jobs to COPY straight in):
    the new jobs after the last row to merge, in id order. Written in that order, a batch
    takes its rows' locks in id order whichever way each goes, as concurrent batches that
    hold entries of the same jobs must, or they could deadlock. Ids begin with their
    creation time, so the jobs a batch creates are nearly all after the older jobs it moves on;
    the few that are not are merged like the rest (written the same, a little dearer)."""
    last = len(rows)
    while last and rows[last - 1].created:
        last -= 1
    return rows[:last], rows[last:]


async def copy_new(
    conn: AnyConnection, table: str, records: list[tuple[Any, ...]], columns: Sequence[str]
) -> bool:
    """COPY ``records`` straight into ``table`` under a savepoint; False, with nothing
    written, when the key of one of them is there already (rolled back to the savepoint)."""
    try:
        async with conn.transaction():
            await conn.copy_records_to_table(table, records=records, columns=columns)
    except asyncpg.UniqueViolationError:
        return False
    return True


async def _merge_jobs(conn: AnyConnection, rows: Sequence[JobRow]) -> None:
    """Rows Postgres may have a version of: staged, then upserted (only forward in version),
    and what only a submit entry knows filled in where a later version was there first."""
    await conn.execute(query("create_staging"))
    await conn.copy_records_to_table("jobs_staging", records=job_records(rows), columns=JOB_COLUMNS)
    # every row inserted, or updated to this batch's version (payload coalesced in): then
    # no submit entry met a newer row, and fill_submitted would change nothing
    written = rows_affected(await conn.execute(query("upsert_jobs")))
    if written < len(rows) and any(r.payload is not None for r in rows):
        await conn.execute(query("fill_submitted"))


async def write_on(
    pool: Pool,
    entries: Sequence[LogEntry],
    timeout: float = BATCH_TIMEOUT,
    rows: Sequence[JobRow] | None = None,
) -> int:
    """``write_batch`` on a connection of ``pool``; returns the number of job rows written.

    A connection whose batch failed other than by Postgres refusing a statement is
    terminated rather than handed back to the pool: after a reset or a shutdown in the
    middle of COPY its protocol is mid-operation, and the pool's own reset on release would
    fail on it again (and raise from the release). One that does not answer within
    ``timeout`` is terminated too, which fails the waiting statement at once (raised as
    ``TimeoutError``).
    """
    async with pool.acquire(timeout=timeout) as conn:
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            _terminate(conn)

        watchdog = asyncio.get_running_loop().call_later(timeout, expire)
        try:
            return await write_batch(conn, entries, rows)
        except BaseException as exc:
            if not _connection_reusable(exc):
                _terminate(conn)
            if expired and isinstance(exc, Exception):
                raise TimeoutError(
                    f"batch of {len(entries)} not committed within {timeout:g} s"
                ) from exc
            raise
        finally:
            watchdog.cancel()


def _connection_reusable(exc: BaseException) -> bool:
    """Whether a connection whose batch failed with ``exc`` may go back to the pool: only
    when Postgres itself answered with an error about the statement (the transaction was
    rolled back and the session is sound). Anything else — a lost or reset connection, a
    protocol left mid-COPY, a cancellation, a bug of ours half-way through — leaves the
    session in a state nobody knows."""
    return isinstance(exc, asyncpg.PostgresError) and not isinstance(
        exc,
        asyncpg.PostgresConnectionError
        | asyncpg.exceptions.OperatorInterventionError
        | asyncpg.exceptions.InsufficientResourcesError,
    )


def _terminate(conn: AnyConnection) -> None:
    """Close a pool connection at once, without a word to the server; the pool replaces it
    (its holder is released, the proxy detached). Nothing if already gone."""
    with contextlib.suppress(Exception):
        if not conn.is_closed():
            conn.terminate()


# This entry's data cannot be stored (no retry will help): isolate it, keep the others moving
# (but a row refused by a partition attached meanwhile is written again: attached_meanwhile).
# Anything else (a missing table before `jobtier migrate`, a bug) is retried like an outage.
POISON: tuple[type[BaseException], ...] = (
    asyncpg.exceptions.DataError,
    asyncpg.exceptions.IntegrityConstraintViolationError,
)


def attached_meanwhile(exc: BaseException) -> bool:
    """Whether Postgres refused rows for the default history partition because a pass
    attached their day's partition while the batch waited for the default one's lock
    (retention.py: the first pass on a fresh database attaches today's as the first batches
    are written). A statement routes its rows by the partitions it saw when it began; written
    again, they go to their day. It is the only partition-constraint violation our writes can
    meet (the default partition takes any row), which unlike a CHECK names no constraint."""
    return (
        isinstance(exc, asyncpg.exceptions.CheckViolationError)
        and not exc.constraint_name
        and bool(exc.table_name)
    )


def checkpoint_records(
    entries: Sequence[LogEntry],
) -> tuple[list[str], list[int], list[datetime], list[int], list[str], list[bytes]]:
    """``job_checkpoints`` columns (job, version, at, attempt, worker, state) of the entries
    that saved a checkpoint."""
    jobs: list[str] = []
    versions: list[int] = []
    ats: list[datetime] = []
    attempts: list[int] = []
    workers: list[str] = []
    states: list[bytes] = []
    for e in entries:
        if e.checkpoint is not None:
            s = e.status
            jobs.append(s.id)
            versions.append(s.version)
            ats.append(datetime.fromisoformat(s.updated_at))
            attempts.append(s.attempt)
            workers.append(e.actor)
            states.append(e.checkpoint)
    return jobs, versions, ats, attempts, workers, states


def dependency_records(
    entries: Sequence[LogEntry],
) -> tuple[list[str], list[str], list[int], list[bool]]:
    """``job_dependencies`` columns (job, dependency, position, child) of the submit
    entries of jobs that wait for others."""
    jobs: list[str] = []
    deps: list[str] = []
    positions: list[int] = []
    children: list[bool] = []
    for e in entries:
        for i, dep in enumerate(e.dependencies or ()):
            jobs.append(e.status.id)
            deps.append(dep)
            positions.append(i)
            children.append(e.children[i : i + 1] == "1")
    return jobs, deps, positions, children
