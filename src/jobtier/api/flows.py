"""Flow routes: submit a flow (``POST /v1/flows``), read a job's dependencies."""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from jobtier.api.auth import tenant_of
from jobtier.api.durable_submit import replicated
from jobtier.api.http import (
    JSON,
    encoded,
    invalid,
    job_id_of,
    job_not_found,
    registrar,
    repeat_doc,
    submit_body,
)
from jobtier.api.problems import Problem
from jobtier.api.sealed import seal_problems
from jobtier.core.errors import IdempotencyConflict, InvalidRequest, JobNotFound
from jobtier.core.model import Dependency, FlowSpec
from jobtier.engine.queue import Queue

_flow_decoder = msgspec.json.Decoder(FlowSpec)


class DependencyList(msgspec.Struct):
    """A job's dependencies in order: ``pending`` until one finishes, then its outcome."""

    id: str
    dependencies: list[Dependency]


async def submit_flow(request: Request) -> Response:
    tenant = tenant_of(request)
    st = request.state
    body = await submit_body(request, _flow_decoder)
    queue: Queue = st.queue
    try:
        prepared = await queue.produce.prepare_flow(body.jobs, tenant, body.idempotency_key)
        st.admission.check(tenant, len(prepared), [i.priority for i in prepared.items])
        # its jobs' callbacks written first, as a plain submit's (api/jobs.py)
        service = registrar(request, prepared.callbacks, "jobs[{}].")
        async with replicated(request):
            outcome = await queue.produce.submit_flow_prepared(prepared, service)
    except InvalidRequest as exc:
        raise invalid(exc) from None
    except IdempotencyConflict as exc:
        raise Problem(409, "idempotency-conflict", str(exc), job_id=exc.job_id) from None
    docs = []
    for job in outcome.jobs:
        gone = f"this idempotency key made a flow whose job {job.job_id} is no longer kept"
        docs.append(msgspec.Raw(job.doc or await repeat_doc(request, job.job_id, tenant, gone)))
    body_out = msgspec.json.encode({"created": outcome.created, "jobs": docs})  # FlowResponse
    return Response(body_out, 202 if outcome.created else 200, media_type=JSON)


async def dependencies(request: Request) -> Response:
    tenant = tenant_of(request)
    job_id = job_id_of(request)
    queue: Queue = request.state.queue
    with seal_problems(job_id):  # the tenant's own: encrypted results opened
        try:
            found = await queue.jobs.dependencies(job_id, tenant)
        except JobNotFound:
            fallback = getattr(request.state, "dependencies_fallback", None)
            stored = await fallback(job_id, tenant) if fallback is not None else None
            if stored is None:
                raise job_not_found(job_id) from None
            found = stored
    return encoded(DependencyList(job_id, found))
