"""Reads of the durable record, for the API: status fallback, listing, history, results, lag.

Redis holds every live job; Postgres holds every job. The API asks here for a job whose hash
expired from Redis (``status_doc``), for listings and history (only Postgres has them), and
asks ``lag`` how far behind the write-behind is (the listing says so, and submit answers 503
past ``persist_max_lag``).

Every tenant-facing read takes the caller's tenant: another tenant's job is answered exactly
like an unknown one.
"""

from __future__ import annotations

import base64
import binascii
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec

from jobtier.connection import RedisClient
from jobtier.errors import InvalidRequest
from jobtier.keys import JOB_ID_RE, Keys
from jobtier.model import (
    QUEUE_NAME_RE,
    JobError,
    JobStatus,
    State,
    any_decoder,
    status_decoder,
)
from jobtier.model import Transition as Transition  # moved to model.py (the client reads it)
from jobtier.persist.db import Pool, query
from jobtier.scripts import Script, evalsha_many

MAX_LIMIT = 500
MAX_TYPE_LENGTH = 200
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_STATES = frozenset(s.value for s in State)
_error_decoder = msgspec.json.Decoder(JobError)


@dataclass(frozen=True, slots=True)
class StoredResult:
    state: State
    version: int
    result: bytes | None  # the result JSON when succeeded (b"null" for none); else None
    ref: str | None = None  # instead, where the result store keeps it (persist/results.py)


# --- cursors --------------------------------------------------------------------------------
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


def _created_after(value: datetime | str) -> datetime:
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            raise InvalidRequest(
                "created_after must be an ISO-8601 time, e.g. 2024-05-01T12:00:00Z",
                field="created_after",
            ) from None
    if not isinstance(value, datetime):
        raise InvalidRequest("created_after must be a time", field="created_after")
    return value if value.tzinfo else value.replace(tzinfo=UTC)


class PgReader:
    """Read-only queries on a pool made by ``db.create_pool`` (its codecs are assumed)."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    async def status_doc(self, job_id: str) -> tuple[str, bytes] | None:
        """(tenant, status document bytes) of a job, or None if Postgres never saw it.

        The document is the one Redis served at the job's last persisted version; the caller
        checks the tenant (another tenant's job must look unknown).
        """
        row = await self.pool.fetchrow(query("status_doc"), job_id)
        return None if row is None else (row["tenant"], row["doc"])

    async def status_docs(self, job_ids: list[str]) -> dict[str, tuple[str, bytes]]:
        """``status_doc`` for many jobs in one query: {id: (tenant, doc)} for those found."""
        rows = await self.pool.fetch(query("status_docs"), job_ids)
        return {r["id"]: (r["tenant"], r["doc"]) for r in rows}

    async def list_jobs(
        self,
        tenant: str,
        state: str | None = None,
        type: str | None = None,
        created_after: datetime | str | None = None,
        queue: str | None = None,
        cursor: str | None = None,
        limit: int = 50,
        order: str = "desc",
    ) -> tuple[list[JobStatus], str | None]:
        """A page of the tenant's jobs, newest first (``order="asc"``: oldest first).

        Keyset pagination on (created_at, id): pages stay consistent while jobs are added, and
        the cost of a page does not grow with its depth. Returns (jobs, cursor of the next page
        or None). Bad parameters raise ``InvalidRequest`` (a 400) naming the field.
        """
        if order not in ("asc", "desc"):
            raise InvalidRequest("order must be asc or desc", field="order")
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
            raise InvalidRequest(f"limit must be an integer from 1 to {MAX_LIMIT}", field="limit")
        if state is not None and state not in _STATES:
            raise InvalidRequest(
                f"state must be one of {', '.join(s.value for s in State)}", field="state"
            )
        if type is not None and not (isinstance(type, str) and 0 < len(type) <= MAX_TYPE_LENGTH):
            raise InvalidRequest("type must be a non-empty job type name", field="type")
        params: list[Any] = [tenant, limit + 1]
        filters = []
        if state is not None:
            params.append(state)
            filters.append(f"AND state = ${len(params)}")
        if type is not None:
            params.append(type)
            filters.append(f"AND type = ${len(params)}")
        if queue is not None:
            if not (isinstance(queue, str) and QUEUE_NAME_RE.fullmatch(queue)):
                raise InvalidRequest(f"queue must match {QUEUE_NAME_RE.pattern}", field="queue")
            params.append(queue)
            filters.append(f"AND queue = ${len(params)}")
        if created_after is not None:
            params.append(_created_after(created_after))
            filters.append(f"AND created_at > ${len(params)}")
        if cursor is not None:
            params.extend(decode_cursor(cursor, order))
            op = "<" if order == "desc" else ">"
            filters.append(f"AND (created_at, id) {op} (${len(params) - 1}, ${len(params)})")
        sql = query("list_jobs").replace("/*filters*/", " ".join(filters))
        sql = sql.replace("/*dir*/", "DESC" if order == "desc" else "ASC")
        rows = await self.pool.fetch(sql, *params)
        jobs = [status_decoder.decode(r["doc"]) for r in rows[:limit]]
        next_cursor = None
        if len(rows) > limit:
            last = rows[limit - 1]
            next_cursor = encode_cursor(order, last["created_at"], last["id"])
        return jobs, next_cursor

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


# --- lag of the write-behind ----------------------------------------------------------------
LAG_EXACT_UP_TO = 100  # undelivered entries per shard counted one by one (log_lag.lua)
_LAG = Script("log_lag")


def _id_ms(entry_id: bytes) -> int:
    return int(entry_id.split(b"-", 1)[0])


async def lag(redis: RedisClient, keys: Keys) -> tuple[int, float]:
    """(entries not yet acknowledged by the persisters, age in seconds of the oldest one).

    Per shard, one read-only script call (``lua/log_lag.lua``, all shards in one pipeline):
    the group's pending entries plus the entries after its last-delivered id — counted in
    the stream, so a restart from the AOF that leaves Redis's own ``lag`` counter stale
    cannot make it report entries that do not exist (0 once the logs are drained). Up to
    ``LAG_EXACT_UP_TO`` undelivered entries per shard are counted exactly; beyond that it is
    Redis's ``lag`` bounded by the entries present and not pending, so the cost stays a few
    hundred entry reads per call however long the backlog. The age comes from the oldest
    waiting entry's id (Redis's clock) against this process's clock. Callers on hot paths
    should cache it for a second (the API does).
    """
    group = keys.persist_group()
    calls = [(_LAG, (1, keys.log(s), group, LAG_EXACT_UP_TO)) for s in range(keys.shards)]
    total, oldest_ms = 0, None
    for waiting, oldest in await evalsha_many(redis, calls):
        total += int(waiting)
        if oldest:
            ms = _id_ms(oldest)
            oldest_ms = ms if oldest_ms is None else min(oldest_ms, ms)
    age = 0.0 if oldest_ms is None else max(0.0, time.time() - oldest_ms / 1000)
    return total, age
