"""A job's flow as the console's job page shows it (any tenant): the jobs it waits for, each
with its outcome (the error's type and message, or whether it left a result) or, while
pending, the state its own status document has now; and, for a parent, how many of its
children are done. Read as ``GET /v1/jobs/{id}/dependencies`` reads it: from Redis while it
holds the job, Postgres after.
"""

from __future__ import annotations

import asyncio
import contextlib

import msgspec

from jobtier.api.http import doc_state
from jobtier.core.errors import JobNotFound
from jobtier.core.model import Dependencies, Dependency, JobError
from jobtier.engine.queue import Queue
from jobtier.persist.pg_reader import PgReader
from jobtier.status.reader import StatusReader

# a fan-in may wait for thousands: the page lists this many (the children's counts are over
# all of them, and the status document's `dependencies` says how many there are)
DEPENDENCIES_SHOWN = 200


class DependencyView(msgspec.Struct, kw_only=True):
    """One job the job waits for. ``state``: ``pending`` until it finishes, then
    ``succeeded``, ``failed``, ``cancelled`` or ``missing`` (as the flow recorded it);
    ``now``: a pending one's state in its own status document (null when no longer known);
    ``error``: a failed or cancelled one's type and message (its traceback is on its page);
    ``result``: whether a succeeded one left a result (not null, or kept in the result
    store); ``child``: made in the same flow as the job."""

    id: str
    state: str
    child: bool
    now: str | None = None
    error: JobError | None = None
    result: bool = False


class FlowView(msgspec.Struct):
    """The first ``DEPENDENCIES_SHOWN`` dependencies, in order; for a parent, how many of its
    children there are, are done and did not succeed (else None)."""

    dependencies: list[DependencyView]
    children: Dependencies | None


async def flow_view(
    queue: Queue, reader: StatusReader, pg: PgReader, job_id: str, tenant: str, live: bool
) -> FlowView:
    """The flow of ``job_id`` (of ``tenant``), from Redis when ``live``, else Postgres;
    Postgres errors propagate (the caller answers 503)."""
    found: list[Dependency] | None = None
    if live:
        with contextlib.suppress(JobNotFound):  # expired since the detail read: Postgres has it
            found = await queue.jobs.dependencies(job_id, reveal=False)  # states only
    if found is None:
        found = await pg.dependencies(job_id, tenant) or []
    children = [d for d in found if d.child]
    summary = None
    if children:
        done = [d for d in children if d.state != "pending"]
        failed = sum(d.state != "succeeded" for d in done)
        summary = Dependencies(len(children), len(done), failed)
    shown = found[:DEPENDENCIES_SHOWN]
    pending = [d.id for d in shown if d.state == "pending"]
    # a pending one's state now (waiting in a chain, queued, running), through the status tier
    docs = await asyncio.gather(*map(reader.get, pending))
    now = {i: doc_state(status[1]) for i, status in zip(pending, docs, strict=True) if status}
    return FlowView([_view(d, now.get(d.id)) for d in shown], summary)


def _view(dep: Dependency, now: str | None) -> DependencyView:
    error = dep.error
    if error is not None and error.traceback is not None:
        error = JobError(error.type, error.message)
    has_result = dep.state == "succeeded" and (dep.result is not None or dep.result_url is not None)
    return DependencyView(
        id=dep.id, state=dep.state, child=dep.child, now=now, error=error, result=has_result
    )
