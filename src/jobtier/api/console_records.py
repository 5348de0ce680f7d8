"""The console's routes that read Postgres (admin key): every tenant's jobs by filter, one
job in full (status, history with each attempt's error, payload, result or the link to a
stored one, its log lines, its admin actions, the jobs it waits for: console_flows.py),
and the audit of admin actions. ``PostgresExtension`` adds them to the app.

A job Redis still holds is shown as Redis has it (its document, payload and result are the
live ones); its history comes from Postgres, as far as the write-behind has got (``lag``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from jobtier.api import spec as oa
from jobtier.api.audit import actor_of, flush_pending
from jobtier.api.auth import require_admin
from jobtier.api.console_flows import DEPENDENCIES_SHOWN, DependencyView, flow_view
from jobtier.api.http import JSON, doc_state, job_id_of, job_not_found
from jobtier.api.params import Param, parse_query
from jobtier.api.problems import PG_DOWN, Problem, pg_unavailable
from jobtier.config import Settings
from jobtier.core.errors import InvalidRequest
from jobtier.core.model import Dependencies, JobStatus, LogLine, State, is_ref, ref_of
from jobtier.core.names import QUEUE_NAME_RE, TASK_NAME_RE, TENANT_RE, ULID_RE
from jobtier.engine.queue import Queue
from jobtier.persist.audit_store import MAX_AUDIT_LIMIT, AuditRecord, AuditStore
from jobtier.persist.pg_reader import ID_PREFIX_RE, MAX_LIMIT, AdminTransition, PgReader
from jobtier.persist.results import reader_for
from jobtier.status.docs import read_doc

# payloads and results up to this size come with the job; larger ones by their own route
PREVIEW_BYTES = 64 * 1024
JOB_AUDIT_SHOWN = 20

LIST_PARAMS = [
    Param("state", "string", "only jobs in this state", values=[s.value for s in State]),
    Param("type", "string", "only jobs of this type", max_length=128, pattern=TASK_NAME_RE.pattern),
    Param("queue", "string", "only jobs of this queue", max_length=64, pattern=QUEUE_NAME_RE.pattern),
    Param("tenant", "string", "only this tenant's jobs", max_length=64, pattern=TENANT_RE.pattern),
    Param("created_after", "date-time", "only jobs created after this time (ISO 8601)", max_length=40),
    Param("created_before", "date-time", "only jobs created before this time (ISO 8601)", max_length=40),
    Param("id_prefix", "string", "only jobs whose id starts so (case-insensitive)", max_length=31, pattern=ID_PREFIX_RE.pattern),
    Param("cursor", "string", "the next_cursor of the previous page", max_length=200, pattern=r"^[A-Za-z0-9_-]+$"),
    Param("limit", "integer", "most jobs per page (default 50)", minimum=1, maximum=MAX_LIMIT),
    Param("order", "string", "desc (newest first, the default) or asc", values=["desc", "asc"]),
]  # fmt: skip
AUDIT_PARAMS = [
    # the pattern states what the parser refuses (control characters), for the document
    Param("target", "string", "only actions on this job id, queue name or filter", max_length=200, pattern=r"^[^\x00-\x1f\x7f]+$"),
    Param("action", "string", "only this action (job.cancel, job.replay, dead_letters.replay, queue.pause, queue.resume, queue.limits, queue.purge)", max_length=40, pattern=r"^[a-z_]+\.[a-z_]+$"),
    Param("cursor", "string", "the next_cursor of the previous page", max_length=26, pattern=ULID_RE.pattern),
    Param("limit", "integer", "most records per page (default 50)", minimum=1, maximum=MAX_AUDIT_LIMIT),
]  # fmt: skip


# --- bodies (the schemas; the routes embed status documents as Redis stored them) ------------
class AdminJob(msgspec.Struct):
    tenant: str
    job: JobStatus


class AdminJobPage(msgspec.Struct):
    jobs: list[AdminJob]
    next_cursor: str | None
    lag: dict[str, float]


class Preview(msgspec.Struct):
    """A payload or result: its size in bytes (null: none yet) and, when at most
    ``PREVIEW_BYTES``, the value itself; a larger one is ``truncated``: its route has it."""

    size: int | None
    value: Any = None
    truncated: bool = False


class ResultPreview(Preview):
    """A result as a ``Preview``; one kept in the result store (``JOBTIER_RESULT_STORE``) is
    never inlined: ``ref`` names it, ``size`` is what the store holds (null: no longer kept),
    and the job's ``/v1/admin/jobs/{id}/result`` streams it."""

    ref: str | None = None


class AdminJobDetail(msgspec.Struct):
    tenant: str
    job: JobStatus
    source: str  # "redis": the live job; "postgres": Redis no longer holds it
    payload: Preview
    result: ResultPreview
    history: list[AdminTransition]
    audit: list[AuditRecord]  # this job's admin actions, newest first
    lag: dict[str, float]
    # what its task logged with ctx.log(), oldest first (GET /v1/jobs/{id}/logs for the
    # tenant): in Redis only, so none once Redis no longer holds the job
    lines: list[LogLine]
    # the jobs it waits for (a flow's), in its order, at most console_flows.DEPENDENCIES_SHOWN
    dependencies: list[DependencyView]
    # for a parent: its children (those made in its flow), how many are done, how many failed
    children: Dependencies | None


class AuditPage(msgspec.Struct):
    records: list[AuditRecord]
    next_cursor: str | None
    you: str  # the fingerprint of the key that asked


class _RawAdminJob(msgspec.Struct):
    tenant: str
    job: msgspec.Raw


class _RawAdminJobPage(msgspec.Struct):
    jobs: list[_RawAdminJob]
    next_cursor: str | None
    lag: dict[str, float]


class _RawAdminJobDetail(msgspec.Struct):
    tenant: str
    job: msgspec.Raw
    source: str
    payload: Preview
    result: ResultPreview
    history: list[AdminTransition]
    audit: list[AuditRecord]
    lag: dict[str, float]
    lines: list[msgspec.Raw]
    dependencies: list[DependencyView]
    children: Dependencies | None


P = TypeVar("P", bound=Preview)


def _preview(size: int | None, value: bytes | None, kind: type[P]) -> P:
    if size is None:
        return kind(None)
    if size > PREVIEW_BYTES or value is None:
        return kind(size, None, truncated=size > PREVIEW_BYTES)
    return kind(size, msgspec.Raw(value or b"null"))


async def _lag(request: Request) -> dict[str, float]:
    entries, seconds = await request.state.pg_extension.current_lag()
    return {"transitions": entries, "seconds": round(seconds, 3)}


# --- routes ------------------------------------------------------------------------------------
async def list_jobs(request: Request) -> Response:
    """Every tenant's jobs from Postgres, newest first, by filter; keyset-paginated, with the
    write-behind lag (a job changed within it may show an older state here)."""
    require_admin(request)
    q = parse_query(request, LIST_PARAMS)
    reader: PgReader = request.state.pg_reader
    try:
        rows, cursor = await reader.admin_list_jobs(
            tenant=q.get("tenant"), state=q.get("state"), type=q.get("type"),
            queue=q.get("queue"), created_after=q.get("created_after"),
            created_before=q.get("created_before"), id_prefix=q.get("id_prefix"),
            cursor=q.get("cursor"), limit=q.get("limit", 50), order=q.get("order", "desc"),
        )  # fmt: skip
        lag_doc = await _lag(request)
    except InvalidRequest as exc:
        raise Problem(400, "bad-request", str(exc), field=exc.field) from None
    except PG_DOWN:
        raise pg_unavailable() from None
    page = _RawAdminJobPage([_RawAdminJob(t, msgspec.Raw(d)) for t, d in rows], cursor, lag_doc)
    return Response(msgspec.json.encode(page), media_type=JSON)


async def job_detail(request: Request) -> Response:
    """One job, whatever its tenant: status, history, payload, result, admin actions, and
    the jobs it waits for (console_flows.py)."""
    require_admin(request)
    job_id = job_id_of(request)
    queue: Queue = request.state.queue
    reader: PgReader = request.state.pg_reader
    store: AuditStore = request.state.audit_store
    live = await _from_redis(queue, job_id)
    lines = await queue.jobs.log_lines(job_id)
    try:
        stored = None if live else await reader.admin_job(job_id, PREVIEW_BYTES)
        if live is None and stored is None:
            raise job_not_found(job_id)
        history = await reader.admin_history(job_id)
        actions, _ = await store.list(target=job_id, limit=JOB_AUDIT_SHOWN)
        lag_doc = await _lag(request)
        if live is not None:
            tenant, doc, payload, result = live
            source = "redis"
        else:
            assert stored is not None
            tenant, doc, source = stored.tenant, stored.doc, "postgres"
            payload = _preview(stored.payload_size, stored.payload, Preview)
            result = _preview(stored.result_size, stored.result, ResultPreview)
            if stored.result_ref is not None:
                result = ResultPreview(None, ref=stored.result_ref)
        if result.ref is not None:
            result.size = await _stored_size(request, result.ref)
        flow = await flow_view(
            queue, request.state.reader, reader, job_id, tenant, live is not None
        )
    except PG_DOWN:
        raise pg_unavailable() from None
    body = _RawAdminJobDetail(
        tenant, msgspec.Raw(doc), source, payload, result, history, actions, lag_doc,
        [msgspec.Raw(line) for line in lines], flow.dependencies, flow.children,
    )  # fmt: skip
    return Response(msgspec.json.encode(body), media_type=JSON)


async def _from_redis(
    queue: Queue, job_id: str
) -> tuple[str, bytes, Preview, ResultPreview] | None:
    """(tenant, document, payload, result) of a job Redis holds; None if it holds none."""
    key = queue.keys.job(job_id)
    pipe = queue.redis.pipeline(transaction=False)
    pipe.hstrlen(key, "payload")
    pipe.hstrlen(key, "result")
    # both reads at once: one round trip's wait, as when the document was an HMGET
    (payload_size, result_size), (tenant, doc) = await asyncio.gather(
        pipe.execute(), read_doc(queue.redis, queue.keys, job_id)
    )
    if doc is None:
        return None
    small = [
        f for f, n in (("payload", payload_size), ("result", result_size)) if n <= PREVIEW_BYTES
    ]
    pipe = queue.redis.pipeline(transaction=False)
    for field in small:
        pipe.hget(key, field)
    values: dict[str, bytes | None] = dict(zip(small, await pipe.execute(), strict=True))
    result = ResultPreview(None)
    if doc_state(doc) == State.SUCCEEDED:
        if is_ref(values.get("result")):  # kept in the result store: named, never inlined
            result = ResultPreview(None, ref=ref_of(values["result"] or b""))
        elif result_size > PREVIEW_BYTES:
            result = ResultPreview(result_size, None, truncated=True)
        else:  # an empty field: the task returned nothing (null)
            raw = values.get("result") or b"null"
            result = ResultPreview(len(raw), msgspec.Raw(raw))
    return tenant.decode(), doc, _preview(payload_size, values.get("payload"), Preview), result


async def _stored_size(request: Request, ref: str) -> int | None:
    """The size of a result the result store keeps; None if it no longer does."""
    store = await reader_for(ref, request.state.pg_extension.pool)
    return await store.size(ref)


async def job_value(request: Request) -> Response:
    """The whole payload or result of one job, as JSON (``null``: no result); a result kept
    in the result store is streamed from there, byte for byte."""
    require_admin(request)
    job_id = job_id_of(request)
    part = "payload" if request.url.path.endswith("/payload") else "result"
    queue: Queue = request.state.queue
    _, doc, value = await read_doc(queue.redis, queue.keys, job_id, part)
    if doc is None:
        try:
            known, value = await request.state.pg_reader.admin_value(job_id, part)
        except PG_DOWN:
            raise pg_unavailable() from None
        if not known:
            raise job_not_found(job_id)
    if part == "result" and isinstance(value, bytes) and is_ref(value):
        ref = ref_of(value)
        try:
            store = await reader_for(ref, request.state.pg_extension.pool)
            size = await store.size(ref)
        except PG_DOWN:
            raise pg_unavailable() from None
        if size is None:
            raise Problem(
                410, "gone", f"the result of job {job_id} is no longer kept", job_id=job_id
            )
        chunks: AsyncIterator[bytes] = store.stream(ref)
        return StreamingResponse(chunks, media_type=JSON, headers={"content-length": str(size)})
    return Response(value or b"null", media_type=JSON)


async def audit_log(request: Request) -> Response:
    """Admin actions, newest first, by target (a job id, a queue) or action."""
    require_admin(request)
    q = parse_query(request, AUDIT_PARAMS)
    store: AuditStore = request.state.audit_store
    try:
        await flush_pending(request)  # records deferred while Postgres was down, now in
        records, cursor = await store.list(
            target=q.get("target"), action=q.get("action"), before=q.get("cursor"),
            limit=q.get("limit", 50),
        )  # fmt: skip
    except InvalidRequest as exc:
        raise Problem(400, "bad-request", str(exc), field=exc.field) from None
    except PG_DOWN:
        raise pg_unavailable() from None
    page = AuditPage(records, cursor, actor_of(request))
    return Response(msgspec.json.encode(page), media_type=JSON)


# --- the OpenAPI document ------------------------------------------------------------------------
OPENAPI_TYPES: list[type] = [AdminJobPage, AdminJobDetail, AuditPage]


def openapi_paths(settings: Settings) -> dict[str, Any]:
    s, op = settings, oa.operation
    any_json = {
        "description": "the value as JSON (null: none)",
        "content": {"application/json": {"schema": {}}},
    }
    return {
        "/v1/admin/jobs": {
            "get": op(s, "Every tenant's jobs from Postgres, newest first, by state, type, queue, tenant, time range or id prefix; says how far behind the write-behind is", {
                "200": oa.json_response("AdminJobPage", "a page; next_cursor is null on the last"),
            }, auth="admin", params=LIST_PARAMS),
        },
        "/v1/admin/jobs/{job_id}": {
            "get": op(s, f"One job of any tenant: its status (live from Redis while held there), every persisted change with each attempt's error as recorded, payload and result (up to {PREVIEW_BYTES} bytes each: larger ones by their routes), its admin actions, and the jobs it waits for (up to {DEPENDENCIES_SHOWN}: each one's outcome, or its state now while pending) with, for a parent, its children done and failed", {
                "200": oa.json_response("AdminJobDetail", "the job"),
                "404": oa.problem("unknown job (or a malformed id)"),
            }, auth="admin", path=[oa.JOB_ID]),
        },
        "/v1/admin/jobs/{job_id}/payload": {
            "get": op(s, "The job's whole payload", {
                "200": any_json,
                "404": oa.problem("unknown job (or a malformed id)"),
            }, auth="admin", path=[oa.JOB_ID]),
        },
        "/v1/admin/jobs/{job_id}/result": {
            "get": op(s, "The job's whole result (null until it succeeds; streamed from the result store for one kept there)", {
                "200": any_json,
                "404": oa.problem("unknown job (or a malformed id)"),
                "410": oa.problem("the result is no longer kept (job_id)"),
            }, auth="admin", path=[oa.JOB_ID]),
        },
        "/v1/admin/audit": {
            "get": op(s, "Admin actions, newest first: who (a fingerprint of the admin key), when, what, on what, the status answered and what it did", {
                "200": oa.json_response("AuditPage", "a page; next_cursor is null on the last"),
            }, auth="admin", params=AUDIT_PARAMS),
        },
    }  # fmt: skip


routes = [
    Route("/v1/admin/jobs", list_jobs, methods=["GET"]),
    Route("/v1/admin/jobs/{job_id}", job_detail, methods=["GET"]),
    Route("/v1/admin/jobs/{job_id}/payload", job_value, methods=["GET"]),
    Route("/v1/admin/jobs/{job_id}/result", job_value, methods=["GET"]),
    Route("/v1/admin/audit", audit_log, methods=["GET"]),
]
