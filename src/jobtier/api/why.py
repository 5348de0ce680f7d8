"""Why a job has not started: ``GET /v1/jobs/{id}/explain`` (the tenant's job) and
``GET /v1/admin/jobs/{id}/explain`` (any tenant's, for the console's job page), answered by
``Queue.explain`` (engine/explain.py)."""

from __future__ import annotations

import time

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from jobtier.api.auth import require_admin, tenant_of
from jobtier.api.http import doc_state, encoded, job_id_of, job_not_found
from jobtier.core.errors import JobNotFound
from jobtier.core.explanation import Explanation, Reason, ReasonCode
from jobtier.engine.explain import OtherTenants, iso
from jobtier.engine.queue import Queue
from jobtier.persist.outbox import UNKNOWN_TYPE_PATIENCE
from jobtier.status.reader import StatusReader


async def _answer(request: Request, tenant: str | None) -> Response:
    job_id = job_id_of(request)
    queue: Queue = request.state.queue
    try:
        return encoded(await queue.explain(job_id, tenant))
    except OtherTenants:
        raise job_not_found(job_id) from None
    except JobNotFound:
        pass
    # Redis no longer holds it: a job kept only in Postgres (the status tier's fallback) has
    # finished long ago
    reader: StatusReader = request.state.reader
    found = await reader.get(job_id)
    if found is None or (tenant is not None and found[0] != tenant):
        raise job_not_found(job_id) from None
    state = doc_state(found[1])
    if state in ("succeeded", "failed", "cancelled"):
        message = f"it is not waiting: it has finished ({state}), and only Postgres keeps it now"
        reason = Reason(ReasonCode.NOT_WAITING, message)
    elif state == "submitted":  # an outbox row (jobtier.submit), its transaction committed
        message = (
            "it was submitted with SQL and the outbox relay has not made it a job yet: a "
            "persister's relay takes it within a second, unless no worker has advertised its "
            f"type yet (it waits up to {UNKNOWN_TYPE_PATIENCE:g} s for one: the persister logs "
            "event=outbox_job_waiting) or a job it depends on is not relayed yet; with no "
            "persister running, nothing relays it"
        )
        reason = Reason(ReasonCode.NOT_RELAYED, message, queue=_queue_of(found[1]))
    else:  # Redis lost it (a restart without its data, a failover): nothing will move it
        message = (
            f"Redis does not hold it, though Postgres has it {state}: Redis lost it (a "
            "restart without its data, a failover). `jobtier reconcile` puts it back, its "
            "--since reaching past the job's last change (e.g. --since 2d)"
        )
        reason = Reason(ReasonCode.UNKNOWN, message, queue=_queue_of(found[1]))
    now = iso(int(time.time() * 1000))
    return encoded(Explanation(job_id, state, False, [reason], None, now))


async def explain(request: Request) -> Response:
    """The tenant's job: another tenant's is a 404, as an unknown id."""
    return await _answer(request, tenant_of(request))


async def admin_explain(request: Request) -> Response:
    """Any tenant's job (the console's job page)."""
    require_admin(request)
    return await _answer(request, None)


def _queue_of(doc: bytes) -> str | None:
    """The ``queue`` of a status document (one from Postgres: any version's keeps it)."""
    queue = msgspec.json.decode(doc, type=_Queued).queue
    return queue or None


class _Queued(msgspec.Struct):
    queue: str = ""
