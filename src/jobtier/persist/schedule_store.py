"""Schedules in Postgres: the durable copy the API writes and the scheduler reconciles from."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg
import msgspec

from jobtier.core.model import Priority
from jobtier.core.schedule import Schedule
from jobtier.persist.db import AnyConnection, Pool, query

_any = msgspec.json.Decoder()


class DuplicateName(Exception):
    """The tenant already has a schedule of this name."""


# the columns of `schedules` (each a field of Schedule) that Schedule names otherwise
_RENAMED = {"interval_seconds": "interval", "misfire_policy": "misfire"}


def to_schedule(row: asyncpg.Record) -> Schedule:
    fields = {_RENAMED.get(column, column): value for column, value in row.items()}
    fields.update(payload=_any.decode(row["payload"]), priority=Priority(row["priority"]))
    return Schedule(**fields)


@dataclass(slots=True)
class Locked:
    """A schedule's row read for a change and locked until the change's transaction ends
    (``ScheduleStore.locked``): a second change of it waits for the first, Redis's copy
    included."""

    conn: AnyConnection
    schedule: Schedule

    async def save(
        self, schedule: Schedule, payload: bytes, next_fire_at: datetime | None
    ) -> Schedule:
        """Write ``schedule``'s definition (its id's row), ``payload`` JSON and next firing;
        ``DuplicateName`` when its new name is the tenant's for another schedule."""
        s = schedule
        job = (s.name, s.type, payload, s.priority.value, s.max_attempts)
        timing = (s.cron, s.timezone, s.interval, s.misfire, s.paused, next_fire_at)
        try:
            row = await self.conn.fetchrow(
                query("update_schedule"), s.id, s.tenant, *job, *timing, s.queue
            )
        except asyncpg.UniqueViolationError:
            raise DuplicateName(schedule.name) from None
        assert row is not None  # locked: it is there
        return to_schedule(row)


class ScheduleStore:
    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    async def insert(self, schedule: Schedule, payload: bytes) -> Schedule:
        s = schedule
        job = (s.id, s.tenant, s.name, s.type, payload, s.priority.value, s.max_attempts)
        timing = (s.cron, s.timezone, s.interval, s.misfire, s.paused, s.next_fire_at)
        try:
            row = await self.pool.fetchrow(
                query("insert_schedule"), *job, *timing, s.created_at, s.queue
            )
        except asyncpg.UniqueViolationError:
            raise DuplicateName(schedule.name) from None
        assert row is not None
        return to_schedule(row)

    async def get(self, schedule_id: str, tenant: str) -> Schedule | None:
        row = await self.pool.fetchrow(query("get_schedule"), schedule_id, tenant)
        return None if row is None else to_schedule(row)

    async def for_tenant(
        self, tenant: str, after_name: str = "", limit: int = 100
    ) -> list[Schedule]:
        rows = await self.pool.fetch(query("list_schedules"), tenant, after_name, limit)
        return [to_schedule(r) for r in rows]

    @asynccontextmanager
    async def locked(self, schedule_id: str, tenant: str) -> AsyncIterator[Locked | None]:
        """The tenant's schedule, locked in a transaction that commits as the block ends (and
        rolls back if it raises); None when there is no such schedule."""
        async with self.pool.acquire() as conn, conn.transaction():
            row = await conn.fetchrow(query("lock_schedule"), schedule_id, tenant)
            yield None if row is None else Locked(conn, to_schedule(row))

    async def delete(self, schedule_id: str, tenant: str) -> bool:
        return await self.pool.fetchval(query("delete_schedule"), schedule_id, tenant) is not None

    async def all(self) -> list[tuple[Schedule, bytes]]:
        """Every schedule with its payload JSON (for the scheduler's reconciliation)."""
        rows = await self.pool.fetch(query("all_schedules"))
        return [(to_schedule(r), bytes(r["payload"])) for r in rows]

    async def sync_times(
        self,
        times: list[tuple[str, datetime | None, datetime | None]],
        conn: AnyConnection | None = None,
    ) -> None:
        """Copy (id, next fire, last fired) from Redis; only changed rows are written."""
        if not times:
            return
        ids, nexts, lasts = (list(col) for col in zip(*times, strict=True))
        target: Any = conn or self.pool
        await target.execute(query("sync_schedule_times"), ids, nexts, lasts)
