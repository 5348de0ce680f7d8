"""Webhook routes (tenant-scoped): subscriptions, the signing secret, deliveries; and the
check of a submit's ``callback``.

Postgres holds it all; the dispatcher (``jobtier dispatcher``) reads it. A URL is checked
here when it is given (``webhooks/safety.py``: it must resolve to public addresses, unless
JOBTIER_WEBHOOK_ALLOWED_HOSTS names it) and again by the dispatcher at each delivery. A job's
callback is written before its submit reaches Redis and deleted again if the submit makes no
job of that id (``webhooks/callbacks.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from jobtier.api import spec as oa
from jobtier.api.auth import tenant_of
from jobtier.api.http import (
    decode_body,
    encoded,
    invalid,
    job_id_of,
    job_not_found,
    path_id,
    read_json_body,
)
from jobtier.api.params import limit_param, matching, parse_query
from jobtier.api.problems import Problem, not_found, postgres_or_503, secret_missing
from jobtier.config import Settings
from jobtier.core.errors import InvalidRequest
from jobtier.core.keys import ulid
from jobtier.core.model import CallbackSpec
from jobtier.core.names import WEBHOOK_ID_RE
from jobtier.engine.queue import Queue
from jobtier.persist.db import Pool, query
from jobtier.webhooks import marks
from jobtier.webhooks.callbacks import EVENTS, CallbackStore, SecretMissing
from jobtier.webhooks.safety import MAX_URL_LENGTH, AddressPolicy, Resolver
from jobtier.webhooks.signing import new_secret

MAX_DESCRIPTION = 200


class WebhookSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A subscription as a tenant asks for it: ``url`` receives every job's terminal state,
    or every transition with ``events="all"``."""

    url: str
    events: str = "terminal"
    description: str | None = None


class Webhook(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A subscription. ``secret`` is in the answer that created the tenant's signing secret
    (the first subscription's), and never again."""

    id: str
    url: str
    events: str
    created_at: datetime
    description: str | None = None
    disabled_at: datetime | None = None  # the receiver answered 410 Gone
    secret: str | None = None


class WebhookList(msgspec.Struct):
    webhooks: list[Webhook]
    next_after: str | None


class SigningSecret(msgspec.Struct):
    """A tenant's new signing secret (shown this once); the previous one keeps signing
    deliveries, beside it, until ``previous_valid_until``."""

    secret: str
    created_at: datetime
    previous_valid_until: datetime | None


class DeliveryAttempt(msgspec.Struct):
    """One attempt of a delivery: ``at`` is when it ended (its answer came, or its time limit
    passed), ``duration_ms`` how long it took."""

    attempt: int
    at: datetime
    duration_ms: float
    status: int | None  # the receiver's answer; None when none came (error says why)
    error: str | None
    response: str | None  # the start of the answer's body


class Delivery(msgspec.Struct):
    """One webhook: a transition of a job for one target (``subscription_id`` null: the
    job's own callback). ``id`` is the ``webhook-id`` header, the same on every attempt."""

    id: str
    job_id: str
    job_version: int
    subscription_id: str | None
    url: str
    event: str
    state: str  # pending, delivered, failed, cancelled
    attempts: int
    created_at: datetime
    occurred_at: datetime
    next_attempt_at: datetime | None
    last_status: int | None
    last_error: str | None
    finished_at: datetime | None
    attempt_log: list[DeliveryAttempt]


class DeliveryList(msgspec.Struct):
    deliveries: list[Delivery]


_spec_decoder = msgspec.json.Decoder(WebhookSpec)


class WebhookService:
    """What the routes and the submits share: the pool, the address policy, the group, the
    jobs' callbacks (``webhooks/callbacks.py``), with its refusals as problems."""

    def __init__(
        self, pool: Pool, queue: Queue, settings: Settings, resolver: Resolver | None = None
    ) -> None:
        self.pool = pool
        self.policy = AddressPolicy(settings.webhook_allowed_hosts, resolver)
        self.callbacks = CallbackStore(pool, queue.redis, queue.keys, self.policy)

    async def check(self, url: Any, events: Any, field: str) -> None:
        """A 422 naming ``field`` unless the URL and events are acceptable."""
        try:
            await self.callbacks.check(url, events, field)
        except InvalidRequest as exc:
            raise invalid(exc) from None

    async def register(
        self, tenant: str, callbacks: Sequence[tuple[str, CallbackSpec, str]]
    ) -> None:
        """Write a submit's callbacks ((job id, callback, field prefix)) before the submit:
        422 for a refused one, 409 if the tenant has no secret (then none is written)."""
        try:
            with postgres_or_503():
                await self.callbacks.register(tenant, callbacks)
        except SecretMissing as exc:
            raise secret_missing(exc) from None
        except InvalidRequest as exc:
            raise invalid(exc) from None

    async def forget(self, job_ids: Sequence[str]) -> None:
        """Postgres away: left and logged (an orphan callback names a job that never runs)."""
        await self.callbacks.forget(job_ids)


def _service(request: Request) -> WebhookService:
    service: WebhookService = request.state.webhooks
    return service


def _webhook_id(request: Request) -> str:
    return path_id(request, "webhook_id", WEBHOOK_ID_RE, "webhook")


def _webhook(row: Any, secret: str | None = None) -> Webhook:
    return Webhook(**{name: row[name] for name in _WEBHOOK_COLUMNS}, secret=secret)


_WEBHOOK_COLUMNS = [name for name in Webhook.__struct_fields__ if name != "secret"]
_DELIVERY_COLUMNS = [name for name in Delivery.__struct_fields__ if name != "attempt_log"]
LIST_PARAMS = [
    matching("after", "the next_after of the previous page", WEBHOOK_ID_RE, 40),
    limit_param("most subscriptions per page (default 100)", 1000),
]
DELIVERY_PARAMS = [limit_param("most deliveries (default 100)", 1000)]


async def create(request: Request) -> Response:
    tenant = tenant_of(request)
    spec: WebhookSpec = decode_body(_spec_decoder, await read_json_body(request))
    service = _service(request)
    await service.check(spec.url, spec.events, "")
    if spec.description is not None and len(spec.description) > MAX_DESCRIPTION:
        detail = f"description is over {MAX_DESCRIPTION} characters"
        raise Problem(422, "validation", detail, field="description")
    if spec.description is not None and "\x00" in spec.description:
        # (Postgres's text refuses it: it was a 500)
        raise Problem(422, "validation", "description must not hold a NUL", field="description")
    secret = new_secret()
    redis, keys = service.callbacks.redis, service.callbacks.keys
    with postgres_or_503():
        await service.callbacks.ensure_group()
        # before the row, so the dispatcher decodes this tenant's entries (webhooks/marks.py);
        # a mark left by a failed insert only costs the old path
        await marks.mark(redis, keys, [tenant])
        async with service.pool.acquire() as conn, conn.transaction():
            made = await conn.fetchrow(query("secret_create_if_missing"), tenant, secret)
            new = (f"wh_{ulid()}", tenant, spec.url, spec.events, spec.description)
            row = await conn.fetchrow(query("subscription_insert"), *new)
        # again once the row is committed: a dispatcher's clean-up may have removed the first
        # mark before the row was there (marks.unmark_idle)
        await marks.mark(redis, keys, [tenant])
    return encoded(_webhook(row, secret if made is not None else None), 201)


async def list_webhooks(request: Request) -> Response:
    tenant = tenant_of(request)
    q = parse_query(request, LIST_PARAMS)
    limit: int = q.get("limit", 100)
    with postgres_or_503():
        rows = await _service(request).pool.fetch(
            query("subscription_list"), tenant, q.get("after", ""), limit
        )
    hooks = [_webhook(r) for r in rows]
    return encoded(WebhookList(hooks, hooks[-1].id if len(hooks) == limit else None))


async def get(request: Request) -> Response:
    tenant = tenant_of(request)
    webhook_id = _webhook_id(request)
    with postgres_or_503():
        row = await _service(request).pool.fetchrow(query("subscription_get"), webhook_id, tenant)
    if row is None:
        raise not_found(f"webhook {webhook_id}")
    return encoded(_webhook(row))


async def delete(request: Request) -> Response:
    tenant = tenant_of(request)
    webhook_id = _webhook_id(request)
    with postgres_or_503():
        gone = await _service(request).pool.fetchval(
            query("subscription_delete"), webhook_id, tenant
        )
    if not gone:
        raise not_found(f"webhook {webhook_id}")
    return Response(status_code=204)


async def rotate_secret(request: Request) -> Response:
    """Create the tenant's signing secret, or replace it (the old one keeps signing for
    JOBTIER_WEBHOOK_SECRET_OVERLAP_SECONDS). The secret is in this answer only."""
    tenant = tenant_of(request)
    overlap = float(request.state.settings.webhook_secret_overlap_seconds)
    secret = new_secret()
    with postgres_or_503():
        row = await _service(request).pool.fetchrow(query("secret_rotate"), tenant, secret, overlap)
    assert row is not None
    return encoded(SigningSecret(secret, row["created_at"], row["previous_until"]), 201)


async def _deliveries(pool: Pool, rows: Sequence[Any]) -> DeliveryList:
    attempts: dict[str, list[DeliveryAttempt]] = {}
    found = await pool.fetch(query("attempts_of"), [r["id"] for r in rows]) if rows else []
    for a in found:
        duration = round(float(a["duration_ms"]), 3)
        attempt = (a["attempt"], a["at"], duration, a["status"], a["error"], a["response"])
        attempts.setdefault(a["delivery_id"], []).append(DeliveryAttempt(*attempt))
    return DeliveryList(
        [
            Delivery(**{c: r[c] for c in _DELIVERY_COLUMNS}, attempt_log=attempts.get(r["id"], []))
            for r in rows
        ]
    )


async def webhook_deliveries(request: Request) -> Response:
    """A subscription's deliveries, newest first."""
    tenant = tenant_of(request)
    webhook_id = _webhook_id(request)
    most: int = parse_query(request, DELIVERY_PARAMS).get("limit", 100)
    pool = _service(request).pool
    with postgres_or_503():
        if await pool.fetchrow(query("subscription_get"), webhook_id, tenant) is None:
            raise not_found(f"webhook {webhook_id}")
        rows = await pool.fetch(query("deliveries_of_subscription"), webhook_id, tenant, most)
        return encoded(await _deliveries(pool, rows))


async def job_deliveries(request: Request) -> Response:
    """A job's deliveries (its callback's and its tenant's subscriptions'), oldest first."""
    tenant = tenant_of(request)
    job_id = job_id_of(request)
    most: int = parse_query(request, DELIVERY_PARAMS).get("limit", 100)
    if await request.state.reader.get_for(job_id, tenant) is None:
        raise job_not_found(job_id)
    pool = _service(request).pool
    with postgres_or_503():
        rows = await pool.fetch(query("deliveries_of_job"), job_id, tenant, most)
        return encoded(await _deliveries(pool, rows))


REFUSED = (
    "the body does not fit its schema, or the URL is refused: not http(s), or its host does "
    "not resolve, or resolves to a loopback, private, link-local or otherwise non-public "
    "address (JOBTIER_WEBHOOK_ALLOWED_HOSTS lists exceptions); field names the member"
)


def operations(settings: Settings) -> oa.Paths:
    """The webhook routes of the OpenAPI document."""
    paths = oa.Paths(settings)
    unknown = oa.unknown("subscription")
    paths.add(
        "POST /v1/webhooks",
        create,
        "Subscribe a URL to the tenant's jobs: terminal states, or every transition",
        oa.returns(
            201,
            "Webhook",
            "created; secret is set when this created the tenant's signing secret (shown once)",
        ),
        oa.refuses(422, REFUSED),
        body="WebhookSpec",
    )
    paths.add(
        "GET /v1/webhooks",
        list_webhooks,
        "The tenant's subscriptions, oldest first",
        oa.page("WebhookList", "next_after"),
        params=LIST_PARAMS,
    )
    one = "/v1/webhooks/{webhook_id}"
    paths.add(
        f"GET {one}",
        get,
        "One subscription",
        oa.returns(200, "Webhook", "the subscription"),
        unknown,
    )
    paths.add(
        f"DELETE {one}",
        delete,
        "Unsubscribe: its waiting deliveries are cancelled",
        oa.DELETED,
        unknown,
    )
    paths.add(
        f"GET {one}/deliveries",
        webhook_deliveries,
        "The subscription's deliveries, newest first, each with its attempts",
        oa.returns(200, "DeliveryList", "the deliveries"),
        unknown,
        params=DELIVERY_PARAMS,
    )
    paths.add(
        "POST /v1/webhook-secret",
        rotate_secret,
        "Create or rotate the tenant's webhook signing secret (whsec_…, shown once; the previous "
        "one keeps signing for JOBTIER_WEBHOOK_SECRET_OVERLAP_SECONDS)",
        oa.returns(201, "SigningSecret", "the new secret"),
    )
    paths.add(
        "GET /v1/jobs/{job_id}/deliveries",
        job_deliveries,
        "The job's webhook deliveries (its callback's and the subscriptions'), each with its "
        "attempts",
        oa.returns(200, "DeliveryList", "the deliveries so far"),
        oa.JOB_404,
        params=DELIVERY_PARAMS,
    )
    return paths


NO_NUL = r"^[^\x00]*$"  # text Postgres keeps cannot hold a NUL


def constrain(components: dict[str, Any]) -> None:
    """The rules ``WebhookService.check`` applies that JSON Schema can state (a submit's
    CallbackSpec gets the same in openapi.py)."""
    c = components
    oa.constrain(c, "WebhookSpec", "url", maxLength=MAX_URL_LENGTH, pattern=oa.CALLBACK_URL)
    c["WebhookSpec"]["properties"]["events"]["enum"] = list(EVENTS)
    oa.constrain(c, "WebhookSpec", "description", maxLength=MAX_DESCRIPTION, pattern=NO_NUL)


OPENAPI_TYPES: list[type] = [
    WebhookSpec,
    Webhook,
    WebhookList,
    SigningSecret,
    Delivery,
    DeliveryList,
]
