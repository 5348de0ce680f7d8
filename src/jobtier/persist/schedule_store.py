"""Schedules in Postgres: the durable copy the API writes and the scheduler reconciles from."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import msgspec

from jobtier.core.model import Priority
from jobtier.core.schedule import Schedule
from jobtier.persist.db import AnyConnection, Pool, query

_any = msgspec.json.Decoder()
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class DuplicateName(Exception):
    """The tenant already has a schedule of this name."""


class Busy(Exception):
    """Another change holds the schedule's row longer than ``LOCK_TIMEOUT_MS``."""


# how long a change waits for another's lock on a schedule's row before giving up (Busy): a
# change waiting holds a connection of the pool, and one whose Redis write hangs holds the lock
LOCK_TIMEOUT_MS = 5000


def revision(schedule: Schedule) -> str:
    """The row's revision, as the Redis copy records it (``rev``): its ``updated_at`` in µs."""
    return str((schedule.updated_at - _EPOCH) // timedelta(microseconds=1))


# the columns of `schedules` (each a field of Schedule) that Schedule names otherwise
_RENAMED = {"interval_seconds": "interval", "misfire_policy": "misfire"}


_FIELDS = frozenset(Schedule.__struct_fields__)


def to_schedule(row: asyncpg.Record) -> Schedule:
    """A row as a Schedule; a column it has no field for (a later migration's, read by a
    process not rolled yet) is left out."""
    fields = {_RENAMED.get(column, column): value for column, value in row.items()}
    fields = {name: value for name, value in fields.items() if name in _FIELDS}
    fields.update(payload=_any.decode(row["payload"]), priority=Priority(row["priority"]))
    return Schedule(**fields)


def _dates(schedule: Schedule) -> tuple[datetime | None, datetime | None]:
    return schedule.start_at, schedule.end_at


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
                query("update_schedule"), s.id, s.tenant, *job, *timing, s.queue, *_dates(s)
            )
        except asyncpg.UniqueViolationError:
            raise DuplicateName(schedule.name) from None
        assert row is not None  # locked: it is there
        return to_schedule(row)

    async def delete(self) -> None:
        await self.conn.execute(query("delete_schedule"), self.schedule.id, self.schedule.tenant)


class ScheduleStore:
    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    async def insert(self, schedule: Schedule, payload: bytes) -> Schedule:
        s = schedule
        job = (s.id, s.tenant, s.name, s.type, payload, s.priority.value, s.max_attempts)
        timing = (s.cron, s.timezone, s.interval, s.misfire, s.paused, s.next_fire_at)
        try:
            row = await self.pool.fetchrow(
                query("insert_schedule"), *job, *timing, s.created_at, s.queue, *_dates(s)
            )
        except asyncpg.UniqueViolationError:
            raise DuplicateName(schedule.name) from None
        assert row is not None
        return to_schedule(row)

    async def named(self, tenant: str, name: str) -> bool:
        """Whether the tenant has a schedule of that name."""
        return await self.pool.fetchval(query("schedule_named"), tenant, name) is not None

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
        rolls back if it raises); None when there is no such schedule. ``Busy`` when another
        change holds it past ``LOCK_TIMEOUT_MS``."""
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(f"SET LOCAL lock_timeout = {LOCK_TIMEOUT_MS}")
            try:
                row = await conn.fetchrow(query("lock_schedule"), schedule_id, tenant)
            except asyncpg.LockNotAvailableError:
                raise Busy(schedule_id) from None
            yield None if row is None else Locked(conn, to_schedule(row))

    async def delete(self, schedule_id: str, tenant: str) -> bool:
        return await self.pool.fetchval(query("delete_schedule"), schedule_id, tenant) is not None

    async def all(self) -> list[tuple[Schedule, bytes]]:
        """Every schedule with its payload JSON (for the scheduler's reconciliation)."""
        rows = await self.pool.fetch(query("all_schedules"))
        return [(to_schedule(r), bytes(r["payload"])) for r in rows]

    async def sync_times(
        self,
        times: list[tuple[Schedule, datetime | None, datetime | None]],
        conn: AnyConnection | None = None,
    ) -> None:
        """Copy (next fire, last fired) from Redis to each schedule's row, only where the
        row is still as read (its ``updated_at``: a change that landed meanwhile wrote its
        own) and the times differ."""
        if not times:
            return
        ids = [s.id for s, _, _ in times]
        revs = [s.updated_at for s, _, _ in times]
        nexts = [n for _, n, _ in times]
        lasts = [last for _, _, last in times]
        target: Any = conn or self.pool
        await target.execute(query("sync_schedule_times"), ids, nexts, lasts, revs)
