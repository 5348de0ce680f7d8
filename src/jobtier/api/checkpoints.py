"""``GET /v1/jobs/{id}/checkpoint`` (tenant key): the last state the job saved with
``ctx.checkpoint``. The status document shows only that there is one (its ``checkpoint``:
when, by which attempt, how large); the state, bounded but perhaps large, is read here.

From Redis while it holds the job; after, from Postgres (``job_checkpoints``) when the API
has it. Another tenant's job is a 404, exactly like an unknown id.
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from jobtier.api import spec as oa
from jobtier.api.auth import tenant_of
from jobtier.api.http import JSON, job_id_of, job_not_found
from jobtier.api.sealed import opened
from jobtier.config import Settings
from jobtier.core.model import SavedCheckpoint
from jobtier.engine.checkpoint_reads import read_checkpoint
from jobtier.persist.db import query

_encode = msgspec.json.Encoder().encode


async def job_checkpoint(request: Request) -> Response:
    tenant = tenant_of(request)
    job_id = job_id_of(request)
    if await request.state.reader.get_for(job_id, tenant) is None:
        raise job_not_found(job_id)
    found = await read_checkpoint(request.state.queue.store, job_id)
    if found is not None:
        state, mark = found
        # an encrypted job's state is sealed at rest: its tenant reads it opened, as a result
        state = opened(request.state.queue.store.keyring, job_id, "checkpoint", state)
        saved = SavedCheckpoint(job_id, msgspec.Raw(state), mark.at, mark.attempt, mark.bytes)
        return Response(_encode(saved), media_type=JSON)
    pg: Any = getattr(request.state, "pg_reader", None)
    row = None
    if pg is not None:
        row = await pg.pool.fetchrow(query("latest_checkpoint"), job_id, tenant)
    if row is None:
        return Response(_encode(SavedCheckpoint(job_id, None)), media_type=JSON)
    at = row["at"].isoformat(timespec="milliseconds").replace("+00:00", "Z")
    state = opened(request.state.queue.store.keyring, job_id, "checkpoint", bytes(row["state"]))
    saved = SavedCheckpoint(job_id, msgspec.Raw(state), at, row["attempt"], len(state))
    return Response(_encode(saved), media_type=JSON)


OPENAPI_TYPES: list[type] = [SavedCheckpoint]


def operations(settings: Settings) -> oa.Paths:
    paths = oa.Paths(settings)
    paths.add(
        "GET /v1/jobs/{job_id}/checkpoint",
        job_checkpoint,
        "The last state the job saved with ctx.checkpoint (what its next attempt resumes "
        "from), when and by which attempt; state null when it saved none",
        oa.returns(200, "SavedCheckpoint", "the state, or null"),
        oa.JOB_404,
    )
    return paths
