"""Postgres access for webhooks: targets, deliveries and their attempts, secrets.

Deliveries wait in Postgres, not Redis, between attempts. They are a record the API must
show (each attempt, its status code and timing) for as long as the job is kept, retries wait
for hours, and a delivery is rare next to a transition: Postgres keeps them durably in one
place, indexed for "what is due" (a partial index on pending rows), and lets any number of
dispatchers share the due ones (``FOR UPDATE SKIP LOCKED``) with a lease that a dead
dispatcher's deliveries outlive. Redis stays the jobs' hot path only.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jobtier.persist.db import Pool, query


@dataclass(slots=True)
class NewDelivery:
    """A delivery made from one log entry for one target."""

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
    """What one attempt came to, for ``record``."""

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
        rows = await self.pool.fetch(
            query("deliveries_insert"),
            [d.id for d in items], [d.tenant for d in items], [d.job_id for d in items],
            [d.job_version for d in items], [d.subscription_id for d in items],
            [d.url for d in items], [d.event for d in items], [d.body for d in items],
            [d.occurred_at for d in items],
        )  # fmt: skip
        return len(rows)

    async def lease_due(self, limit: int, lease_seconds: float) -> list[Attempt]:
        """Up to ``limit`` due deliveries (retries, and those a dead dispatcher held)."""
        if limit <= 0:
            return []
        lease = new_lease()
        rows = await self.pool.fetch(query("deliveries_lease_due"), limit, lease_seconds, lease)
        return [
            Attempt(
                r["id"],
                r["tenant"],
                r["job_id"],
                r["subscription_id"],
                r["url"],
                bytes(r["body"]),
                r["attempts"],
                r["occurred_at"],
                lease,
            )
            for r in rows
        ]

    async def record(self, outcomes: Sequence[Outcome]) -> int:
        """Record attempts' outcomes; returns how many were recorded (a lease lost to
        another dispatcher is not)."""
        if not outcomes:
            return 0
        o = outcomes
        rows = await self.pool.fetch(
            query("deliveries_record"),
            [x.id for x in o], [x.lease for x in o], [x.state for x in o], [x.at for x in o],
            [x.duration_ms for x in o], [x.status for x in o], [x.error for x in o],
            [x.response for x in o], [x.next_attempt_at for x in o],
        )  # fmt: skip
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
