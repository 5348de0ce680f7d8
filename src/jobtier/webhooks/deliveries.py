"""Postgres access for webhooks: targets, deliveries and their attempts, secrets; and the
deliveries a batch of log entries makes (``made_from``).

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
from datetime import UTC, datetime
from typing import Any

import asyncpg
import msgspec

from jobtier.core.model import TERMINAL, decode_status
from jobtier.persist.db import UNAVAILABLE, AnyConnection, Pool, query
from jobtier.streams.entries import LogEntry

# Postgres is unreachable or refusing work for now: keep the work and try again later
PG_UNAVAILABLE: tuple[type[BaseException], ...] = (*UNAVAILABLE, asyncpg.PostgresError)


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


def event_type(entry: LogEntry) -> str:
    """``job.<state>`` for a change of state (the submit included), ``job.updated`` for a
    change within one (progress, a cancel request)."""
    state = entry.status.state.value
    return f"job.{state}" if entry.from_state != state else "job.updated"


def delivery_id(job_id: str, version: int, target: str | None) -> str:
    """The webhook-id: one per (transition, target), the same however often it is made."""
    return f"msg_{job_id}_{version}_{target or 'job'}"


def body_of(entry: LogEntry, event: str) -> bytes:
    """``{"type", "timestamp", "data"}`` (the Standard Webhooks shape); data is the status
    document exactly as the status tier serves it."""
    stamp = msgspec.json.encode(entry.status.updated_at)
    return (
        b'{"type":"' + event.encode() + b'","timestamp":' + stamp + b',"data":' + entry.doc + b"}"
    )


def made_from(
    entries: Sequence[LogEntry], subs: Sequence[Any], callbacks: Sequence[Any]
) -> list[NewDelivery]:
    """One delivery per (entry, target) among ``DeliveryStore.targets``' answer: a job's
    callback, and its tenant's subscriptions (those made before the transition)."""
    by_tenant: dict[str, list[Any]] = {}
    for s in subs:
        by_tenant.setdefault(s["tenant"], []).append(s)
    by_job = {c["job_id"]: c for c in callbacks}
    out: list[NewDelivery] = []
    for e in entries:
        terminal = e.status.state in TERMINAL
        at = datetime.fromtimestamp(e.ms / 1000, UTC)
        targets: list[tuple[str | None, str]] = []
        cb = by_job.get(e.status.id)
        if cb is not None and cb["tenant"] == e.tenant and (terminal or cb["events"] == "all"):
            targets.append((None, cb["url"]))
        for s in by_tenant.get(e.tenant, ()):
            # a subscription sees the transitions made after it was created
            if (terminal or s["events"] == "all") and s["created_at"] <= at:
                targets.append((s["id"], s["url"]))
        if not targets:
            continue
        event = event_type(e)
        body = body_of(e, event)
        for sub_id, url in targets:
            out.append(
                NewDelivery(
                    delivery_id(e.status.id, e.status.version, sub_id),
                    e.tenant,
                    e.status.id,
                    e.status.version,
                    sub_id,
                    url,
                    event,
                    body,
                    at,
                )
            )
    return out


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


async def deliver_ended(conn: AnyConnection, ended: Sequence[tuple[str, bytes]]) -> int:
    """The deliveries of jobs that ended without reaching Redis, whose transition logs the
    dispatchers follow: outbox rows the relay refused (``job.failed``) or that were cancelled
    before it (``job.cancelled``). ``ended``: (tenant, status document) of each. Made in
    ``conn``'s transaction, the one that ends the rows: both or neither. Due at once, for the
    tenants' subscriptions (such a job has no callback of its own); how many were made."""
    if not ended:
        return 0
    subs = await conn.fetch(query("targets_subscriptions"), list({t for t, _ in ended}))
    if not subs:
        return 0
    entries = []
    for tenant, doc in ended:
        status = decode_status(doc)
        # when, as a log entry's id says it: the row's end by Postgres's clock, which a
        # subscription's created_at is compared with (made_from)
        ms = int(datetime.fromisoformat(status.updated_at).timestamp() * 1000)
        entries.append(LogEntry(0, f"{ms}-0".encode(), status, doc, tenant, "submitted", "outbox"))
    items = made_from(entries, subs, ())
    if not items:
        return 0
    return len(await conn.fetch(query("deliveries_insert"), *_columns(items)))
