"""The status document of a job still only in the outbox (``migrations/0010_outbox.sql``).

Between its commit and its relay a job submitted with ``jobtier.submit`` is a row of
``jobtier.outbox`` only: a status read of its id answers ``submitted`` (version 0: its first
version in Redis, 1, supersedes it), not 404; and so does a row relayed in the last 10
minutes, for a read that missed the job in Redis just before the relay, until the persister
writes its row (which is read first). A row the relay refused reads as ``failed`` with the
reason, and one cancelled before its relay as ``cancelled``, for as long as finished jobs are
kept. What the relay takes from the task (its queue and attempts when the caller gave none) is
not known yet: ``queue`` is the one given, else ``default``, and ``max_attempts`` 0.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import msgspec

from jobtier.core.model import DEFAULT_QUEUE, State
from jobtier.persist.db import AnyConnection, Pool, query

_encode = msgspec.json.Encoder().encode


def iso(at: datetime) -> str:
    """A time as the status documents give it (``2026-01-02T03:04:05.678Z``)."""
    at = at.astimezone(UTC)
    return at.strftime("%Y-%m-%dT%H:%M:%S.") + f"{at.microsecond // 1000:03d}Z"


def render(row: Any) -> bytes:
    """The row's status document, in the fields' order of ``render.lua``."""
    refused = row["error"] is not None
    cancelled = row["cancelled_at"] is not None
    ended = refused or cancelled
    created = iso(row["created_at"])
    state = State.FAILED if refused else State.SUBMITTED
    if cancelled:
        state = State.CANCELLED
    return _encode(
        {
            "id": row["id"],
            "type": row["type"],
            "queue": row["queue"] or DEFAULT_QUEUE,
            "state": state,
            "version": 1 if ended else 0,
            "priority": row["priority"],
            "attempt": 0,
            "max_attempts": row["max_attempts"] or 0,
            "created_at": created,
            "updated_at": iso(row["relayed_at"]) if ended else created,
            "run_at": iso(row["run_at"]) if row["run_at"] is not None else None,
            "progress": None,
            "error": {"type": "Refused", "message": row["error"][:2000]} if refused else None,
            "cancel_requested": False,
            "worker": None,
        }
    )


async def outbox_docs(
    job_ids: list[str], pool: Pool | AnyConnection, *, relayed: bool = True
) -> dict[str, tuple[str, bytes]]:
    """{id: (tenant, status document)} of those ids only the outbox has; ``relayed``: rows
    relayed in the last 10 minutes too (a status read's, which Postgres has no row of yet).
    On a connection in a transaction: as that transaction has the rows (a refusal's, a
    cancel's, for their webhooks)."""
    rows = await pool.fetch(query("outbox_status_docs"), job_ids, relayed)
    return {r["id"]: (r["tenant"], render(r)) for r in rows}
