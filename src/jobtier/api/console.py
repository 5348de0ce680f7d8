"""The console's routes that Redis alone serves (admin key): cancel any tenant's job, purge a
queue's ready jobs, the live workers with the jobs they run, and a stream of chosen jobs'
changes. Every action is audited; the Postgres part is ``console_records.py``.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncGenerator, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from jobtier.api import spec as oa
from jobtier.api import why
from jobtier.api.audit import audited
from jobtier.api.auth import require_admin
from jobtier.api.http import (
    Change,
    Refused,
    doc_state,
    encoded,
    finished,
    job_id_of,
    not_scheduled,
    outbox_transition,
)
from jobtier.api.params import Param, parse_query
from jobtier.api.problems import Problem
from jobtier.api.queues import queue_name
from jobtier.api.sse import StreamResponse, woken
from jobtier.config import Settings
from jobtier.core.model import JobStatus, State
from jobtier.core.names import JOB_ID_RE
from jobtier.core.worker_list import RunningJob, WorkerInfo, WorkerList
from jobtier.engine.control import JobControl
from jobtier.engine.queue import Queue
from jobtier.status.answer import DocResponse
from jobtier.status.docs import read_docs
from jobtier.status.reader import RESYNC, StatusReader

MAX_FOLLOWED = 100  # jobs one event stream follows (a page of the job list, in flight)
RUNNING_SHOWN = 2000  # running jobs the workers view lists (per shard at most this)
_ID = JOB_ID_RE.pattern.strip("^$")
_IDS = Param(
    "ids",
    "string",
    f"the jobs to follow: up to {MAX_FOLLOWED} ids, comma-separated",
    max_length=MAX_FOLLOWED * 32,
    pattern=f"^{_ID}(,{_ID}){{0,{MAX_FOLLOWED - 1}}}$",
)


class Purged(msgspec.Struct):
    """What a purge did: the queue's ready (and parked) jobs cancelled, and those ready when
    it ended (submitted meanwhile, or admitted from behind a concurrency key)."""

    queue: str
    cancelled: int
    remaining: int


_status = msgspec.json.Decoder(JobStatus)


async def _changed(
    request: Request, action: str, change: Change, refused: Refused, *, cancel: bool = False
) -> Response:
    """Any tenant's job changed (``outbox_transition``: a job still in the outbox too),
    audited as ``action`` with the state it was left in."""
    require_admin(request)
    job_id = job_id_of(request)
    async with audited(request, action, job_id) as outcome:
        doc = await outbox_transition(request, job_id, None, change, refused, cancel=cancel)
        outcome.detail = {"state": doc_state(doc)}
    return DocResponse(doc)


async def cancel(request: Request) -> Response:
    """Cancel any tenant's job: a waiting one at once, a running one at its next heartbeat
    (one still in the outbox is cancelled there)."""
    return await _changed(request, "job.cancel", JobControl.cancel_doc, finished, cancel=True)


async def promote(request: Request) -> Response:
    """Run any tenant's scheduled job now (``JobControl.promote``)."""
    return await _changed(request, "job.promote", JobControl.promote_doc, not_scheduled)


async def purge(request: Request) -> Response:
    """Cancel every ready job of the queue (``Queue.purge``), each as a cancel would."""
    require_admin(request)
    name = queue_name(request)
    queue: Queue = request.state.queue
    async with audited(request, "queue.purge", name) as outcome:
        done = await queue.admin.purge(name)
        outcome.detail = {"cancelled": done.cancelled, "remaining": done.remaining}
    body = Purged(name, done.cancelled, done.remaining)
    return encoded(body)


async def workers(request: Request) -> Response:
    require_admin(request)
    return encoded(await worker_list(request.state.queue))


async def worker_list(queue: Queue) -> WorkerList:
    """Every live worker, newest heartbeat first, with the jobs the shards' lease sets say
    it runs (a job counts for the worker its document names)."""
    keys, redis = queue.keys, queue.redis
    pipe = redis.pipeline(transaction=False)
    for shard in range(keys.shards):
        pipe.zcard(keys.active(shard))
        pipe.zrange(keys.active(shard), 0, RUNNING_SHOWN - 1)
    replies = await pipe.execute()
    total = sum(replies[0::2])
    ids = [member.decode() for members in replies[1::2] for member in members]
    by_worker: dict[str, list[RunningJob]] = defaultdict(list)
    if ids:
        for tenant, doc in await read_docs(redis, keys, ids):
            if doc is None:
                continue  # finished and expired between the two reads
            status = _status.decode(doc)
            if status.worker is not None and status.state == State.RUNNING:
                job = (status.id, tenant.decode(), status.type, status.queue, status.attempt)
                by_worker[status.worker].append(RunningJob(*job, status.updated_at))
    out = []
    for w in await queue.admin.live_workers():
        wid = str(w.get("id", ""))
        info = WorkerInfo(
            id=wid,
            host=str(w.get("host", "")),
            pid=int(w.get("pid", 0)),
            queues=list(w.get("queues", [])),
            tasks=list(w.get("tasks", [])),
            concurrency=int(w.get("concurrency", 0)),
            running=int(w.get("running", 0)),
            seen_at=float(w.get("seen_at", 0.0)),
            jobs=sorted(by_worker.get(wid, []), key=lambda j: j.since),
        )
        out.append(info)
    listed = sum(len(jobs) for jobs in by_worker.values())
    return WorkerList(out, total, listed)


class JobsStream:
    """The current status of each followed job that exists (``start`` reads them), then every
    change of any of them, until the client goes away (a failed job may be replayed: no
    state is the last).

    Changes are kept per job, latest only: a job changing faster than the client reads sends
    its newest status, never a backlog."""

    def __init__(self, reader: StatusReader, ids: list[str]) -> None:
        self.reader = reader
        self.sent: dict[str, int] = {}
        self.pending: dict[str, tuple[int, bytes]] = {}
        self.ready = asyncio.Event()
        self.listeners = {job_id: self._listener(job_id) for job_id in ids}
        # listen before the first read: a change between the two is not lost
        for job_id, listener in self.listeners.items():
            reader.add_listener(job_id, listener)

    def _listener(self, job_id: str) -> Callable[[int, str, bytes], None]:
        def offer(version: int, tenant: str, doc: bytes) -> None:
            held = self.pending.get(job_id)
            if version == RESYNC or held is None or version > held[0]:
                self.pending[job_id] = (version, doc)
                self.ready.set()

        return offer

    def stop(self) -> None:
        """Stop listening."""
        for job_id, listener in self.listeners.items():
            self.reader.remove_listener(job_id, listener)

    async def _read(self, ids: list[str]) -> None:
        statuses = await asyncio.gather(*map(self.reader.get, ids))
        for job_id, found in zip(ids, statuses, strict=True):
            if found is not None:
                held = self.pending.get(job_id)
                if held is None or held[0] == RESYNC or found[2] > held[0]:
                    self.pending[job_id] = (found[2], found[1])

    async def start(self) -> bool:
        """Read every followed job's status (after listening: nothing in between is lost);
        whether any of them exists. If none does, or the read fails, it stops listening."""
        try:
            await self._read(list(self.listeners))
        finally:
            if not self.pending:
                self.stop()
        return bool(self.pending)

    async def chunks(self, heartbeat: float) -> AsyncGenerator[bytes, None]:
        """The stream's text: the statuses, and a comment after ``heartbeat`` seconds of
        nothing."""
        yield b"retry: 1000\n\n"
        while True:
            pending, self.pending = self.pending, {}
            resync = [job_id for job_id, (v, _) in pending.items() if v == RESYNC]
            if resync:  # the subscription was re-established: events may be lost
                await self._read(resync)
                pending.update({i: self.pending.pop(i) for i in resync if i in self.pending})
            chunks = []
            for job_id, (version, doc) in pending.items():
                if version != RESYNC and version > self.sent.get(job_id, 0):
                    chunks.append(b"event: status\ndata: %s\n\n" % doc)
                    self.sent[job_id] = version
            if chunks:
                yield b"".join(chunks)
            if not self.pending and not await woken(self.ready, heartbeat):
                yield b": keep-alive\n\n"


async def job_events(request: Request) -> Response:
    """Server-Sent Events of the jobs named in ``ids``, whatever their tenant; a 404 when
    none of them exists (an unknown id among known ones is left out)."""
    require_admin(request)
    query = parse_query(request, [_IDS])
    if "ids" not in query:
        raise Problem(400, "bad-request", "name the jobs to follow: ids=<id>,<id>…", field="ids")
    keys = request.state.queue.keys
    # an id of a shard this deployment lacks is a job nobody has, like an unknown one
    ids = [job_id for job_id in dict.fromkeys(query["ids"].split(",")) if keys.valid_id(job_id)]
    stream = JobsStream(request.state.reader, ids)
    if not await stream.start():
        raise Problem(404, "not-found", "none of these jobs exists (ids)")
    return StreamResponse(stream.chunks(request.state.settings.sse_heartbeat_seconds), stream.stop)


OPENAPI_TYPES: list[type] = [Purged, WorkerList]


def operations(settings: Settings) -> oa.Paths:
    paths = oa.Paths(settings, auth="admin")
    paths.add(
        "POST /v1/admin/jobs/{job_id}/cancel",
        cancel,
        "Cancel any tenant's job: a waiting one at once, a running one at its next heartbeat "
        "(audited)",
        oa.returns(200, "JobStatus", "cancelled, or running with cancel_requested"),
        oa.unknown("job", tenants=False),
        oa.refuses(409, "the job has already finished (job: its status)"),
    )
    paths.add(
        "POST /v1/admin/jobs/{job_id}/promote",
        promote,
        "Run any tenant's scheduled job now: a delayed one, or one waiting out a retry's "
        "back-off (audited)",
        oa.returns(200, "JobStatus", "queued"),
        oa.unknown("job", tenants=False),
        oa.refuses(409, "the job is not scheduled (job: its status), or is still in the outbox"),
    )
    paths.add(
        "GET /v1/admin/jobs/{job_id}/explain",
        why.admin_explain,
        "Why any tenant's job has not started (GET /v1/jobs/{job_id}/explain's answer)",
        oa.returns(200, "Explanation", "the reasons, each in words and numbers"),
        oa.unknown("job", tenants=False),
    )
    paths.add(
        "POST /v1/admin/queues/{name}/purge",
        purge,
        "Cancel every ready (or parked) job of the queue, oldest first, each as a cancel would; "
        "scheduled and running jobs stay (audited)",
        oa.returns(200, "Purged", "how many were cancelled, and how many are ready now"),
        oa.BAD_QUEUE_NAME,
    )
    paths.add(
        "GET /v1/admin/workers",
        workers,
        "Live workers: host, pid, queues, tasks, concurrency, last heartbeat, and the jobs each "
        "runs",
        oa.returns(200, "WorkerList", "the workers, newest heartbeat first"),
    )
    status = "event: status, data: the status document of one of the jobs"
    events = paths.add(
        "GET /v1/admin/events",
        job_events,
        f"Server-Sent Events: the status of each of up to {MAX_FOLLOWED} jobs (any tenant), then "
        "every change of any of them, until the client closes",
        (200, oa.event_stream(status, "status", oa.ref("JobStatus"))),
        oa.refuses(404, "none of the jobs exists"),
        params=[_IDS],
    )
    events["parameters"][0]["required"] = True
    return paths
