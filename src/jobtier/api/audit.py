"""The audit of admin actions, and of tenants' changes to their schedules: a log line each
(``event=admin_action``, ``event=tenant_action``), and a row in Postgres.

Every route that changes something with the admin key runs its action inside
``audited(request, action, target)``: once the action is done, refused or failed, the record
says who (``admin:<fingerprint>``, never the key), when, what, on what, the HTTP status
answered and what it did. The answer goes out only after the record is stored. A schedule's
routes do the same with a tenant's key (``tenant:<tenant>:<fingerprint>``): who changed the
nightly schedule is an operator's question.

When Postgres is down the action still runs (an operator may need to pause a queue during an
outage) and its record waits in Redis (``jt:audit:pending``) until a later action or audit read
of any API process finds Postgres back and writes it (the id is the row's key: a record written
twice is one row).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import msgspec
from starlette.requests import Request

from jobtier.api.auth import bearer_key, raw_header
from jobtier.api.problems import PG_DOWN, Problem, status_answered
from jobtier.core.keys import ulid
from jobtier.persist.audit_store import AuditRecord, AuditStore

log = logging.getLogger("jobtier.audit")

FLUSH_BATCH = 100  # deferred records written per action (a backlog drains over a few)
_encode = msgspec.json.Encoder()
_decode = msgspec.json.Decoder(AuditRecord)
_ACTION = "event=%s id=%s actor=%s action=%s target=%s status=%d source=%s detail=%s"


def fingerprint(key: str) -> str:
    """Who an admin key is in the audit, without the key: ``admin:`` and 12 hex digits."""
    return "admin:" + hashlib.sha256(key.encode()).hexdigest()[:12]


def actor_of(request: Request) -> str:
    """The fingerprint of the request's key (call after ``require_admin``)."""
    return fingerprint(bearer_key(raw_header(request, b"authorization")) or "")


def tenant_actor(request: Request, tenant: str) -> str:
    """Who a tenant's key is in the audit: ``tenant:<tenant>:`` and 12 hex digits of it (a
    tenant may have several keys; call after ``tenant_of``)."""
    key = bearer_key(raw_header(request, b"authorization")) or ""
    return f"tenant:{tenant}:" + hashlib.sha256(key.encode()).hexdigest()[:12]


@dataclass
class Outcome:
    """What an audited action sets: its answer's status (200 unless it raised) and detail."""

    status: int = 200
    detail: Any = None
    actor: str | None = None  # a tenant's (tenant_actor); None: the admin key's


@contextlib.asynccontextmanager
async def audited(
    request: Request, action: str, target: str, actor: str | None = None
) -> AsyncIterator[Outcome]:
    """Run an admin action in the block, then record it; the block sets ``outcome.detail``.
    A ``Problem`` it raises is recorded with its status, any other error with the status
    the app answers it with (``status_answered``: 503 for a backend outage or a failover, when
    it may or may not have taken effect; 500 for a defect); either is raised on. ``actor``: a
    tenant's (``tenant_actor``), else the admin key's."""
    outcome = Outcome(actor=actor)
    try:
        yield outcome
    except Problem as exc:
        outcome.status = exc.status
        outcome.detail = {"refused": exc.slug, "detail": exc.detail}
        await record(request, action, target, outcome)
        raise
    except Exception as exc:
        outcome.status = status_answered(exc)
        outcome.detail = {"error": type(exc).__name__}
        with contextlib.suppress(Exception):  # the action's own error is the one to raise
            await record(request, action, target, outcome)
        raise
    await record(request, action, target, outcome)


async def record(request: Request, action: str, target: str, outcome: Outcome) -> AuditRecord:
    """Log the action and store its record (Postgres, or Redis until Postgres is back)."""
    rec = AuditRecord(
        id=ulid(),
        at=datetime.now(UTC),
        actor=outcome.actor or actor_of(request),
        action=action,
        target=target,
        status=outcome.status,
        detail=outcome.detail,
        source=request.client.host if request.client else None,
    )
    detail = _encode.encode(rec.detail).decode()
    event = "tenant_action" if outcome.actor else "admin_action"
    log.info(
        _ACTION, event, rec.id, rec.actor, rec.action, rec.target, rec.status, rec.source, detail
    )
    store: AuditStore | None = getattr(request.state, "audit_store", None)
    if store is None:
        return rec  # an API without Postgres: the log is the audit
    queue = request.state.queue
    try:
        await store.insert([rec])
    except PG_DOWN as exc:
        await queue.redis.rpush(queue.keys.audit_pending(), _encode.encode(rec))
        log.warning("event=audit_deferred id=%s error=%r", rec.id, exc)
        return rec
    await flush_pending(request)
    return rec


async def flush_pending(request: Request) -> int:
    """Write records deferred while Postgres was down; how many were written. Each is taken
    off the Redis list by value once written, so two API processes flushing at once write
    some twice (one row each) and drop none."""
    store: AuditStore | None = getattr(request.state, "audit_store", None)
    if store is None:
        return 0
    queue = request.state.queue
    pending = queue.keys.audit_pending()
    raw = await queue.redis.lrange(pending, 0, FLUSH_BATCH - 1)
    if not raw:
        return 0
    records = []
    for item in raw:
        try:
            records.append(_decode.decode(item))
        except msgspec.DecodeError:
            log.error("event=audit_unreadable record=%r", item[:200])
    try:
        await store.insert(records)
    except PG_DOWN:
        return 0  # still down: they wait
    pipe = queue.redis.pipeline(transaction=False)
    for item in raw:
        pipe.lrem(pending, 1, item)
    await pipe.execute()
    log.info("event=audit_flushed records=%d", len(records))
    return len(records)
