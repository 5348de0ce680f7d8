"""``GET /v1/jobs/{id}/result/content``: a succeeded job's result, byte for byte as the task's
result was encoded, streamed from wherever it is kept (the result store for a large one,
``persist/results.py``; Redis or Postgres for the others). The status document's
``result_url`` points here for a stored result; the route serves any succeeded job's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from jobtier.api import spec as oa
from jobtier.api.auth import tenant_of
from jobtier.api.http import JSON, doc_state, job_id_of, job_not_found
from jobtier.api.problems import Problem
from jobtier.api.sealed import opened
from jobtier.config import Settings
from jobtier.core.model import is_ref, ref_of
from jobtier.core.sealing import MASK, Keyring, is_sealed
from jobtier.engine.queue import Queue
from jobtier.persist.pg_reader import PgReader
from jobtier.persist.results import reader_for
from jobtier.status.docs import read_doc


async def content(request: Request) -> Response:
    tenant = tenant_of(request)
    job_id = job_id_of(request)
    queue: Queue = request.state.queue
    owner, doc, value = await read_doc(queue.redis, queue.keys, job_id, "result")
    if doc is not None:
        if owner != tenant.encode():
            raise job_not_found(job_id)
        state = doc_state(doc)
        ref = ref_of(value) if is_ref(value) else None
    else:  # no longer in Redis: Postgres has it
        reader: PgReader = request.state.pg_reader
        found = await reader.result(job_id, tenant)
        if found is None:
            raise job_not_found(job_id)
        state, value, ref = found.state.value, found.result, found.ref
    if state != "succeeded":
        detail = f"job {job_id} has no result: it is {state}, not succeeded"
        raise Problem(409, "wrong-state", detail)
    keyring = queue.store.keyring  # the tenant's own: an encrypted result opened
    if ref is None:
        return Response(opened(keyring, job_id, "result", value or b"null"), media_type=JSON)
    return await stored_result(request, job_id, ref, keyring, mask=False)


async def stored_result(
    request: Request, job_id: str, ref: str, keyring: Keyring | None = None, mask: bool = True
) -> Response:
    """A result the result store keeps, streamed byte for byte; 410 once it no longer does.
    An encrypted one is read whole and opened with ``keyring``; without one, shown as
    ``"[encrypted]"`` when ``mask`` (the admin routes: docs/encryption.md), else the problem
    the tenant's other result routes answer (a 503 naming the missing keys)."""
    store = await reader_for(ref, request.state.pg_extension.pool)
    size = await store.size(ref)
    if size is None:
        raise Problem(410, "gone", f"the result of job {job_id} is no longer kept", job_id=job_id)
    chunks: AsyncIterator[bytes] = store.stream(ref)
    first = await anext(chunks, b"")
    if is_sealed(first):
        if keyring is None and mask:
            return Response(MASK, media_type=JSON)
        whole = first + b"".join([chunk async for chunk in chunks])
        return Response(opened(keyring, job_id, "result", whole), media_type=JSON)
    return StreamingResponse(
        _again(first, chunks), media_type=JSON, headers={"content-length": str(size)}
    )


async def _again(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The stream whose first chunk was read already."""
    if first:
        yield first
    async for chunk in rest:
        yield chunk


def operations(settings: Settings) -> oa.Paths:
    paths = oa.Paths(settings)
    paths.add(
        "GET /v1/jobs/{job_id}/result/content",
        content,
        "A succeeded job's result, exactly as the task's result was encoded (streamed; the "
        "status document's result_url for a result kept outside Redis)",
        (200, oa.content("the result (JSON)", "application/json", {})),
        oa.JOB_404,
        oa.refuses(409, "the job has not succeeded"),
        oa.refuses(410, "the result is no longer kept (job_id)"),
        *oa.SEALED,
    )
    return paths
