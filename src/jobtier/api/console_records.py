"""The console's routes that read Postgres (admin key): every tenant's jobs by filter, one
job in full (status, history with each attempt's error, payload, result, log lines, admin
actions, the jobs it waits for), and the audit of admin actions.

A job Redis still holds is shown as Redis has it (its document, payload and result are the
live ones); its history comes from Postgres, as far as the write-behind has got (``lag``).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from jobtier.api import spec as oa
from jobtier.api.audit import actor_of, flush_pending
from jobtier.api.auth import require_admin
from jobtier.api.console_flows import DEPENDENCIES_SHOWN, DependencyView, flow_view
from jobtier.api.http import JSON, doc_state, encoded, job_id_of, job_not_found
from jobtier.api.params import (
    CREATED_AFTER,
    JOB_FILTERS,
    bad,
    date_time,
    job_page,
    limit_param,
    matching,
    parse_query,
)
from jobtier.api.problems import postgres_or_503
from jobtier.api.result_content import stored_result
from jobtier.config import Settings
from jobtier.core.errors import InvalidRequest
from jobtier.core.model import Dependencies, JobStatus, LogLine, State, is_ref, ref_of
from jobtier.core.names import AUDIT_ACTIONS, TENANT_RE, ULID_RE
from jobtier.core.sealing import masked
from jobtier.engine.queue import Queue
from jobtier.persist.audit_store import MAX_AUDIT_LIMIT, AuditRecord, AuditStore
from jobtier.persist.pg_reader import ID_PREFIX_RE, MAX_LIMIT, AdminTransition, PgReader
from jobtier.persist.results import reader_for
from jobtier.status.docs import read_doc

# payloads and results up to this size come with the job; larger ones by their own route
PREVIEW_BYTES = 64 * 1024
JOB_AUDIT_SHOWN = 20
_PRINTABLE = re.compile(r"^[^\x00-\x1f\x7f]+$")

LIST_PARAMS = [
    *JOB_FILTERS,
    matching("tenant", "only this tenant's jobs", TENANT_RE, 64),
    CREATED_AFTER,
    date_time("created_before", "only jobs created before this time (ISO 8601)"),
    matching("id_prefix", "only jobs whose id starts so (case-insensitive)", ID_PREFIX_RE, 31),
    *job_page(MAX_LIMIT),
]
_ACTIONS = f"only this action ({', '.join(AUDIT_ACTIONS)})"
_ACTION_RE = re.compile("^(?:" + "|".join(re.escape(a) for a in AUDIT_ACTIONS) + ")$")
AUDIT_PARAMS = [
    # the pattern states what the parser refuses (control characters), for the document
    matching("target", "only actions on this job id, queue name or filter", _PRINTABLE, 200),
    matching("action", _ACTIONS, _ACTION_RE, 40),
    matching("cursor", "the next_cursor of the previous page", ULID_RE, 26),
    limit_param("most records per page (default 50)", MAX_AUDIT_LIMIT),
]
ANY_JSON = oa.content("the value as JSON (null: none)", "application/json", {})


# the bodies' schemas; the routes send status documents as Redis stored them, in these shapes
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


P = TypeVar("P", bound=Preview)


def _preview(size: int | None, value: bytes | None, kind: type[P]) -> P:
    if size is None:
        return kind(None)
    if size > PREVIEW_BYTES or value is None:
        return kind(size, None, truncated=size > PREVIEW_BYTES)
    # an encrypted value as "[encrypted]": the console never opens one (docs/encryption.md)
    return kind(size, msgspec.Raw(masked(value) or b"null"))


async def list_jobs(request: Request) -> Response:
    """Every tenant's jobs from Postgres, newest first, by filter; keyset-paginated, with the
    write-behind lag (a job changed within it may show an older state here)."""
    require_admin(request)
    query = parse_query(request, LIST_PARAMS)  # named as admin_list_jobs's arguments
    reader: PgReader = request.state.pg_reader
    try:
        with postgres_or_503():
            rows, cursor = await reader.admin_list_jobs(**query)
            lag = await request.state.pg_extension.lag_document()
    except InvalidRequest as exc:
        raise bad(exc.field, str(exc)) from None
    jobs = [{"tenant": tenant, "job": msgspec.Raw(doc)} for tenant, doc in rows]
    page = {"jobs": jobs, "next_cursor": cursor, "lag": lag}
    return encoded(page)


async def job_detail(request: Request) -> Response:
    """One job, whatever its tenant: status, history, payload, result, admin actions, and
    the jobs it waits for (console_flows.py)."""
    require_admin(request)
    job_id = job_id_of(request)
    queue: Queue = request.state.queue
    reader: PgReader = request.state.pg_reader
    live = await _from_redis(queue, job_id)
    lines = [msgspec.Raw(line) for line in await queue.jobs.log_lines(job_id)]
    with postgres_or_503():
        if live is not None:
            tenant, doc, payload, result = live
            source = "redis"
        else:
            stored = await reader.admin_job(job_id, PREVIEW_BYTES)
            if stored is None:
                raise job_not_found(job_id)
            tenant, doc, source = stored.tenant, stored.doc, "postgres"
            payload = _preview(stored.payload_size, stored.payload, Preview)
            result = _preview(stored.result_size, stored.result, ResultPreview)
            if stored.result_ref is not None:
                result = ResultPreview(None, ref=stored.result_ref)
        history = await reader.admin_history(job_id)
        actions, _ = await request.state.audit_store.list(target=job_id, limit=JOB_AUDIT_SHOWN)
        lag = await request.state.pg_extension.lag_document()
        if result.ref is not None:
            store = await reader_for(result.ref, request.state.pg_extension.pool)
            result.size = await store.size(result.ref)
        flow = await flow_view(queue, request.state.reader, reader, job_id, tenant, bool(live))
    # AdminJobDetail's members, with the status document and log lines as stored
    values: tuple[Any, ...] = (tenant, msgspec.Raw(doc), source, payload, result, history)
    values += (actions, lag, lines, flow.dependencies, flow.children)
    body = dict(zip(AdminJobDetail.__struct_fields__, values, strict=True))
    return encoded(body)


async def _from_redis(
    queue: Queue, job_id: str
) -> tuple[str, bytes, Preview, ResultPreview] | None:
    """(tenant, document, payload, result) of a job Redis holds; None if it holds none."""
    key = queue.keys.job(job_id)
    pipe = queue.redis.pipeline(transaction=False)
    pipe.hstrlen(key, "payload")
    pipe.hstrlen(key, "result")
    # both reads at once: one round trip's wait
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
            result = ResultPreview(len(raw), msgspec.Raw(masked(raw) or raw))
    return tenant.decode(), doc, _preview(payload_size, values.get("payload"), Preview), result


async def job_value(request: Request) -> Response:
    """The whole payload or result of one job, as JSON (``null``: no result); a result kept
    in the result store is streamed from there, byte for byte; an encrypted one is
    ``"[encrypted]"``."""
    require_admin(request)
    job_id = job_id_of(request)
    part = "payload" if request.url.path.endswith("/payload") else "result"
    queue: Queue = request.state.queue
    _, doc, value = await read_doc(queue.redis, queue.keys, job_id, part)
    if doc is None:
        with postgres_or_503():
            known, value = await request.state.pg_reader.admin_value(job_id, part)
        if not known:
            raise job_not_found(job_id)
    if part == "result" and isinstance(value, bytes) and is_ref(value):
        with postgres_or_503():
            return await stored_result(request, job_id, ref_of(value))
    return Response(masked(value) or b"null", media_type=JSON)


async def audit_log(request: Request) -> Response:
    """Admin actions and tenants' schedule changes, newest first, by target (a job id, a
    queue, a schedule id) or action."""
    require_admin(request)
    query = parse_query(request, AUDIT_PARAMS)
    if "cursor" in query:
        query["before"] = query.pop("cursor")
    store: AuditStore = request.state.audit_store
    try:
        with postgres_or_503():
            await flush_pending(request)  # records deferred while Postgres was down, now in
            records, cursor = await store.list(**query)
    except InvalidRequest as exc:
        raise bad(exc.field, str(exc)) from None
    page = AuditPage(records, cursor, actor_of(request))
    return encoded(page)


OPENAPI_TYPES: list[type] = [AdminJobPage, AdminJobDetail, AuditPage]


def operations(settings: Settings) -> oa.Paths:
    paths = oa.Paths(settings, auth="admin")
    unknown = oa.unknown("job", tenants=False)
    paths.add(
        "GET /v1/admin/jobs",
        list_jobs,
        "Every tenant's jobs from Postgres, newest first, by state, type, queue, tenant, time "
        "range or id prefix; says how far behind the write-behind is",
        oa.page("AdminJobPage"),
        params=LIST_PARAMS,
    )
    paths.add(
        "GET /v1/admin/jobs/{job_id}",
        job_detail,
        "One job of any tenant: its status (live from Redis while held there), every persisted "
        "change with each attempt's error as recorded, payload and result (up to "
        f"{PREVIEW_BYTES} bytes each: larger ones by their routes), its admin actions, and the "
        f"jobs it waits for (up to {DEPENDENCIES_SHOWN}: each one's outcome, or its state now "
        "while pending) with, for a parent, its children done and failed",
        oa.returns(200, "AdminJobDetail", "the job"),
        unknown,
    )
    paths.add(
        "GET /v1/admin/jobs/{job_id}/payload",
        job_value,
        "The job's whole payload",
        (200, ANY_JSON),
        unknown,
    )
    paths.add(
        "GET /v1/admin/jobs/{job_id}/result",
        job_value,
        "The job's whole result (null until it succeeds; streamed from the result store for one "
        "kept there)",
        (200, ANY_JSON),
        unknown,
        oa.refuses(410, "the result is no longer kept (job_id)"),
    )
    paths.add(
        "GET /v1/admin/audit",
        audit_log,
        "Admin actions and tenants' changes to their schedules, newest first: who (a "
        "fingerprint of the key: admin:…, tenant:<tenant>:…), when, what, on what, the status "
        "answered and what it did",
        oa.page("AuditPage"),
        params=AUDIT_PARAMS,
    )
    return paths
