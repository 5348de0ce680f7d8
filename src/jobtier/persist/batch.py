"""One batch of log entries: decoding, collapsing per job, and the write transaction.

Pure functions over decoded entries plus ``write_batch``, the one transaction a batch is
written in; the persister (``persister.py``) decides what goes into a batch and when.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg
import msgspec

from jobtier.model import JobStatus, json_encoder, status_decoder
from jobtier.persist.db import AnyConnection, query
from jobtier.persist.results import is_ref, ref_of

INLINE_RESULT_MAX = 64 * 1024  # larger results go to job_results


@dataclass(slots=True)
class LogEntry:
    """One decoded log stream entry (see ``lua/lib.lua: commit`` for the fields)."""

    shard: int
    entry_id: bytes
    status: JobStatus
    doc: bytes
    tenant: str
    from_state: str | None  # None for the submit entry
    actor: str  # worker id, 'api', 'scheduler', 'admin'
    # the job's previous logged version (0 for the submit); None from a jobtier that logged
    # every version, so version - 1 (queries.sql: history_gaps)
    prev_version: int | None = None
    payload: bytes | None = None  # submit only
    idempotency_key: str | None = None  # submit only, when given
    result: bytes | None = None  # success only; b"" means a null result
    dependencies: list[str] | None = None  # submit of a job that waits for others
    children: str = ""  # per dependency, '1' for a child of the job (same flow), else '0'

    @property
    def ms(self) -> int:
        """When the transition happened: the stream id's Redis-clock milliseconds."""
        return int(self.entry_id.split(b"-", 1)[0])


# what parse_entry raises for a malformed entry (a field missing, or not what it should be)
MALFORMED = (KeyError, ValueError, UnicodeDecodeError, msgspec.DecodeError)


def parse_entry(shard: int, entry_id: bytes, fields: dict[bytes, bytes]) -> LogEntry:
    """Decode one stream entry; raises one of ``MALFORMED`` on a malformed one."""
    doc = fields[b"d"]
    status = status_decoder.decode(doc)
    ik = fields.get(b"ik")
    pv = fields.get(b"pv")
    dp = fields.get(b"dp")
    return LogEntry(
        shard=shard,
        entry_id=entry_id,
        status=status,
        doc=doc,
        tenant=fields[b"tn"].decode(),
        from_state=fields[b"fr"].decode() or None,
        actor=fields[b"w"].decode(),
        prev_version=int(pv) if pv is not None else None,
        payload=fields.get(b"p"),
        idempotency_key=ik.decode() if ik else None,
        result=fields.get(b"r"),
        dependencies=dp.decode().split() if dp else None,
        children=fields.get(b"dk", b"").decode(),
    )


@dataclass(slots=True)
class JobRow:
    """A job's entries in one batch, collapsed: its latest version plus the fields that only
    the submit entry (payload, idempotency key) or the success entry (result) carry."""

    latest: LogEntry
    payload: bytes | None
    idempotency_key: str | None
    result: bytes | None


def collapse(entries: Iterable[LogEntry]) -> list[JobRow]:
    """One row per job id, sorted by id (a fixed lock order across concurrent persisters)."""
    rows: dict[str, JobRow] = {}
    for e in entries:
        row = rows.get(e.status.id)
        if row is None:
            rows[e.status.id] = JobRow(e, e.payload, e.idempotency_key, e.result)
            continue
        if e.status.version > row.latest.status.version:
            row.latest = e
        if e.payload is not None:
            row.payload, row.idempotency_key = e.payload, e.idempotency_key
        if e.result is not None:
            row.result = e.result
    return [rows[job_id] for job_id in sorted(rows)]


def _ts(iso: str | None) -> datetime | None:
    return None if iso is None else datetime.fromisoformat(iso)


def _json(value: Any) -> bytes | None:
    return None if value is None else json_encoder.encode(value)


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
    for row in rows:
        s = row.latest.status
        result = size = ref = None
        if is_ref(row.result):  # kept in the result store already (persist/results.py)
            ref = ref_of(row.result or b"")
        elif row.result is not None:
            size = len(row.result)
            result = (row.result or b"null") if size <= INLINE_RESULT_MAX else None
        out.append((
            s.id, row.latest.tenant, s.type, s.priority, s.state, s.version, s.attempt,
            s.max_attempts, _ts(s.created_at), _ts(s.updated_at), _ts(s.run_at), row.payload,
            row.idempotency_key, result, size, _json(s.error), _json(s.progress),
            s.cancel_requested, s.worker, row.latest.doc, s.queue, ref,
        ))  # fmt: skip
    return out


def transition_records(entries: Sequence[LogEntry]) -> list[tuple[Any, ...]]:
    """``transitions_staging`` records (TRANSITION_COLUMNS order), one per entry."""
    out = []
    for e in entries:
        s = e.status
        out.append((
            s.id, s.version, e.prev_version, e.from_state, s.state, _ts(s.updated_at), e.actor,
            s.attempt, _json(s.error), _json(s.progress), s.cancel_requested,
        ))  # fmt: skip
    return out


async def write_batch(conn: AnyConnection, entries: Sequence[LogEntry]) -> int:
    """Write entries in one transaction; returns the number of job rows in it.

    The batch is COPYed (binary) into per-session temporary staging tables and moved from
    there with one statement per table. Measured against the same statements fed by array
    parameters (``unnest``), 2,000-entry batches, durable Postgres, 2 shared cores
    (bench/results/persist.md): COPY drained a backlog at 26.3K transitions/s against 23.6K
    (medians of six alternated samples each) and used 40 us of CPU per transition against 46
    (persister 17 vs 22, Postgres 24 vs 24). asyncpg checks every array element it encodes
    against collection ABCs; COPY records skip that.
    """
    rows = collapse(entries)
    async with conn.transaction():
        # IF NOT EXISTS: a session's first batch creates them (a reconnect is a new session)
        await conn.execute(query("create_staging"))
        await conn.copy_records_to_table(
            "jobs_staging", records=job_records(rows), columns=JOB_COLUMNS
        )
        await conn.copy_records_to_table(
            "transitions_staging", records=transition_records(entries), columns=TRANSITION_COLUMNS
        )
        await conn.execute(query("upsert_jobs"))
        if any(r.payload is not None for r in rows):
            await conn.execute(query("fill_submitted"))
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
        await conn.execute(query("insert_transitions"))
        deps = dependency_records(entries)
        if deps[0]:
            await conn.execute(query("insert_dependencies"), *deps)
    return len(rows)


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
