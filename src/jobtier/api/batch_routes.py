"""Batch routes: submit a batch (``POST /v1/batches``), read it, cancel it, retry its failed
children (``docs/batches.md``)."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from jobtier.api import durable_submit as durable
from jobtier.api import spec as oa
from jobtier.api.auth import tenant_of
from jobtier.api.durable_submit import replicated
from jobtier.api.http import encoded, invalid, registrar, submit_body
from jobtier.api.problems import Problem
from jobtier.config import Settings
from jobtier.core.batch_model import (
    MAX_BATCH_CHILDREN,
    MAX_BATCH_ITEMS,
    BatchCallback,
    BatchChanged,
    BatchNotFound,
    BatchSpec,
    BatchStatus,
)
from jobtier.core.errors import IdempotencyConflict, InvalidRequest
from jobtier.core.names import IDEMPOTENCY_KEY_RE, QUEUE_NAME_RE, TASK_NAME_RE
from jobtier.engine.queue import Queue
from jobtier.engine.validate import MAX_ATTEMPTS_LIMIT

OPENAPI_TYPES: list[type] = [BatchSpec, BatchCallback, BatchStatus, BatchChanged]
_decoder = msgspec.json.Decoder(BatchSpec)


def _not_found(batch_id: str) -> Problem:
    return Problem(404, "not-found", f"batch {batch_id} not found", batch_id=batch_id)


def _batch_id(request: Request) -> str:
    batch_id: str = request.path_params["batch_id"]
    if not request.state.queue.keys.valid_id(batch_id):
        raise _not_found(batch_id)
    return batch_id


async def submit(request: Request) -> Response:
    tenant = tenant_of(request)
    st = request.state
    queue: Queue = st.queue
    body: BatchSpec = await submit_body(request, _decoder)  # the Idempotency-Key header too
    try:
        prepared = await queue.batches.prepare(body, tenant)
        st.admission.check(tenant, len(prepared.children), priority=prepared.priority)
        hook = body.callback.webhook if body.callback is not None else None
        service = registrar(request, [hook], "callback.webhook.") if hook else None
        async with replicated(request):
            status = await queue.batches.submit_prepared(prepared, hook, service)
    except InvalidRequest as exc:
        raise invalid(exc) from None
    except IdempotencyConflict as exc:
        detail = f"idempotency key {exc.key!r} was used for another request (batch {exc.job_id})"
        raise Problem(409, "idempotency-conflict", detail, batch_id=exc.job_id) from None
    except BatchNotFound as exc:
        gone = f"this idempotency key made batch {exc.batch_id}, which is no longer kept"
        raise Problem(409, "idempotency-conflict", gone, batch_id=exc.batch_id) from None
    headers = {"Location": f"/v1/batches/{status.id}"}
    return Response(msgspec.json.encode(status), 202, headers, media_type="application/json")


async def get(request: Request) -> Response:
    batch_id = _batch_id(request)
    queue: Queue = request.state.queue
    try:
        return encoded(await queue.batches.status(batch_id, tenant_of(request)))
    except BatchNotFound:
        raise _not_found(batch_id) from None


async def cancel(request: Request) -> Response:
    batch_id = _batch_id(request)
    queue: Queue = request.state.queue
    try:
        return encoded(await queue.batches.cancel(batch_id, tenant_of(request)))
    except BatchNotFound:
        raise _not_found(batch_id) from None


async def retry(request: Request) -> Response:
    batch_id = _batch_id(request)
    queue: Queue = request.state.queue
    try:
        return encoded(await queue.batches.retry(batch_id, tenant_of(request)))
    except BatchNotFound:
        raise _not_found(batch_id) from None


def operations(settings: Settings) -> oa.Paths:
    """The batch routes of the OpenAPI document."""
    s = settings
    paths = oa.Paths(s)
    unknown = oa.unknown("batch")
    paths.add(
        "POST /v1/batches",
        submit,
        f"Submit a batch: one child job per item (or per chunk_size items), up to "
        f"{MAX_BATCH_CHILDREN} children, and a callback job once all have finished",
        oa.returns(202, "BatchStatus", "created: the batch's status"),
        (
            413,
            oa.too_large(
                s,
                oa.payload_too_large(s),
                f"more than {MAX_BATCH_CHILDREN} children or {MAX_BATCH_ITEMS} items",
            ),
        ),
        oa.refuses(
            422,
            "the body does not fit its schema, or a rule it cannot state: no items, a type no "
            "worker runs, a webhook URL the address policy refuses, …; field names the member "
            "(items, callback.type, callback.webhook.url); nothing is submitted",
        ),
        oa.refuses(
            409,
            "a webhook was given and the tenant has no webhook signing secret (nothing was "
            "submitted); or the idempotency_key was used for another request, or made a batch "
            "no longer kept",
        ),
        oa.refuses(
            400,
            "malformed JSON, or the Idempotency-Key header and the body's idempotency_key "
            "differ, or " + durable.REFUSED_400,
        ),
        oa.refuses(429, "the tenant's rate limit or waiting-jobs cap", oa.RETRY_AFTER),
        oa.refuses(
            503, "back-pressure, Redis unavailable, or " + durable.UNCONFIRMED_503, oa.RETRY_AFTER
        ),
        body="BatchSpec",
        headers=[oa.IDEMPOTENCY_KEY, durable.PARAMETER],
    )
    one = "/v1/batches/{batch_id}"
    paths.add(
        f"GET {one}",
        get,
        "The batch's status: its counts (summed over the shards now) and state",
        oa.returns(200, "BatchStatus", "the batch"),
        unknown,
    )
    paths.add(
        f"POST {one}/cancel",
        cancel,
        "Cancel every child that has not started; running ones are asked to stop",
        oa.returns(200, "BatchChanged", "how many were cancelled and asked, and the batch"),
        unknown,
    )
    paths.add(
        f"POST {one}/retry",
        retry,
        "Send the batch's failed children back to their queue, attempts reset",
        oa.returns(200, "BatchChanged", "how many were retried, and the batch"),
        unknown,
    )
    return paths


def constrain(c: dict[str, Any], settings: Settings) -> None:
    """The rules ``BatchControl.prepare`` checks that JSON Schema can state."""
    oa.constrain(c, "BatchSpec", "type", pattern=TASK_NAME_RE.pattern)
    oa.constrain(c, "BatchSpec", "queue", pattern=QUEUE_NAME_RE.pattern)
    oa.constrain(c, "BatchSpec", "max_attempts", minimum=1, maximum=MAX_ATTEMPTS_LIMIT)
    oa.constrain(c, "BatchSpec", "chunk_size", minimum=1, maximum=MAX_BATCH_ITEMS)
    oa.constrain(c, "BatchSpec", "idempotency_key", pattern=IDEMPOTENCY_KEY_RE.pattern)
    c["BatchSpec"]["properties"]["items"].update(minItems=1, maxItems=MAX_BATCH_ITEMS)
    c["BatchSpec"]["properties"]["priority"]["enum"] = ["critical", "high", "normal", "low"]
    oa.constrain(c, "BatchCallback", "type", pattern=TASK_NAME_RE.pattern)
    oa.constrain(c, "BatchCallback", "queue", pattern=QUEUE_NAME_RE.pattern)
    oa.constrain(c, "BatchCallback", "max_attempts", minimum=1, maximum=MAX_ATTEMPTS_LIMIT)
