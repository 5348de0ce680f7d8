"""Postgres access for webhooks: targets, deliveries and their attempts, secrets.

Deliveries wait in Postgres, not Redis, between attempts: they are a record the API shows
for as long as the job is kept, retries wait for hours, and a delivery is rare next to a
transition. Postgres keeps them durably, indexed for "what is due", and lets any number of
dispatchers share the due ones (``FOR UPDATE SKIP LOCKED``) under a lease that outlives a
dead dispatcher.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jobtier.persist.db import Pool, query


@dataclass(slots=True)
class NewDelivery:
    """A delivery made from one log entry for one target (fields in deliveries_insert's
    order)."""

    id: str
    tenant: str
    job_id: str
    job_version: int
    subscription_id: str | None
    url: str
    event: str
    body: bytes
    occurred_at: datetime


@dataclass(slots=True)
class Attempt:
    """A delivery leased for one attempt."""

    id: str
    tenant: str
    job_id: str
    subscription_id: str | None
    url: str
    body: bytes
    attempts: int  # made before this one
    occurred_at: datetime
    lease: str


@dataclass(slots=True)
class Outcome:
    """What one attempt came to, for ``record`` (fields in deliveries_record's order)."""

    id: str
    lease: str
    state: str  # pending (a retry is due at next_attempt_at), delivered, failed, cancelled
    at: datetime
    duration_ms: float
    status: int | None
    error: str | None
    response: str | None
    next_attempt_at: datetime | None


def new_lease() -> str:
    return os.urandom(12).hex()


def _columns(items: Sequence[Any]) -> list[list[Any]]:
    """Dataclass items as one array per field, in field order (the order of the unnest)."""
    return [[getattr(item, f.name) for item in items] for f in dataclasses.fields(items[0])]


class DeliveryStore:
    """The dispatcher's queries (webhooks.sql)."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    async def targets(
        self, tenants: Sequence[str], job_ids: Sequence[str]
    ) -> tuple[list[Any], list[Any]]:
        """(live subscriptions of ``tenants``, callbacks of ``job_ids``), one connection."""
        async with self.pool.acquire() as conn:
            subs = await conn.fetch(query("targets_subscriptions"), list(tenants))
            callbacks = await conn.fetch(query("targets_callbacks"), list(job_ids))
        return list(subs), list(callbacks)

    async def target_tenants(self) -> list[str]:
        """Every tenant with a live subscription or a job's callback (the dispatcher marks
        them at start-up: ``webhooks/marks.py``)."""
        rows = await self.pool.fetch(query("targets_tenants"))
        return [r["tenant"] for r in rows]

    async def with_targets(self, tenants: Sequence[str]) -> set[str]:
        """Which of ``tenants`` have a live subscription or a job's callback now."""
        rows = await self.pool.fetch(query("targets_tenants_among"), list(tenants))
        return {r["tenant"] for r in rows}

    async def insert(self, items: Sequence[NewDelivery]) -> int:
        """Insert deliveries, due now (an id already there is skipped); returns how many
        were new."""
        if not items:
            return 0
        rows = await self.pool.fetch(query("deliveries_insert"), *_columns(items))
        return len(rows)

    async def lease_due(self, limit: int, lease_seconds: float) -> list[Attempt]:
        """Up to ``limit`` due deliveries (retries, and those a dead dispatcher held)."""
        if limit <= 0:
            return []
        lease = new_lease()
        rows = await self.pool.fetch(query("deliveries_lease_due"), limit, lease_seconds, lease)
        return [Attempt(**dict(r, body=bytes(r["body"])), lease=lease) for r in rows]

    async def record(self, outcomes: Sequence[Outcome]) -> int:
        """Record attempts' outcomes; returns how many were recorded (a lease lost to
        another dispatcher is not)."""
        if not outcomes:
            return 0
        rows = await self.pool.fetch(query("deliveries_record"), *_columns(outcomes))
        return len(rows)

    async def disable_subscription(self, subscription_id: str) -> None:
        await self.pool.execute(query("subscription_disable"), subscription_id)

    async def secrets(self, tenants: Sequence[str]) -> dict[str, list[str]]:
        """The secrets each tenant signs with now (current first)."""
        rows = await self.pool.fetch(query("secrets_for"), list(tenants))
        return {
            r["tenant"]: [r["secret"], *([r["previous"]] if r["previous"] else [])] for r in rows
        }

    async def pending(self) -> tuple[int, datetime | None]:
        """(deliveries waiting for an attempt, when the next is due)."""
        row = await self.pool.fetchrow(query("deliveries_pending_count"))
        assert row is not None
        return int(row["pending"]), row["next_due"]
