"""Job routes: submit (one, batch), status (with ETag and long-poll), result, cancel."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from jobtier.api.auth import known_tenant, tenant_for, tenant_of
from jobtier.api.bounds import MAX_HEADER_BYTES, MAX_HEADERS, MAX_URL_BYTES
from jobtier.api.http import (
    JSON,
    TERMINAL_STATES,
    DocResponse,
    decode_body,
    doc_headers,
    doc_state,
    etag_matches,
    idempotency_key,
    invalid,
    job_id_of,
    job_not_found,
    job_transition,
    not_modified,
    read_json_body,
)
from jobtier.api.params import Param, parse_query
from jobtier.api.problems import Problem, on_error
from jobtier.core.errors import IdempotencyConflict, InvalidRequest, JobNotFound
from jobtier.core.model import JobSpec, Submitted
from jobtier.engine.control import JobControl
from jobtier.engine.queue import Queue
from jobtier.status.reader import RESYNC, Status, StatusReader, parse_version
from jobtier.store.calls import SubmitItem

_spec_decoder = msgspec.json.Decoder(JobSpec)


class BatchBody(msgspec.Struct, forbid_unknown_fields=True):
    jobs: list[JobSpec]


_batch_decoder = msgspec.json.Decoder(BatchBody)


# --- submit ---------------------------------------------------------------------------------
async def submit(request: Request) -> Response:
    tenant = tenant_of(request)
    st = request.state
    spec: JobSpec = decode_body(_spec_decoder, await read_json_body(request))
    spec.idempotency_key = idempotency_key(request, spec.idempotency_key)
    queue: Queue = st.queue
    await queue.produce.ensure_known((spec.type,))
    try:
        item = queue.produce.prepare(spec, tenant)
    except InvalidRequest as exc:
        raise invalid(exc) from None
    st.admission.check(tenant)
    (outcome,) = await _submit(request, [item], [spec], False)
    return await _submitted(request, outcome, tenant)


async def _submit(
    request: Request, items: Sequence[SubmitItem], specs: Sequence[JobSpec], batch: bool
) -> list[Submitted | IdempotencyConflict]:
    """Submit prepared jobs, their callbacks written first by the API's webhook service
    (``Producer.submit_prepared``, as the in-process ``Queue.submit`` does). A refused callback names its member: ``callback.url``, or ``jobs[i].callback.url``
    in a batch."""
    queue: Queue = request.state.queue
    callbacks = [spec.callback for spec in specs]
    try:
        if all(cb is None for cb in callbacks):
            return await queue.produce.submit_prepared(items, batch=batch)
        service = getattr(request.state, "webhooks", None)
        if service is None:
            first = next(i for i, cb in enumerate(callbacks) if cb is not None)
            raise Problem(
                422, "validation", "callbacks need the API's Postgres part, which this API "
                "runs without", field=(f"jobs[{first}]." if batch else "") + "callback.url",
            )  # fmt: skip
        return await queue.produce.submit_prepared(
            items, batch=batch, callbacks=callbacks, registrar=service
        )
    except InvalidRequest as exc:  # depends_on names a job the tenant does not have
        raise invalid(exc) from None


async def _submitted(
    request: Request, outcome: Submitted | IdempotencyConflict, tenant: str
) -> Response:
    if isinstance(outcome, IdempotencyConflict):
        raise Problem(409, "idempotency-conflict", str(outcome), job_id=outcome.job_id)
    doc = outcome.doc or await _stored_doc(request, outcome.job_id, tenant)
    return DocResponse(
        doc,
        parse_version(doc),
        202 if outcome.created else 200,
        location=f"/v1/jobs/{outcome.job_id}",
    )


async def _stored_doc(request: Request, job_id: str, tenant: str) -> bytes:
    """The document of an idempotent duplicate whose job Redis no longer holds."""
    found = await request.state.reader.get(job_id)
    if found is None or found[0] != tenant:
        raise Problem(
            410, "gone",
            f"this idempotency key created job {job_id}, which is no longer kept",
            job_id=job_id,
        )  # fmt: skip
    return bytes(found[1])


async def submit_batch(request: Request) -> Response:
    tenant = tenant_of(request)
    st = request.state
    queue: Queue = st.queue
    body: BatchBody = decode_body(_batch_decoder, await read_json_body(request))
    if not body.jobs:
        raise Problem(422, "validation", "jobs is empty", field="jobs")
    if len(body.jobs) > queue.settings.max_batch:
        raise Problem(
            413,
            "payload-too-large",
            f"at most {queue.settings.max_batch} jobs per batch (JOBTIER_MAX_BATCH)",
            field="jobs",
        )
    await queue.produce.ensure_known(spec.type for spec in body.jobs)
    items = []
    for index, spec in enumerate(body.jobs):
        try:
            items.append(queue.produce.prepare(spec, tenant))
        except InvalidRequest as exc:
            problem = invalid(exc)
            raise Problem(
                problem.status,
                problem.slug,
                f"jobs[{index}]: {exc}",
                field=f"jobs[{index}].{exc.field or ''}".rstrip("."),
            ) from None
    st.admission.check(tenant, len(items))
    outcomes = await _submit(request, items, body.jobs, True)
    results = []
    for outcome in outcomes:
        if isinstance(outcome, IdempotencyConflict):
            problem = Problem(409, "idempotency-conflict", str(outcome), job_id=outcome.job_id)
            results.append(b'{"status":409,"problem":' + orjson.dumps(problem.document()) + b"}")
        else:
            try:
                doc = outcome.doc or await _stored_doc(request, outcome.job_id, tenant)
            except Problem as gone:
                results.append(b'{"status":410,"problem":' + orjson.dumps(gone.document()) + b"}")
                continue
            code = b"202" if outcome.created else b"200"
            results.append(b'{"status":' + code + b',"job":' + doc + b"}")
    return Response(b'{"results":[' + b",".join(results) + b"]}", 200, media_type=JSON)


# --- status ---------------------------------------------------------------------------------
async def get_job(request: Request) -> Response:
    """The hot path: near cache, coalesced Redis read, ETag, optional long-poll.

    Reads the scope directly (one pass over the headers, the lifespan state as a dict):
    at tens of thousands of reads a second the per-request bookkeeping is the cost.
    """
    scope = request.scope
    state = scope["state"]
    authorization, held, _ = _status_headers(scope["headers"])
    tenant = tenant_for(state["tenants"], authorization)
    job_id: str = scope["path_params"]["job_id"]
    # parameters are checked before the read: ?wait=-1 is refused whatever the job's state
    wait: float = (
        parse_query(request, STATUS_PARAMS).get("wait", 0.0) if scope["query_string"] else 0.0
    )
    reader: StatusReader = state["reader"]
    found = await reader.get(job_id)
    response = status_answer(job_id, tenant, held, found)
    if response.status_code != 304:
        return response
    assert found is not None  # a 304 answers a job the caller may read
    if wait <= 0 or doc_state(found[1]) in TERMINAL_STATES:
        return response
    return await _long_poll(reader, job_id, tenant, found[2], wait)


def status_answer(job_id: str, tenant: str, held: bytes | None, found: Status | None) -> Response:
    """The answer to a status read of what the reader found: the document with its ETag, a
    304 when ``If-None-Match`` holds the current version, or the 404 problem (an unknown id
    and another tenant's job look the same). Shared by the route and the fast path."""
    if found is None or found[0] != tenant:
        return job_not_found(job_id).response()
    if held is None or not etag_matches(held, found[2]):
        return DocResponse(found[1], found[2])
    return not_modified(found[2])


class StatusFastPath:
    """Plain ``GET /v1/jobs/{id}`` answered ahead of all of Starlette (``app.JobtierApp``
    calls it first, before its error middleware, router and request objects).

    It answers exactly what ``get_job`` answers for the common case — the document with its
    ETag, 304, or the 404 problem — and declines (``None`` from :meth:`match`) everything
    else, which the app then serves: no or an unknown API key (401), a query string
    (long-poll), paths that are not a job id, other methods, a URL or headers over the
    app's limits (``limits.RequestLimits`` answers those: here the check costs one addition
    per header, in the pass that finds the two we need). A read that fails is answered as
    the app's own error handlers answer it (a 503 problem while Redis is down), and so is
    any other error raised before the answer starts.

    The answer goes out as two raw ASGI messages with the header list built in one step,
    the headers ``DocResponse`` sends (``http.doc_headers``): at 20K reads a second on one
    core the Response object, Starlette's ``ServerErrorMiddleware`` (a closure around
    ``send`` for every request) and the coroutine of a near-cache hit were a measurable share
    of the server's CPU (bench/results/status_read-open20k.md).
    """

    __slots__ = ()

    @staticmethod
    def match(scope: Scope) -> tuple[str, str, bytes | None] | None:
        """(job id, tenant, If-None-Match) of a status read this path answers, else None."""
        if (
            scope["type"] == "http"
            and scope["method"] == "GET"
            and not scope["query_string"]
            and not scope.get("root_path")
        ):
            path: str = scope["path"]
            job_id = path[_JOBS_LEN:]
            if path.startswith(_JOBS) and job_id and "/" not in job_id and job_id != "batch":
                headers = scope["headers"]
                authorization, held, size = _status_headers(headers)
                tenant = known_tenant(scope["state"]["tenants"], authorization)
                if (
                    tenant is not None
                    and size <= MAX_HEADER_BYTES
                    and len(headers) <= MAX_HEADERS
                    and len(scope.get("raw_path") or path) <= MAX_URL_BYTES
                ):
                    return job_id, tenant, held
        return None

    @staticmethod
    async def answer(
        scope: Scope,
        receive: Receive,
        send: Send,
        job_id: str,
        tenant: str,
        held: bytes | None,
    ) -> None:
        """Send the answer to a request :meth:`match` accepted."""
        started = False
        try:
            reader: StatusReader = scope["state"]["reader"]
            entry = reader.near_hit(job_id)  # a hit without a coroutine: most reads
            if entry is not None:
                found_tenant, doc, version = entry.tenant, entry.doc, entry.version
            else:
                found = await reader.load(job_id)
                if found is None:
                    found_tenant, doc, version = None, b"", 0
                else:
                    found_tenant, doc, version = found
            if found_tenant != tenant:  # unknown, or another tenant's: the same 404
                response = job_not_found(job_id).response()
                started = True
                await response(scope, receive, send)
                return
            if held is None or not etag_matches(held, version):
                status, headers = 200, doc_headers(version, doc)
            else:
                status, headers, doc = 304, doc_headers(version, None), b""
            started = True
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": doc})
        except Exception as exc:
            if started:  # the answer is on its way (the client went away): the server's
                raise
            if isinstance(exc, Problem):
                response = exc.response()
            else:  # answered as the app answers it (503 while Redis or Postgres is down)
                response = await on_error(Request(scope, receive), exc)
            await response(scope, receive, send)


_JOBS = "/v1/jobs/"
_JOBS_LEN = len(_JOBS)


def _status_headers(
    headers: Iterable[tuple[bytes, bytes]],
) -> tuple[bytes | None, bytes | None, int]:
    """(Authorization, If-None-Match, size of all the headers) in one pass over the raw
    headers; the first of each wins, as in ``raw_header()``."""
    authorization = held = None
    size = 0
    for name, value in headers:
        size += len(name) + len(value)
        if name == b"authorization":
            if authorization is None:
                authorization = value
        elif name == b"if-none-match" and held is None:
            held = value
    return authorization, held, size


STATUS_PARAMS = [
    Param(
        "wait", "number",
        "long-poll: with If-None-Match, wait up to this many seconds for a newer version",
        minimum=0, maximum="long_poll_max_seconds",
    )
]  # fmt: skip


async def _long_poll(
    reader: StatusReader, job_id: str, tenant: str, held: int, wait: float
) -> Response:
    """Answer as soon as the job's version moves past ``held``, or 304 at the timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    changed: asyncio.Future[None] = loop.create_future()

    def listener(version: int, _tenant: str, _doc: bytes) -> None:
        if (version > held or version == RESYNC) and not changed.done():
            changed.set_result(None)

    reader.add_listener(job_id, listener)
    try:
        while True:
            # read after registering: a change between the first read and now is not lost
            found = await reader.get(job_id)
            if found is None or found[0] != tenant:
                raise job_not_found(job_id)
            if found[2] > held:
                return DocResponse(found[1], found[2])
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                async with asyncio.timeout(left):
                    await asyncio.shield(changed)
            except TimeoutError:
                break
            changed = loop.create_future()
    finally:
        reader.remove_listener(job_id, listener)
    return not_modified(held)


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
        return Response(msgspec.json.encode(body), media_type=JSON)
    # the stored JSON as it is, not decoded and encoded again
    return Response(
        msgspec.json.encode(body)[:-1] + b',"result":' + (raw or b"null") + b"}", media_type=JSON
    )


async def cancel(request: Request) -> Response:
    return await job_transition(
        request,
        JobControl.cancel_doc,
        lambda job_id, state: f"job {job_id} has already finished ({state})",
    )


routes = [
    Route("/v1/jobs", submit, methods=["POST"]),
    Route("/v1/jobs/batch", submit_batch, methods=["POST"]),
    Route("/v1/jobs/{job_id}", get_job, methods=["GET"]),
    Route("/v1/jobs/{job_id}/result", get_result, methods=["GET"]),
    Route("/v1/jobs/{job_id}/cancel", cancel, methods=["POST"]),
]
