"""Reads of the durable record, for the API: status fallback, listing, history, results.

Redis holds every live job; Postgres holds every job. The API asks here for a job whose hash
expired from Redis (``status_doc``), and for listings and history (only Postgres has them).

Every tenant-facing read takes the caller's tenant: another tenant's job is answered exactly
like an unknown one.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypedDict, Unpack

import msgspec

from jobtier.core.errors import InvalidRequest
from jobtier.core.model import (
    LISTED_STATES,
    Dependency,
    JobError,
    JobStatus,
    State,
    any_decoder,
    marker,
    status_decoder,
)
from jobtier.core.model import Transition as Transition  # the API imports it from here
from jobtier.core.names import JOB_ID_RE, QUEUE_NAME_RE
from jobtier.flows.reads import dependency
from jobtier.persist.db import Pool, query
from jobtier.persist.listing_stats import ListingStats
from jobtier.persist.outbox_docs import outbox_docs

MAX_LIMIT = 500
MAX_TYPE_LENGTH = 200
# the start of a job id (<ULID>-<shard>): what the console's id search takes
ID_PREFIX_RE = re.compile(r"^[0-9A-Za-z]{1,26}(-[0-9]{0,4})?$")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# a state filter as SQL: a literal, from this fixed set only, so that a plan, generic ones
# too, can use the partial indexes of jobs_by_state (migrations/0020)
_STATE_SQL = {state: f"AND state = '{state}'" for state in LISTED_STATES}
_error_decoder = msgspec.json.Decoder(JobError)


class AdminTransition(msgspec.Struct, frozen=True):
    """One change of a job as the console shows it: a ``Transition`` whose error and progress
    are the JSON as stored (every member the worker recorded, a traceback too)."""

    version: int
    from_state: str | None
    to_state: str
    at: datetime
    worker: str
    attempt: int
    error: msgspec.Raw | None = None
    progress: msgspec.Raw | None = None
    cancel_requested: bool = False


@dataclass(frozen=True, slots=True)
class StoredJob:
    """A job as the console reads it from Postgres; payload and result only when small."""

    tenant: str
    doc: bytes
    payload_size: int | None  # None until the submit entry is written
    payload: bytes | None
    result_size: int | None  # None without a result (or with one kept in the result store)
    result: bytes | None
    result_ref: str | None = None  # where the result store keeps it (persist/results.py)


@dataclass(frozen=True, slots=True)
class StoredResult:
    state: State
    version: int
    result: bytes | None  # the result JSON when succeeded (b"null" for none); else None
    ref: str | None = None  # instead, where the result store keeps it (persist/results.py)


def encode_cursor(order: str, created_at: datetime, job_id: str) -> str:
    """Opaque keyset position: after (before, newest first) this (created_at, id)."""
    micros = (created_at - _EPOCH) // timedelta(microseconds=1)
    raw = f"{order}:{micros}:{job_id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str, order: str) -> tuple[datetime, str]:
    try:
        if not isinstance(cursor, str) or len(cursor) > 200:
            raise ValueError(cursor)
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        cursor_order, micros, job_id = raw.split(":")
        if not JOB_ID_RE.match(job_id) or not micros.isdigit():
            raise ValueError(raw)
        created_at = _EPOCH + timedelta(microseconds=int(micros))
    except (ValueError, UnicodeDecodeError, binascii.Error, OverflowError):
        raise InvalidRequest("cursor is not one this API returned", field="cursor") from None
    if cursor_order != order:
        raise InvalidRequest(f"cursor belongs to a listing in {cursor_order} order", field="cursor")
    return created_at, job_id


def _time(value: datetime | str, field: str) -> datetime:
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            raise InvalidRequest(
                f"{field} must be an ISO-8601 time, e.g. 2024-05-01T12:00:00Z", field=field
            ) from None
    if not isinstance(value, datetime):
        raise InvalidRequest(f"{field} must be a time", field=field)
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def _limit(limit: int) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise InvalidRequest(f"limit must be an integer from 1 to {MAX_LIMIT}", field="limit")
    return limit


def id_prefix_range(prefix: str) -> tuple[str, str]:
    """[low, high) in byte order of the ids that start with ``prefix`` (upper-cased: ULIDs
    are case-insensitive); ``InvalidRequest`` unless it can start a job id."""
    if not isinstance(prefix, str) or not ID_PREFIX_RE.fullmatch(prefix):
        raise InvalidRequest(
            f"id_prefix must match {ID_PREFIX_RE.pattern} (the start of a job id)",
            field="id_prefix",
        )
    low = prefix.upper()
    return low, low[:-1] + chr(ord(low[-1]) + 1)


class TenantFilters(TypedDict, total=False):
    """The filters of a tenant's listing (``PgReader.list_jobs``); None, or left out: any."""

    state: str | None
    type: str | None
    queue: str | None
    created_after: datetime | str | None
    cursor: str | None


class Filters(TenantFilters, total=False):
    """The filters of the console's listing (``PgReader.admin_list_jobs``)."""

    tenant: str | None
    created_before: datetime | str | None
    id_prefix: str | None


def _filters(params: list[Any], order: str = "desc", **where: Unpack[Filters]) -> list[str]:
    """The WHERE fragments of a listing (fixed text, never caller input: a value is a
    parameter, the state one of a fixed set of literals), their values appended to
    ``params``; ``InvalidRequest`` naming the field for a bad one."""
    if unknown := where.keys() - Filters.__annotations__.keys():
        raise TypeError(f"no such filter: {', '.join(sorted(unknown))}")
    if order not in ("asc", "desc"):
        raise InvalidRequest("order must be asc or desc", field="order")
    filters = []

    def add(fragment: str, *values: Any) -> None:
        numbers = []
        for value in values:
            params.append(value)
            numbers.append(f"${len(params)}")
        filters.append(fragment.format(*numbers))

    if (tenant := where.get("tenant")) is not None:
        add("AND tenant = {}", tenant)
    if (state := where.get("state")) is not None:
        if not isinstance(state, str) or state not in _STATE_SQL:
            raise InvalidRequest(f"state must be one of {', '.join(LISTED_STATES)}", field="state")
        filters.append(_STATE_SQL[state])
    if (type := where.get("type")) is not None:
        if not (isinstance(type, str) and 0 < len(type) <= MAX_TYPE_LENGTH):
            raise InvalidRequest("type must be a non-empty job type name", field="type")
        add("AND type = {}", type)
    if (queue := where.get("queue")) is not None:
        if not (isinstance(queue, str) and QUEUE_NAME_RE.fullmatch(queue)):
            raise InvalidRequest(f"queue must match {QUEUE_NAME_RE.pattern}", field="queue")
        add("AND queue = {}", queue)
    if (after := where.get("created_after")) is not None:
        add("AND created_at > {}", _time(after, "created_after"))
    if (before := where.get("created_before")) is not None:
        add("AND created_at < {}", _time(before, "created_before"))
    if (id_prefix := where.get("id_prefix")) is not None:
        add('AND id COLLATE "C" >= {} AND id COLLATE "C" < {}', *id_prefix_range(id_prefix))
    if (cursor := where.get("cursor")) is not None:
        op = "<" if order == "desc" else ">"
        add(f"AND (created_at, id) {op} ({{}}, {{}})", *decode_cursor(cursor, order))
    return filters


def listing_sql(
    name: str, limit: int, order: str, **where: Unpack[Filters]
) -> tuple[str, list[Any]]:
    """The SQL of listing ``name`` (of queries.sql) for a page of ``limit`` and one more (is
    there a next page?), and its parameters."""
    params: list[Any] = [_limit(limit) + 1]
    filters = _filters(params, order, **where)
    sql = query(name).replace("/*filters*/", " ".join(filters))
    return sql.replace("/*dir*/", "DESC" if order == "desc" else "ASC"), params


def _by_state(listing: str, state: str | None) -> str:
    """The query of a listing: by a state other than ``succeeded``, the one that pages through
    ``jobs_by_state`` (no index of ``jobs`` covers ``state``); succeeded jobs, nearly all of
    them, are filtered in created_at order."""
    return "list_jobs_by_state" if state is not None and state != "succeeded" else listing


class PgReader:
    """Read-only queries on a pool made by ``db.create_pool`` (its codecs are assumed)."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.stats = ListingStats(pool)  # which way a listing of queued jobs of a type reads

    async def status_doc(self, job_id: str) -> tuple[str, bytes] | None:
        """(tenant, status document) of a job at its last persisted version, or None if
        Postgres never saw it; the caller checks the tenant."""
        row = await self.pool.fetchrow(query("status_doc"), job_id)
        return None if row is None else (row["tenant"], row["doc"])

    async def status_docs(self, job_ids: list[str]) -> dict[str, tuple[str, bytes]]:
        """``status_doc`` for many jobs in one query: {id: (tenant, doc)} for those found;
        an id found only in the outbox reads as ``submitted``, or ``failed`` when its relay
        refused it (``outbox_docs.py``)."""
        rows = await self.pool.fetch(query("status_docs"), job_ids)
        found = {r["id"]: (r["tenant"], r["doc"]) for r in rows}
        if len(found) < len(job_ids):
            found.update(await outbox_docs([i for i in job_ids if i not in found], self.pool))
        return found

    async def list_jobs(
        self, tenant: str, *, limit: int = 50, order: str = "desc", **where: Unpack[TenantFilters]
    ) -> tuple[list[JobStatus], str | None]:
        """A page of the tenant's jobs, newest first (``order="asc"``: oldest first), and the
        cursor of the next page or None. Keyset pagination on (created_at, id): pages stay
        consistent while jobs are added, and a page costs the same at any depth. Bad
        parameters raise ``InvalidRequest`` naming the field.
        """
        rows, next_cursor = await self._page("list_jobs", limit, order, tenant=tenant, **where)
        return [status_decoder.decode(r["doc"]) for r in rows], next_cursor

    async def admin_list_jobs(
        self, *, limit: int = 50, order: str = "desc", **where: Unpack[Filters]
    ) -> tuple[list[tuple[str, bytes]], str | None]:
        """A page of every tenant's jobs for the console: (tenant, status document) pairs,
        newest first, keyset-paginated as ``list_jobs``. ``id_prefix`` matches the start of
        the id (case-insensitive, as ULIDs are); the time range is on ``created_at``."""
        rows, next_cursor = await self._page("admin_list_jobs", limit, order, **where)
        return [(r["tenant"], bytes(r["doc"])) for r in rows], next_cursor

    async def _page(
        self, listing: str, limit: int, order: str, **where: Unpack[Filters]
    ) -> tuple[list[Any], str | None]:
        # the filters checked (InvalidRequest) before the statistics are read
        name = _by_state(listing, where.get("state"))
        sql, params = listing_sql(name, limit, order, **where)
        chosen = await self.listing_query(listing, **where)
        if chosen != name:
            sql, params = listing_sql(chosen, limit, order, **where)
        rows = await self.pool.fetch(sql, *params)
        next_cursor = None
        if len(rows) > limit:
            last = rows[limit - 1]
            next_cursor = encode_cursor(order, last["created_at"], last["id"])
        return rows[:limit], next_cursor

    async def listing_query(self, listing: str, **where: Unpack[Filters]) -> str:
        """The query (of queries.sql) a page of ``listing`` with these filters reads: by a
        state other than succeeded, through jobs_by_state (``_by_state``), except queued or
        running jobs of a type or queue that has fewer jobs than the state has: those are
        read in ``jobs`` by its type or queue index, the state checked on each
        (``ListingStats``)."""
        name = _by_state(listing, state := where.get("state"))
        kind, queue = where.get("type"), where.get("queue")
        if (
            name != listing
            and isinstance(state, str)
            and await self.stats.by_type_first(state, kind, queue)
        ):
            return listing
        return name

    async def history(self, job_id: str, tenant: str) -> list[Transition] | None:
        """Every persisted change of the job, oldest first; None for an unknown job."""
        rows = await self.pool.fetch(query("history"), job_id, tenant)
        if not rows:
            return None
        return [
            Transition(
                version=r["version"],
                from_state=State(r["from_state"]) if r["from_state"] else None,
                to_state=State(r["to_state"]),
                at=r["at"],
                worker=r["worker"],
                attempt=r["attempt"],
                error=_error_decoder.decode(r["error"]) if r["error"] is not None else None,
                progress=any_decoder.decode(r["progress"]) if r["progress"] is not None else None,
                cancel_requested=r["cancel_requested"],
            )
            for r in rows
        ]

    async def result(self, job_id: str, tenant: str) -> StoredResult | None:
        """The job's state and, once it succeeded, its result JSON; None for an unknown job."""
        row = await self.pool.fetchrow(query("result"), job_id, tenant)
        if row is None:
            return None
        state = State(row["state"])
        ref = row["result_ref"] if state is State.SUCCEEDED else None
        result = row["result"] if state is State.SUCCEEDED and ref is None else None
        if state is State.SUCCEEDED and result is None and ref is None:
            result = b"null"
        return StoredResult(state, row["version"], result, ref)

    async def dependencies(self, job_id: str, tenant: str) -> list[Dependency] | None:
        """A job's dependencies as Postgres knows them (None for an unknown job, or one of
        another tenant): each with its latest state, and its result or error once finished."""
        rows = await self.pool.fetch(query("dependencies"), job_id, tenant)
        if not rows:
            known = await self.pool.fetchval(query("result"), job_id, tenant)
            return [] if known is not None else None
        out = []
        for r in rows:
            dep, state, child = r["depends_on"], r["state"], r["child"]
            if state not in ("succeeded", "failed", "cancelled"):  # None: pruned, or not written
                out.append(Dependency(id=dep, state="pending" if state else "missing", child=child))
            elif state != "succeeded":
                out.append(dependency(dep, state, r["error"] or b"", child))
            elif r["result_ref"] is not None:  # kept in the result store
                out.append(dependency(dep, state, b"@" + r["result_ref"].encode(), child))
            else:
                out.append(dependency(dep, state, r["result"] or b"", child))
        return out

    # the console's reads: any tenant
    async def admin_job(self, job_id: str, preview_bytes: int) -> StoredJob | None:
        """The job as Postgres has it, whatever its tenant: its document, and its payload and
        result when at most ``preview_bytes`` (else only their sizes); None if unknown."""
        row = await self.pool.fetchrow(query("admin_job"), job_id, preview_bytes)
        if row is None:
            return None
        return StoredJob(**dict(row, doc=bytes(row["doc"])))  # its columns are the fields

    async def admin_value(self, job_id: str, part: str) -> tuple[bool, bytes | None]:
        """(whether Postgres knows the job, its whole payload or result JSON or None). A result
        kept in the result store comes as Redis holds it (``marker`` and its reference)."""
        row = await self.pool.fetchrow(query("admin_job_value"), job_id)
        if row is None:
            return False, None
        if part == "result" and row["result_ref"] is not None:
            return True, marker(row["result_ref"])
        return True, row["payload" if part == "payload" else "result"]

    async def admin_history(self, job_id: str) -> list[AdminTransition]:
        """Every persisted change of the job, oldest first, whatever its tenant, with each
        error as the worker recorded it (every member, a traceback too); [] if unknown."""
        rows = await self.pool.fetch(query("admin_history"), job_id)  # columns: the fields
        return [
            AdminTransition(**dict(r, error=_raw(r["error"]), progress=_raw(r["progress"])))
            for r in rows
        ]


def _raw(value: bytes | None) -> msgspec.Raw | None:
    return None if value is None else msgspec.Raw(value)
