"""Webhook routes (tenant-scoped): subscriptions, the signing secret, deliveries; and the
check of a submit's ``callback``.

Postgres holds it all (migration 0007); the dispatcher (``jobtier dispatcher``) reads it.
A URL is checked here when it is given (``webhooks/safety.py``: it must resolve to public
addresses, unless JOBTIER_WEBHOOK_ALLOWED_HOSTS names it) and again by the dispatcher at
each delivery. A job's callback is written before its submit reaches Redis and deleted
again if the submit makes no job of that id (``webhooks/callbacks.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from jobtier.api import spec as oa
from jobtier.api.auth import tenant_of
from jobtier.api.http import JSON, decode_body, job_id_of, job_not_found, read_json_body
from jobtier.api.params import Param, parse_query
from jobtier.api.problems import PG_DOWN, Problem, not_found, pg_unavailable, secret_missing
from jobtier.config import Settings
from jobtier.core.errors import InvalidRequest
from jobtier.core.keys import ulid
from jobtier.core.model import CallbackSpec
from jobtier.core.names import WEBHOOK_ID_RE
from jobtier.engine.queue import Queue
from jobtier.persist.db import Pool, query
from jobtier.webhooks import marks
from jobtier.webhooks.callbacks import CallbackStore, SecretMissing
from jobtier.webhooks.safety import MAX_URL_LENGTH, AddressPolicy, Resolver
from jobtier.webhooks.signing import new_secret

EVENTS = oa.CALLBACK_EVENTS
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
        self.queue = queue
        self.policy = AddressPolicy(settings.webhook_allowed_hosts, resolver)
        self.callbacks = CallbackStore(pool, queue.redis, queue.keys, self.policy)

    async def check(self, url: Any, events: Any, field: str) -> None:
        """A 422 naming ``field`` unless the URL and events are acceptable."""
        try:
            await self.callbacks.check(url, events, field)
        except InvalidRequest as exc:
            raise Problem(422, "validation", str(exc), field=exc.field) from None

    async def ensure_group(self) -> None:
        """The dispatchers' group exists before the first webhook is accepted."""
        await self.callbacks.ensure_group()

    async def register(
        self, tenant: str, callbacks: Sequence[tuple[str, CallbackSpec, str]]
    ) -> None:
        """Write a submit's callbacks ((job id, callback, field prefix)) before the submit:
        422 for a refused one, 409 if the tenant has no secret (then none is written)."""
        try:
            await self.callbacks.register(tenant, callbacks)
        except PG_DOWN:
            raise pg_unavailable() from None
        except SecretMissing as exc:
            raise secret_missing(exc) from None
        except InvalidRequest as exc:
            raise Problem(422, "validation", str(exc), field=exc.field) from None

    async def forget(self, job_ids: Sequence[str]) -> None:
        try:
            await self.callbacks.forget(job_ids)
        except PG_DOWN:  # an orphan callback names a job that never runs: harmless
            pass


def _service(request: Request) -> WebhookService:
    service: WebhookService = request.state.webhooks
    return service


def _webhook_id(request: Request) -> str:
    webhook_id: str = request.path_params["webhook_id"]
    if not WEBHOOK_ID_RE.fullmatch(webhook_id):
        raise not_found(f"webhook {webhook_id[:40]}")
    return webhook_id


def _webhook(row: Any, secret: str | None = None) -> Webhook:
    return Webhook(
        id=row["id"], url=row["url"], events=row["events"], created_at=row["created_at"],
        description=row["description"], disabled_at=row["disabled_at"], secret=secret,
    )  # fmt: skip


def _json(value: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(value), status, media_type=JSON)


LIST_PARAMS = [
    Param("after", "string", "the next_after of the previous page", max_length=40,
          pattern=WEBHOOK_ID_RE.pattern),
    Param("limit", "integer", "most subscriptions per page (default 100)", minimum=1, maximum=1000),
]  # fmt: skip
DELIVERY_PARAMS = [
    Param("limit", "integer", "most deliveries (default 100)", minimum=1, maximum=1000),
]


async def create(request: Request) -> Response:
    tenant = tenant_of(request)
    spec: WebhookSpec = decode_body(_spec_decoder, await read_json_body(request))
    service = _service(request)
    await service.check(spec.url, spec.events, "")
    if spec.description is not None and len(spec.description) > MAX_DESCRIPTION:
        raise Problem(
            422, "validation", f"description is over {MAX_DESCRIPTION} characters",
            field="description",
        )  # fmt: skip
    secret = new_secret()
    try:
        await service.ensure_group()
        # before the row: the dispatcher then decodes this tenant's entries
        # (webhooks/marks.py); a mark left by a failed insert only costs the old path
        await marks.mark(service.callbacks.redis, service.callbacks.keys, [tenant])
        async with service.pool.acquire() as conn, conn.transaction():
            made = await conn.fetchrow(query("secret_create_if_missing"), tenant, secret)
            row = await conn.fetchrow(
                query("subscription_insert"), f"wh_{ulid()}", tenant, spec.url, spec.events,
                spec.description,
            )  # fmt: skip
        # and again once the row is committed, before the answer: a dispatcher's clean-up
        # may have removed the first mark before the row was there (marks.unmark_idle)
        await marks.mark(service.callbacks.redis, service.callbacks.keys, [tenant])
    except PG_DOWN:
        raise pg_unavailable() from None
    return _json(_webhook(row, secret if made is not None else None), 201)


async def list_webhooks(request: Request) -> Response:
    tenant = tenant_of(request)
    q = parse_query(request, LIST_PARAMS)
    limit: int = q.get("limit", 100)
    try:
        rows = await _service(request).pool.fetch(
            query("subscription_list"), tenant, q.get("after", ""), limit
        )
    except PG_DOWN:
        raise pg_unavailable() from None
    hooks = [_webhook(r) for r in rows]
    return _json(WebhookList(hooks, hooks[-1].id if len(hooks) == limit else None))


async def get(request: Request) -> Response:
    tenant = tenant_of(request)
    webhook_id = _webhook_id(request)
    try:
        row = await _service(request).pool.fetchrow(query("subscription_get"), webhook_id, tenant)
    except PG_DOWN:
        raise pg_unavailable() from None
    if row is None:
        raise not_found(f"webhook {webhook_id}")
    return _json(_webhook(row))


async def delete(request: Request) -> Response:
    tenant = tenant_of(request)
    webhook_id = _webhook_id(request)
    try:
        gone = await _service(request).pool.fetchval(
            query("subscription_delete"), webhook_id, tenant
        )
    except PG_DOWN:
        raise pg_unavailable() from None
    if not gone:
        raise not_found(f"webhook {webhook_id}")
    return Response(status_code=204)


async def rotate_secret(request: Request) -> Response:
    """Create the tenant's signing secret, or replace it (the old one keeps signing for
    JOBTIER_WEBHOOK_SECRET_OVERLAP_SECONDS). The secret is in this answer only."""
    tenant = tenant_of(request)
    settings: Settings = request.state.settings
    secret = new_secret()
    try:
        row = await _service(request).pool.fetchrow(
            query("secret_rotate"), tenant, secret, float(settings.webhook_secret_overlap_seconds)
        )
    except PG_DOWN:
        raise pg_unavailable() from None
    assert row is not None
    return _json(SigningSecret(secret, row["created_at"], row["previous_until"]), 201)


async def _deliveries(pool: Pool, rows: Sequence[Any]) -> DeliveryList:
    attempts: dict[str, list[DeliveryAttempt]] = {}
    if rows:
        for a in await pool.fetch(query("attempts_of"), [r["id"] for r in rows]):
            attempts.setdefault(a["delivery_id"], []).append(DeliveryAttempt(
                a["attempt"], a["at"], round(float(a["duration_ms"]), 3), a["status"],
                a["error"], a["response"],
            ))  # fmt: skip
    return DeliveryList([
        Delivery(
            r["id"], r["job_id"], r["job_version"], r["subscription_id"], r["url"], r["event"],
            r["state"], r["attempts"], r["created_at"], r["occurred_at"], r["next_attempt_at"],
            r["last_status"], r["last_error"], r["finished_at"], attempts.get(r["id"], []),
        )
        for r in rows
    ])  # fmt: skip


async def webhook_deliveries(request: Request) -> Response:
    """A subscription's deliveries, newest first."""
    tenant = tenant_of(request)
    webhook_id = _webhook_id(request)
    limit: int = parse_query(request, DELIVERY_PARAMS).get("limit", 100)
    pool = _service(request).pool
    try:
        if await pool.fetchrow(query("subscription_get"), webhook_id, tenant) is None:
            raise not_found(f"webhook {webhook_id}")
        rows = await pool.fetch(query("deliveries_of_subscription"), webhook_id, tenant, limit)
        return _json(await _deliveries(pool, rows))
    except PG_DOWN:
        raise pg_unavailable() from None


async def job_deliveries(request: Request) -> Response:
    """A job's deliveries (its callback's and its tenant's subscriptions'), oldest first."""
    tenant = tenant_of(request)
    job_id = job_id_of(request)
    limit: int = parse_query(request, DELIVERY_PARAMS).get("limit", 100)
    found = await request.state.reader.get(job_id)
    if found is None or found[0] != tenant:
        raise job_not_found(job_id)
    pool = _service(request).pool
    try:
        rows = await pool.fetch(query("deliveries_of_job"), job_id, tenant, limit)
        return _json(await _deliveries(pool, rows))
    except PG_DOWN:
        raise pg_unavailable() from None


routes = [
    Route("/v1/webhooks", create, methods=["POST"]),
    Route("/v1/webhooks", list_webhooks, methods=["GET"]),
    Route("/v1/webhooks/{webhook_id}", get, methods=["GET"]),
    Route("/v1/webhooks/{webhook_id}", delete, methods=["DELETE"]),
    Route("/v1/webhooks/{webhook_id}/deliveries", webhook_deliveries, methods=["GET"]),
    Route("/v1/webhook-secret", rotate_secret, methods=["POST"]),
    Route("/v1/jobs/{job_id}/deliveries", job_deliveries, methods=["GET"]),
]

WEBHOOK_ID = {
    "name": "webhook_id", "in": "path", "required": True,
    "description": "a subscription id (a malformed or unknown one is a 404)",
    "schema": {"type": "string", "pattern": WEBHOOK_ID_RE.pattern},
}  # fmt: skip
_NOT_FOUND = oa.problem("unknown subscription (or another tenant's, or a malformed id)")
REFUSED = (
    "the body does not fit its schema, or the URL is refused: not http(s), or its host does "
    "not resolve, or resolves to a loopback, private, link-local or otherwise non-public "
    "address (JOBTIER_WEBHOOK_ALLOWED_HOSTS lists exceptions); field names the member"
)


def openapi_paths(settings: Settings) -> dict[str, Any]:
    """The webhook routes of the OpenAPI document."""
    s = settings
    op = oa.operation
    return {
        "/v1/webhooks": {
            "post": op(s, "Subscribe a URL to the tenant's jobs: terminal states, or every transition", {
                "201": oa.json_response("Webhook", "created; secret is set when this created the tenant's signing secret (shown once)"),
                "422": oa.problem(REFUSED),
            }, body="WebhookSpec"),
            "get": op(s, "The tenant's subscriptions, oldest first", {
                "200": oa.json_response("WebhookList", "a page; next_after is null on the last"),
            }, params=LIST_PARAMS),
        },
        "/v1/webhooks/{webhook_id}": {
            "get": op(s, "One subscription", {"200": oa.json_response("Webhook", "the subscription"), "404": _NOT_FOUND}, path=[WEBHOOK_ID]),
            "delete": op(s, "Unsubscribe: its waiting deliveries are cancelled", {"204": {"description": "deleted"}, "404": _NOT_FOUND}, path=[WEBHOOK_ID]),
        },
        "/v1/webhooks/{webhook_id}/deliveries": {
            "get": op(s, "The subscription's deliveries, newest first, each with its attempts", {
                "200": oa.json_response("DeliveryList", "the deliveries"),
                "404": _NOT_FOUND,
            }, path=[WEBHOOK_ID], params=DELIVERY_PARAMS),
        },
        "/v1/webhook-secret": {
            "post": op(s, "Create or rotate the tenant's webhook signing secret (whsec_…, shown once; the previous one keeps signing for JOBTIER_WEBHOOK_SECRET_OVERLAP_SECONDS)", {
                "201": oa.json_response("SigningSecret", "the new secret"),
            }),
        },
        "/v1/jobs/{job_id}/deliveries": {
            "get": op(s, "The job's webhook deliveries (its callback's and the subscriptions'), each with its attempts", {
                "200": oa.json_response("DeliveryList", "the deliveries so far"),
                "404": oa.problem("unknown job (or another tenant's, or a malformed id)"),
            }, path=[oa.JOB_ID], params=DELIVERY_PARAMS),
        },
    }  # fmt: skip


def constrain(components: dict[str, Any]) -> None:
    """The rules ``WebhookService.check`` applies that JSON Schema can state (a submit's
    CallbackSpec gets the same in openapi.py)."""
    c = components
    oa.constrain(c, "WebhookSpec", "url", maxLength=MAX_URL_LENGTH, pattern=oa.CALLBACK_URL)
    c["WebhookSpec"]["properties"]["events"]["enum"] = list(oa.CALLBACK_EVENTS)
    oa.constrain(c, "WebhookSpec", "description", maxLength=MAX_DESCRIPTION)


OPENAPI_TYPES: list[type] = [
    WebhookSpec, Webhook, WebhookList, SigningSecret, Delivery, DeliveryList,
]  # fmt: skip
