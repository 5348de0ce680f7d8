"""Routes for looking into a job and acting on it once it went wrong.

- ``GET /v1/jobs/{id}/logs`` (tenant key): the lines its task logged with ``ctx.log()``. They
  live in Redis only, expiring with the job (a debugging aid the write-behind need not carry):
  a job only Postgres still holds has none left (an empty list, not a 404).
- ``POST /v1/jobs/{id}/retry`` (tenant key): the admin's replay, for the job's own tenant.
- ``GET /v1/admin/dead-letters/{id}`` (admin key): one dead letter in full, its status (the
  error with its traceback), payload and log lines.

Another tenant's job is a 404, exactly like an unknown id, as on every job route.
"""

from __future__ import annotations

from typing import Any

import msgspec
import orjson
from starlette.requests import Request
from starlette.responses import Response

from jobtier.api.auth import require_admin, tenant_of
from jobtier.api.http import JSON, job_id_of, job_not_found, job_transition
from jobtier.api.problems import Problem
from jobtier.core.errors import JobNotFound
from jobtier.core.model import JobStatus, LogLine
from jobtier.core.sealing import masked
from jobtier.engine.control import JobControl
from jobtier.engine.queue import Queue


class DeadLetter(msgspec.Struct):
    """``GET /v1/admin/dead-letters/{id}``: the job, its payload and its log lines."""

    job: JobStatus
    payload: Any
    lines: list[LogLine]


async def job_logs(request: Request) -> Response:
    tenant = tenant_of(request)
    job_id = job_id_of(request)
    # the owner from the status tier, down to Postgres: an expired job answers with no lines
    if await request.state.reader.get_for(job_id, tenant) is None:
        raise job_not_found(job_id)
    queue: Queue = request.state.queue
    lines = await queue.jobs.log_lines(job_id)  # stored as JSON (LogLine): sent as they are
    body = b'{"id":' + orjson.dumps(job_id) + b',"lines":[' + b",".join(lines) + b"]}"
    return Response(body, media_type=JSON)


async def retry(request: Request) -> Response:
    def refused(job_id: str, state: str) -> str:
        return f"job {job_id} has not failed ({state}): only a failed job is retried"

    return await job_transition(request, JobControl.replay_doc, refused)


async def dead_letter(request: Request) -> Response:
    require_admin(request)
    job_id = job_id_of(request)
    queue: Queue = request.state.queue
    try:
        doc, payload, lines = await queue.jobs.dead_letter(job_id)
    except JobNotFound:
        detail = f"job {job_id[:64]} is not in the dead-letter set (or expired)"
        raise Problem(404, "not-found", detail) from None
    payload = masked(payload) or payload  # the admin's: never opened (docs/encryption.md)
    body = b'{"job":' + doc + b',"payload":' + payload + b',"lines":[' + b",".join(lines) + b"]}"
    return Response(body, media_type=JSON)
