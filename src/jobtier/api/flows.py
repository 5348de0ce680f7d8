"""Flow routes: submit a flow (``POST /v1/flows``), read a job's dependencies."""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from jobtier.api.auth import tenant_of
from jobtier.api.http import (
    JSON,
    decode_body,
    idempotency_key,
    invalid,
    job_id_of,
    job_not_found,
    read_json_body,
)
from jobtier.api.problems import Problem, postgres_or_503, secret_missing
from jobtier.core.errors import IdempotencyConflict, InvalidRequest, JobNotFound
from jobtier.core.model import Dependency, FlowSpec, FlowSubmitted
from jobtier.engine.queue import Queue
from jobtier.flows.submit import PreparedFlow
from jobtier.webhooks.callbacks import SecretMissing

_flow_decoder = msgspec.json.Decoder(FlowSpec)


class DependencyList(msgspec.Struct):
    """A job's dependencies in order: ``pending`` until one finishes, then its outcome."""

    id: str
    dependencies: list[Dependency]


async def submit_flow(request: Request) -> Response:
    tenant = tenant_of(request)
    st = request.state
    body: FlowSpec = decode_body(_flow_decoder, await read_json_body(request))
    body.idempotency_key = idempotency_key(request, body.idempotency_key)
    queue: Queue = st.queue
    try:
        prepared = await queue.produce.prepare_flow(body.jobs, tenant, body.idempotency_key)
    except InvalidRequest as exc:
        raise invalid(exc) from None
    st.admission.check(tenant, len(prepared))
    try:
        outcome = await _submit(request, queue, prepared)
    except IdempotencyConflict as exc:
        raise Problem(409, "idempotency-conflict", str(exc), job_id=exc.job_id) from None
    docs = []
    for job in outcome.jobs:
        doc = job.doc
        if not doc:  # a repeat whose job Redis no longer keeps: Postgres may
            found = await st.reader.get(job.job_id)
            if found is None or found[0] != tenant:
                detail = (
                    f"this idempotency key made a flow whose job {job.job_id} is no longer kept"
                )
                raise Problem(410, "gone", detail, job_id=job.job_id)
            doc = bytes(found[1])
        docs.append(msgspec.Raw(doc))
    body_out = msgspec.json.encode({"created": outcome.created, "jobs": docs})  # FlowResponse
    return Response(body_out, 202 if outcome.created else 200, media_type=JSON)


async def _submit(request: Request, queue: Queue, prepared: PreparedFlow) -> FlowSubmitted:
    """The flow, with its jobs' callbacks written first (as a plain submit's: api/jobs.py)."""
    if not any(prepared.callbacks):
        return await queue.produce.submit_flow_prepared(prepared)
    service = getattr(request.state, "webhooks", None)
    if service is None:
        index = next(i for i, cb in enumerate(prepared.callbacks) if cb is not None)
        detail = "callbacks need the API's Postgres part, which this API runs without"
        raise Problem(422, "validation", detail, field=f"jobs[{index}].callback.url")
    try:
        with postgres_or_503():
            return await queue.produce.submit_flow_prepared(prepared, service.callbacks)
    except SecretMissing as exc:
        raise secret_missing(exc) from None
    except InvalidRequest as exc:  # a refused callback (or depends_on): nothing submitted
        raise invalid(exc) from None


async def dependencies(request: Request) -> Response:
    tenant = tenant_of(request)
    job_id = job_id_of(request)
    queue: Queue = request.state.queue
    try:
        found = await queue.jobs.dependencies(job_id, tenant)
    except JobNotFound:
        fallback = getattr(request.state, "dependencies_fallback", None)
        stored = await fallback(job_id, tenant) if fallback is not None else None
        if stored is None:
            raise job_not_found(job_id) from None
        found = stored
    return Response(msgspec.json.encode(DependencyList(job_id, found)), media_type=JSON)
