"""The audit of admin actions in Postgres (table ``audit``).

``api/audit.py`` makes the records (who, when, what, on what, with which answer) and writes
them here; this module only stores and lists them.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import msgspec

from jobtier.core.errors import InvalidRequest
from jobtier.core.names import ULID_RE
from jobtier.persist.db import Pool, query

MAX_AUDIT_LIMIT = 500


class AuditRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One admin action. ``actor`` is ``admin:<fingerprint>`` (the first 12 hex digits of the
    SHA-256 of the key used, never the key); ``target`` a job id, a queue name or a filter;
    ``status`` the HTTP status the action was answered with; ``detail`` what it did (jobs
    cancelled, limits set, ids replayed) or why it was refused."""

    id: str
    at: datetime
    actor: str
    action: str
    target: str
    status: int
    detail: Any = None
    source: str | None = None  # the client's address as the API saw it


_detail = msgspec.json.Encoder()
_any = msgspec.json.Decoder()


class AuditStore:
    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    async def insert(self, records: Sequence[AuditRecord]) -> None:
        """Write records; one already written (same id) is left as it is."""
        if not records:
            return
        await self.pool.execute(
            query("insert_audit"),
            [r.id for r in records],
            [r.at for r in records],
            [r.actor for r in records],
            [r.action for r in records],
            [r.target for r in records],
            [r.status for r in records],
            [None if r.detail is None else _detail.encode(r.detail) for r in records],
            [r.source for r in records],
        )

    async def list(
        self,
        *,
        target: str | None = None,
        action: str | None = None,
        before: str | None = None,
        limit: int = 50,
    ) -> tuple[list[AuditRecord], str | None]:
        """Records newest first; (page, the ``before`` of the next page or None)."""
        if isinstance(limit, bool) or not 1 <= limit <= MAX_AUDIT_LIMIT:
            raise InvalidRequest(f"limit must be from 1 to {MAX_AUDIT_LIMIT}", field="limit")
        params: list[Any] = [limit + 1]
        filters = []
        for fragment, value in (
            ("AND target = ${}", target),
            ("AND action = ${}", action),
            ("AND id < ${}", before),
        ):
            if value is not None:
                params.append(value)
                filters.append(fragment.format(len(params)))
        if before is not None and not ULID_RE.fullmatch(before):
            raise InvalidRequest("cursor is not one this API returned", field="cursor")
        sql = query("list_audit").replace("/*filters*/", " ".join(filters))
        rows = await self.pool.fetch(sql, *params)
        records = []
        for row in rows[:limit]:
            fields = dict(row)  # the columns are the record's fields
            if row["detail"] is not None:
                fields["detail"] = _any.decode(row["detail"])
            records.append(AuditRecord(**fields))
        return records, (records[-1].id if len(rows) > limit else None)
