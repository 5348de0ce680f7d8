"""Job routes: submit (one, batch), status (with ETag and long-poll), result, cancel."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import msgspec
import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from jobtier.api.auth import raw_header, tenant_of
from jobtier.api.problems import Problem, not_found
from jobtier.cache.reader import RESYNC, StatusReader, parse_version
from jobtier.errors import IdempotencyConflict, InvalidRequest, JobNotFound, TransitionRefused
from jobtier.model import TERMINAL
from jobtier.queue import JobSpec, Queue, Submitted

JSON = "application/json"
_spec_decoder = msgspec.json.Decoder(JobSpec)


class BatchBody(msgspec.Struct, forbid_unknown_fields=True):
    jobs: list[JobSpec]


_batch_decoder = msgspec.json.Decoder(BatchBody)


def doc_response(doc: bytes, version: int, status: int = 200, **headers: str) -> Response:
    headers["etag"] = f'"{version}"'
    headers["cache-control"] = "no-cache"
    return Response(doc, status, headers=headers, media_type=JSON)


def doc_state(doc: bytes) -> str:
    start = doc.find(b'"state":"') + 9
    return doc[start : doc.find(b'"', start)].decode()


TERMINAL_STATES = frozenset(s.value for s in TERMINAL)


def etag_matches(header: bytes, version: int) -> bool:
    """If-None-Match: ``*``, or a list of (weak or strong) tags one of which is ours."""
    text = header.decode("latin-1").strip()
    if text == "*":
        return True
    ours = str(version)
    for tag in text.split(","):
        tag = tag.strip()
        if tag.startswith("W/"):
            tag = tag[2:]
        if tag.strip('"') == ours:
            return True
    return False


# --- body reading ---------------------------------------------------------------------------
async def read_json_body(request: Request, limit: int) -> bytes:
    content_type = raw_header(request, b"content-type")
    if content_type is not None and not content_type.split(b";")[0].strip().lower().endswith(
        b"json"
    ):
        raise Problem(415, "unsupported-media-type", "send the body as application/json")
    length = raw_header(request, b"content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise Problem(413, "payload-too-large", f"the body is over the {limit}-byte limit")
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise Problem(413, "payload-too-large", f"the body is over the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


def decode_body(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    if not body:
        raise Problem(400, "invalid-json", "the request has no body; send a JSON object")
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        # msgspec names the offending member: "... - at `$.jobs[1].priority`"
        message = str(exc)
        _, at, path = message.rpartition(" - at `$")
        extra: dict[str, Any] = {"field": path.rstrip("`").lstrip(".")} if at and path.strip("`") else {}
        raise Problem(422, "validation", message, **extra) from None
    except msgspec.DecodeError as exc:
        raise Problem(400, "invalid-json", f"the body is not valid JSON: {exc}") from None


def invalid(exc: InvalidRequest) -> Problem:
    extra: dict[str, Any] = {"field": exc.field} if exc.field else {}
    return Problem(422, "validation", str(exc), **extra)


# --- submit ---------------------------------------------------------------------------------
async def submit(request: Request) -> Response:
    tenant = tenant_of(request)
    st = request.state
    spec: JobSpec = decode_body(_spec_decoder, await read_json_body(request, st.body_limit))
    header_key = raw_header(request, b"idempotency-key")
    if header_key is not None:
        key = header_key.decode("latin-1")
        if spec.idempotency_key not in (None, key):
            raise Problem(
                400,
                "bad-request",
                "the Idempotency-Key header and the body's idempotency_key differ",
            )
        spec.idempotency_key = key
    queue: Queue = st.queue
    try:
        item = queue.prepare(spec, tenant)
    except InvalidRequest as exc:
        raise invalid(exc) from None
    st.admission.check(tenant)
    (outcome,) = await queue.submit_many_prepared([item])
    return await _submitted(request, outcome, tenant)


async def _submitted(
    request: Request, outcome: Submitted | IdempotencyConflict, tenant: str
) -> Response:
    if isinstance(outcome, IdempotencyConflict):
        raise Problem(409, "idempotency-conflict", str(outcome), job_id=outcome.job_id)
    doc = outcome.doc or await _stored_doc(request, outcome.job_id, tenant)
    return doc_response(
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
    body: BatchBody = decode_body(
        _batch_decoder, await read_json_body(request, st.batch_body_limit)
    )
    if not body.jobs:
        raise Problem(422, "validation", "jobs is empty", field="jobs")
    if len(body.jobs) > queue.settings.max_batch:
        raise Problem(
            413,
            "payload-too-large",
            f"at most {queue.settings.max_batch} jobs per batch",
            field="jobs",
        )
    items = []
    for index, spec in enumerate(body.jobs):
        try:
            items.append(queue.prepare(spec, tenant))
        except InvalidRequest as exc:
            raise Problem(
                422,
                "validation",
                f"jobs[{index}]: {exc}",
                field=f"jobs[{index}].{exc.field or ''}".rstrip("."),
            ) from None
    st.admission.check(tenant, len(items))
    results = []
    for outcome in await queue.submit_many_prepared(items):
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
    """The hot path: near cache, coalesced Redis read, ETag, optional long-poll."""
    tenant = tenant_of(request)
    job_id: str = request.path_params["job_id"]
    reader: StatusReader = request.state.reader
    found = await reader.get(job_id)
    if found is None or found[0] != tenant:
        raise not_found(f"job {job_id}")
    _, doc, version = found
    held = raw_header(request, b"if-none-match")
    if held is None or not etag_matches(held, version):
        return doc_response(doc, version)
    wait = _wait_seconds(request) if request.scope["query_string"] else 0.0
    if wait <= 0 or doc_state(doc) in TERMINAL_STATES:
        return Response(
            status_code=304, headers={"etag": f'"{version}"', "cache-control": "no-cache"}
        )
    return await _long_poll(reader, job_id, tenant, version, wait)


def _wait_seconds(request: Request) -> float:
    raw = request.query_params.get("wait")
    if raw is None:
        return 0.0
    limit: float = request.state.settings.long_poll_max_seconds
    try:
        wait = float(raw)
    except ValueError:
        raise Problem(400, "bad-request", "wait must be a number of seconds") from None
    if not math.isfinite(wait) or wait < 0 or wait > limit:
        raise Problem(400, "bad-request", f"wait must be between 0 and {limit:g} seconds")
    return wait


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
                raise not_found(f"job {job_id}")
            if found[2] > held:
                return doc_response(found[1], found[2])
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
    return Response(status_code=304, headers={"etag": f'"{held}"', "cache-control": "no-cache"})


async def get_result(request: Request) -> Response:
    tenant = tenant_of(request)
    job_id = request.path_params["job_id"]
    queue: Queue = request.state.queue
    try:
        status, result = await queue.result(job_id, tenant)
    except JobNotFound:
        fallback = request.state.result_fallback
        found = await fallback(job_id, tenant) if fallback else None
        if found is None:
            raise not_found(f"job {job_id}") from None
        return Response(orjson.dumps(found), media_type=JSON)
    body = {
        "id": status.id,
        "state": status.state,
        "version": status.version,
        "result": result,
        "error": status.error,
    }
    return Response(msgspec.json.encode(body), media_type=JSON)


async def cancel(request: Request) -> Response:
    tenant = tenant_of(request)
    job_id = request.path_params["job_id"]
    queue: Queue = request.state.queue
    try:
        doc = await queue.cancel_doc(job_id, tenant)
    except JobNotFound:
        raise not_found(f"job {job_id}") from None
    except TransitionRefused as exc:
        try:
            current = await queue.status_doc(job_id, tenant)
        except JobNotFound:  # finished and expired between the two reads
            raise not_found(f"job {job_id}") from None
        raise Problem(
            409, "wrong-state", f"job {job_id} has already finished ({doc_state(current)})",
            job=orjson.loads(current),
        ) from exc  # fmt: skip
    return doc_response(doc, parse_version(doc))


routes = [
    Route("/v1/jobs", submit, methods=["POST"]),
    Route("/v1/jobs/batch", submit_batch, methods=["POST"]),
    Route("/v1/jobs/{job_id}", get_job, methods=["GET"]),
    Route("/v1/jobs/{job_id}/result", get_result, methods=["GET"]),
    Route("/v1/jobs/{job_id}/cancel", cancel, methods=["POST"]),
]
