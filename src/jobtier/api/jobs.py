"""Job routes: submit (one, batch), status (with ETag and long-poll), result, cancel."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Sequence
from functools import partial
from typing import Any

import msgspec
import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from jobtier.api import spec as oa
from jobtier.api.auth import known_tenant, tenant_for, tenant_of
from jobtier.api.bounds import MAX_HEADER_BYTES, MAX_HEADERS, MAX_URL_BYTES
from jobtier.api.durable_submit import replicated
from jobtier.api.http import (
    JSON,
    decode_body,
    encoded,
    finished,
    invalid,
    job_id_of,
    job_not_found,
    job_transition,
    not_scheduled,
    read_json_body,
    registrar,
    repeat_doc,
    submit_body,
)
from jobtier.api.params import Param, parse_query
from jobtier.api.problems import Problem, on_error
from jobtier.api.sealed import opened
from jobtier.config import Settings
from jobtier.core.debounce import Throttled
from jobtier.core.errors import IdempotencyConflict, InvalidRequest, JobNotFound
from jobtier.core.model import JobSpec, Priority, Submitted
from jobtier.engine.control import JobControl
from jobtier.engine.queue import Queue
from jobtier.status.answer import DocResponse, StatusResponse, status_answer
from jobtier.status.fastpath import StatusFastPath, status_headers
from jobtier.status.reader import NOTHING, StatusReader, is_terminal
from jobtier.store.calls import SubmitItem

_spec_decoder = msgspec.json.Decoder(JobSpec)


class BatchBody(msgspec.Struct, forbid_unknown_fields=True):
    jobs: list[JobSpec]


_batch_decoder = msgspec.json.Decoder(BatchBody)


# --- submit ---------------------------------------------------------------------------------
async def submit(request: Request) -> Response:
    return await submit_one(request, tenant_of(request), await submit_body(request, _spec_decoder))


async def submit_one(request: Request, tenant: str, spec: JobSpec) -> Response:
    """Submit ``spec`` as the tenant's: the answer of ``POST /v1/jobs`` (202 and the job's
    status, or 200 and an idempotent repeat's)."""
    st = request.state
    queue: Queue = st.queue
    await queue.produce.ensure_known((spec.type,))
    try:
        item = queue.produce.prepare(spec, tenant)
    except InvalidRequest as exc:
        raise invalid(exc) from None
    st.admission.check(tenant, 1, (item.priority,))
    (outcome,) = await _submit(request, [item], [spec], False)
    if isinstance(outcome, IdempotencyConflict):
        raise Problem(409, "idempotency-conflict", str(outcome), job_id=outcome.job_id)
    doc = outcome.doc or await _kept_doc(request, outcome.job_id, tenant)
    location = f"/v1/jobs/{outcome.job_id}"
    return DocResponse(doc, status_code=202 if outcome.created else 200, location=location)


async def _submit(
    request: Request, items: Sequence[SubmitItem], specs: Sequence[JobSpec], batch: bool
) -> list[Submitted | IdempotencyConflict]:
    """Submit prepared jobs, their callbacks written first (``http.registrar``). A refused
    callback names its member: ``callback.url``, or ``jobs[i].callback.url`` in a batch."""
    queue: Queue = request.state.queue
    callbacks = [spec.callback for spec in specs]
    service = registrar(request, callbacks, "jobs[{}]." if batch else "")
    try:
        async with replicated(request):
            return await queue.produce.submit_prepared(
                items, batch=batch, callbacks=callbacks, registrar=service
            )
    except InvalidRequest as exc:  # depends_on names a job the tenant does not have
        raise invalid(exc) from None
    except Throttled as exc:  # its throttle key is full and it asked to be refused
        wait = str(max(1, math.ceil(exc.retry_after)))
        headers = {"retry-after": wait}
        raise Problem(429, "throttled", str(exc), field="throttle", headers=headers) from None


async def _kept_doc(request: Request, job_id: str, tenant: str) -> bytes:
    """The document of an idempotent duplicate whose job Redis no longer keeps."""
    gone = f"this idempotency key created job {job_id}, which is no longer kept"
    return await repeat_doc(request, job_id, tenant, gone)


async def submit_batch(request: Request) -> Response:
    tenant = tenant_of(request)
    st = request.state
    queue: Queue = st.queue
    body: BatchBody = decode_body(_batch_decoder, await read_json_body(request))
    if not body.jobs:
        raise Problem(422, "validation", "jobs is empty", field="jobs")
    if len(body.jobs) > queue.settings.max_batch:
        detail = f"at most {queue.settings.max_batch} jobs per batch (JOBTIER_MAX_BATCH)"
        raise Problem(413, "payload-too-large", detail, field="jobs")
    await queue.produce.ensure_known(spec.type for spec in body.jobs)
    items = []
    for index, spec in enumerate(body.jobs):
        try:
            items.append(queue.produce.prepare(spec, tenant))
        except InvalidRequest as exc:  # the same refusal, naming the job
            field = f"jobs[{index}].{exc.field or ''}".rstrip(".")
            raise invalid(type(exc)(f"jobs[{index}]: {exc}", field=field)) from None
    st.admission.check(tenant, len(items), [i.priority for i in items])
    outcomes = await _submit(request, items, body.jobs, True)
    results = []
    for outcome in outcomes:
        if isinstance(outcome, IdempotencyConflict):
            problem = Problem(409, "idempotency-conflict", str(outcome), job_id=outcome.job_id)
            results.append(b'{"status":409,"problem":' + orjson.dumps(problem.document()) + b"}")
        else:
            try:
                doc = outcome.doc or await _kept_doc(request, outcome.job_id, tenant)
            except Problem as gone:
                results.append(b'{"status":410,"problem":' + orjson.dumps(gone.document()) + b"}")
                continue
            code = b"202" if outcome.created else b"200"
            results.append(b'{"status":' + code + b',"job":' + doc + b"}")
    return Response(b'{"results":[' + b",".join(results) + b"]}", 200, media_type=JSON)


# --- status ---------------------------------------------------------------------------------
async def get_job(request: Request) -> Response:
    """The status read through the router: the fast path's answer (status/answer.py), and
    the long-poll. Reads the scope directly (one pass over the headers, the lifespan state
    as a dict): the bookkeeping of a Request is much of a read's cost."""
    scope = request.scope
    state = scope["state"]
    authorization, held, _ = status_headers(scope["headers"])
    tenant = tenant_for(state["tenants"], authorization, state["admin_key"], state["worker_keys"])
    job_id: str = scope["path_params"]["job_id"]
    # parameters are checked before the read: ?wait=-1 is refused whatever the job's state
    wait: float = (
        parse_query(request, STATUS_PARAMS).get("wait", 0.0) if scope["query_string"] else 0.0
    )
    reader: StatusReader = state["reader"]
    owner, doc, version = await reader.get(job_id) or NOTHING
    start = status_answer(tenant, held, owner, doc, version)
    if start is None:
        raise job_not_found(job_id)
    if wait > 0 and start["status"] == 304 and not is_terminal(doc):
        found = await reader.wait_past(job_id, tenant, version, wait)
        if found is None:
            raise job_not_found(job_id)
        if found[2] > version:
            return DocResponse(found[1], found[2])
    return StatusResponse(start, doc)


def status_fast_path(tenants: dict[str, str]) -> StatusFastPath:
    """The fast path for the API keys ``tenants``, within the app's limits (``RequestLimits``
    answers past them), its errors answered as the app answers them."""
    return StatusFastPath(
        partial(known_tenant, tenants),
        answer_error,
        max_url_bytes=MAX_URL_BYTES,
        max_headers=MAX_HEADERS,
        max_header_bytes=MAX_HEADER_BYTES,
    )


async def answer_error(scope: Scope, receive: Receive, send: Send, exc: Exception) -> None:
    """The fast path's errors as the app's handlers answer them: the 404 problem of a status
    read, a raised problem, else a 503 while Redis or Postgres is down, or a 500."""
    if isinstance(exc, JobNotFound):
        response = job_not_found(exc.job_id).response()
    elif isinstance(exc, Problem):
        response = exc.response()
    else:
        response = await on_error(Request(scope, receive), exc)
    await response(scope, receive, send)


STATUS_PARAMS = [
    Param(
        "wait", "number",
        "long-poll: with If-None-Match, wait up to this many seconds for a newer version",
        minimum=0, maximum="long_poll_max_seconds",
    )
]  # fmt: skip


async def get_result(request: Request) -> Response:
    tenant = tenant_of(request)
    job_id = job_id_of(request)
    queue: Queue = request.state.queue
    try:
        status, raw = await queue.jobs.result_raw(job_id, tenant)
    except JobNotFound:
        fallback = request.state.result_fallback
        found = await fallback(job_id, tenant) if fallback else None
        if found is None:
            raise job_not_found(job_id) from None
        return Response(orjson.dumps(found), media_type=JSON)
    body: dict[str, Any] = {
        "id": status.id,
        "state": status.state,
        "version": status.version,
        "error": status.error,
    }
    if status.result_url is not None:  # kept outside Redis: streamed from there
        body.update(result=None, result_url=status.result_url)
        return encoded(body)
    if raw:  # the tenant's own: an encrypted result opened
        raw = opened(queue.store.keyring, job_id, "result", raw)
    # the stored JSON as it is, not decoded and encoded again
    return Response(
        msgspec.json.encode(body)[:-1] + b',"result":' + (raw or b"null") + b"}", media_type=JSON
    )


async def cancel(request: Request) -> Response:
    return await job_transition(request, JobControl.cancel_doc, finished, cancel=True)


async def promote(request: Request) -> Response:
    return await job_transition(request, JobControl.promote_doc, not_scheduled)


class PriorityBody(msgspec.Struct, forbid_unknown_fields=True):
    """The body of ``POST /v1/jobs/{id}/priority``."""

    priority: Priority


_priority_decoder = msgspec.json.Decoder(PriorityBody)


async def set_priority(request: Request) -> Response:
    body: PriorityBody = decode_body(_priority_decoder, await read_json_body(request))

    def change(jobs: JobControl, job_id: str, tenant: str | None) -> Awaitable[bytes]:
        return jobs.set_priority_doc(job_id, body.priority, tenant)

    def refused(job_id: str, state: str) -> str:
        return f"job {job_id} is {state}: only a job not started yet changes its priority"

    return await job_transition(request, change, refused)


def operations(settings: Settings) -> oa.Paths:
    """The routes that change a job not started yet, of the OpenAPI document."""
    paths = oa.Paths(settings)
    paths.add(
        "POST /v1/jobs/{job_id}/promote",
        promote,
        "Run a scheduled job now: a delayed one before its run-at, or one waiting out a "
        "retry's back-off (its run_at becomes now; its attempts are as they were)",
        oa.returns(200, "JobStatus", "queued"),
        oa.JOB_404,
        oa.refuses(
            409,
            "the job is not scheduled (wrong-state; job: its status), or is still in the "
            "outbox (not-relayed-yet)",
        ),
    )
    paths.add(
        "POST /v1/jobs/{job_id}/priority",
        set_priority,
        "Change the priority of a job not started yet (queued, scheduled, waiting): a ready "
        "one goes to the back of its new priority's jobs",
        oa.returns(200, "JobStatus", "its status, at the new priority"),
        oa.JOB_404,
        oa.refuses(
            409,
            "the job is running or has ended (wrong-state; job: its status), or is still in "
            "the outbox (not-relayed-yet)",
        ),
        body="PriorityBody",
    )
    return paths


def constrain_expiry(c: dict[str, Any], settings: Settings) -> None:
    """What the OpenAPI document states of a job's expiry (docs/expiry.md) and of its own
    timeout."""
    ahead = settings.max_future_seconds
    oa.constrain(c, "JobSpec", "expires_in", exclusiveMinimum=0, maximum=ahead)
    oa.constrain(c, "JobSpec", "expires_at", format="date-time")
    rule = (
        "; after the job's run_at or delay, within JOBTIER_MAX_FUTURE_SECONDS "
        f"({ahead} s); not with the other, nor with debounce, throttle or unique (else 422 "
        "naming it)"
    )
    c["JobSpec"]["properties"]["expires_at"]["description"] = (
        "a time (with a zone) after which the job, not started, is cancelled (error Expired) "
        "when a worker's claim reaches it" + rule
    )
    c["JobSpec"]["properties"]["expires_in"]["description"] = (
        "seconds from the submit after which the job, not started, is cancelled (error "
        "Expired) when a worker's claim reaches it" + rule
    )
    # (and its own timeout: docs/tasks.md)
    oa.constrain(c, "JobSpec", "timeout", exclusiveMinimum=0, maximum=ahead)
    c["JobSpec"]["properties"]["timeout"]["description"] = (
        "seconds each attempt of this job may run, in place of its task's timeout (an HTTP "
        "worker is handed it with the job); within JOBTIER_MAX_FUTURE_SECONDS, not with "
        "debounce, throttle or unique (else 422 naming it)"
    )
