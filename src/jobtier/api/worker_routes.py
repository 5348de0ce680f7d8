"""The HTTP worker protocol (``/v1/worker/…``, tag ``worker``, a worker key): workers in any
language claim jobs, extend their leases, report progress and log lines, and complete, fail
or give back their jobs, through the same Lua scripts as a Python worker.

Every answer about a job carries the claim's fencing token (``lease_version``) and the
worker's id: the scripts refuse an answer whose lease is no longer the job's (it expired and
the job moved on), and the route says so with a 409 — nothing changed. The worker's id in
Redis is ``http:<worker>``, so an HTTP worker can never answer for a Python worker's job.
"""

from __future__ import annotations

import hmac
import logging
import random
import time
from datetime import UTC, datetime
from typing import Any

import msgspec
import orjson
from starlette.requests import Request
from starlette.responses import Response

from jobtier.api import spec as oa
from jobtier.api.auth import bearer_key, raw_header
from jobtier.api.http import decode_body, encoded, job_id_of, job_not_found, read_json_body
from jobtier.api.problems import Problem
from jobtier.api.worker_adverts import guarded, not_encrypted
from jobtier.api.worker_bodies import (
    DEFAULT_BACKOFF,
    ERROR_CHARS,
    MAX_CLAIM,
    OPENAPI_TYPES,
    TRACEBACK_CHARS,
    ClaimRequest,
    ClaimResponse,
    CompleteManyRequest,
    CompleteManyResponse,
    CompleteRequest,
    FailRequest,
    HeartbeatRequest,
    HeartbeatResponse,
    ItemOutcome,
    LeaseRequest,
    LeaveRequest,
    LeaveResponse,
    LogRequest,
    LogResponse,
    Outcome,
    ProgressRequest,
    RetryBackoff,
    TasksRequest,
    TasksResponse,
    WorkerJob,
    retry_delay,
)
from jobtier.api.worker_claims import Claimed, QueuesLimited, WorkerClaims
from jobtier.api.worker_holds import check_fail, held_by, hold_queue
from jobtier.api.worker_presence import advertise, forget, still_live
from jobtier.api.worker_refusals import (
    attempt_now,
    item_refused,
    items_refused_now,
    refused_now,
)
from jobtier.config import Settings
from jobtier.core.errors import Code, JobNotFound
from jobtier.core.model import (
    LOG_LINE_CHARS,
    LOG_LINES,
    Backoff,
    LogLine,
    TaskAd,
    encode_json,
)
from jobtier.core.names import HTTP_WORKER_PREFIX
from jobtier.core.sealing import is_sealed
from jobtier.engine.catalog import publish
from jobtier.engine.payload_schema import schema_problem
from jobtier.engine.queue import Queue
from jobtier.flows.reads import from_inputs
from jobtier.store.calls import (
    complete_call,
    fail_call,
    heartbeat_call,
    joblog_call,
    parse_pairs,
    stopped_call,
)

_decoders = {t: msgspec.json.Decoder(t) for t in OPENAPI_TYPES if t.__name__.endswith("Request")}


# --- auth and helpers -------------------------------------------------------------------------
log = logging.getLogger("jobtier.api.worker")


def require_worker(request: Request) -> None:
    """A 401 problem unless the request carries a worker key (403 for a tenant's or the
    admin key: those never run jobs)."""
    key = bearer_key(raw_header(request, b"authorization"))
    if key is None:
        raise _unauthorized("send an API key as 'Authorization: Bearer <key>': a worker key")
    keys: list[str] = request.state.worker_keys
    if any(hmac.compare_digest(key.encode(), k.encode()) for k in keys):
        return
    if key in request.state.tenants or (key and key == request.state.admin_key):
        raise Problem(403, "forbidden", "this route needs a worker key (JOBTIER_WORKER_KEYS)")
    if not keys:
        raise _unauthorized("this API has no worker keys: set JOBTIER_WORKER_KEYS")
    raise _unauthorized("unknown API key")


def _unauthorized(detail: str) -> Problem:
    return Problem(
        401, "unauthorized", detail, headers={"www-authenticate": 'Bearer realm="jobtier"'}
    )


async def _body(request: Request, kind: type[Any]) -> Any:
    require_worker(request)
    return decode_body(_decoders[kind], await read_json_body(request))


def _redis_id(worker: str) -> str:
    return HTTP_WORKER_PREFIX + worker


async def _one(queue: Queue, call: Any) -> Any:
    (reply,) = await queue.scripts.call_many([call])
    return reply


# --- routes -----------------------------------------------------------------------------------
async def claim(request: Request) -> Response:
    body: ClaimRequest = await _body(request, ClaimRequest)
    settings: Settings = request.state.settings
    if body.wait > settings.long_poll_max_seconds:
        raise Problem(
            422,
            "validation",
            f"wait is over {settings.long_poll_max_seconds:g} s (JOBTIER_LONG_POLL_MAX_SECONDS)",
            field="wait",
        )
    queue: Queue = request.state.queue
    not_encrypted(queue, body.queues, "queues")
    claims: WorkerClaims = request.state.worker_claims
    worker = _redis_id(body.worker)
    await advertise(request, claims, worker, body)
    lease_ms = int(settings.lease_seconds * 1000)
    try:
        got, limited = await claims.claim(
            worker, body.types, body.queues, body.count, lease_ms, body.wait,
            request.is_disconnected,
        )  # fmt: skip
    except QueuesLimited as exc:
        names = ", ".join(exc.queues)
        raise Problem(
            409,
            "queue-limited",
            f"every queue asked is limited ({names}: a concurrency or rate limit, whose "
            "permits only Python workers take): no HTTP worker gets their jobs",
            field="queues",
            queues=exc.queues,
        ) from None
    jobs = [_job(c) for c in got if not is_sealed(c.job.payload)]
    if len(jobs) < len(got):
        await _refuse_sealed(queue, worker, [c for c in got if is_sealed(c.job.payload)])
    return encoded(ClaimResponse(jobs, settings.lease_seconds, limited))


def _job(c: Claimed) -> WorkerJob:
    j = c.job
    payload = msgspec.Raw(j.payload or b"null")
    deps = list(from_inputs(j.inputs).values()) if j.inputs else None
    return WorkerJob(
        j.id, j.type, j.queue, payload, j.attempt, j.max_attempts, j.lease_version,
        j.trace, j.compensates, deps, j.timeout,
    )  # fmt: skip


async def _refuse_sealed(queue: Queue, worker: str, sealed: list[Claimed]) -> None:
    """An encrypted payload is opened by Python workers only (docs/encryption.md): the job
    fails for good, saying so, rather than reaching a worker that cannot read it."""
    error = encode_json(
        {
            "type": "jobtier.EncryptedPayload",
            "message": "an HTTP worker cannot run an encrypted job: run its task on a Python worker",
        }
    )
    retention = queue.settings.dead_retention_seconds
    await queue.scripts.call_many(
        [fail_call(c.shard, worker, retention, [(c.job.id, c.job.lease_version, error, -1)])
         for c in sealed]
    )  # fmt: skip


async def _beat(request: Request, body: HeartbeatRequest | ProgressRequest) -> Response:
    job_id = job_id_of(request)
    queue: Queue = request.state.queue
    s = queue.settings
    progress = b"" if body.progress is None else encode_json(body.progress)
    if len(progress) > s.max_payload_bytes:
        detail = f"progress is over {s.max_payload_bytes} bytes (JOBTIER_MAX_PAYLOAD_BYTES)"
        raise Problem(413, "payload-too-large", detail, field="progress")
    shard = queue.keys.shard_of(job_id)
    history_ms = int(s.progress_history_seconds * 1000)
    item = (job_id, body.lease_version, progress)
    call = heartbeat_call(
        shard, _redis_id(body.worker), int(s.lease_seconds * 1000), [item], history_ms
    )
    ((code, cancel),) = parse_pairs(await _one(queue, call))
    if code is not Code.OK:
        raise await refused_now(queue, job_id, code)
    await still_live(request, _redis_id(body.worker))
    return encoded(HeartbeatResponse(bool(cancel), s.lease_seconds))


async def heartbeat(request: Request) -> Response:
    return await _beat(request, await _body(request, HeartbeatRequest))


async def progress(request: Request) -> Response:
    return await _beat(request, await _body(request, ProgressRequest))


async def logs(request: Request) -> Response:
    """Log lines, written only while the lease is the worker's: the lease is checked (and
    extended) first, so a stale worker's lines are refused like its other answers."""
    body: LogRequest = await _body(request, LogRequest)
    job_id = job_id_of(request)
    queue: Queue = request.state.queue
    s = queue.settings
    shard = queue.keys.shard_of(job_id)
    call = heartbeat_call(
        shard,
        _redis_id(body.worker),
        int(s.lease_seconds * 1000),
        [(job_id, body.lease_version, b"")],
    )
    ((code, _),) = parse_pairs(await _one(queue, call))
    if code is not Code.OK:
        raise await refused_now(queue, job_id, code)
    if (attempt := await attempt_now(queue, job_id)) is None:
        raise job_not_found(job_id)  # gone since the lease was checked
    if attempt != body.attempt:
        # the lease is this worker's: the attempt it holds is the job's, and lines of another
        # one would read as that attempt's in the job's logs
        detail = f"attempt {body.attempt} is not the job's: it is at attempt {attempt}"
        raise Problem(422, "validation", detail, field="attempt", attempt=attempt)
    # as ctx.log stamps a Python task's lines
    at = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    lines = [
        msgspec.json.encode(LogLine(at, body.attempt, _cut(text, LOG_LINE_CHARS)))
        for text in body.lines
    ]
    # a running job's lines live as long as the job could (a failure keeps it longer)
    ttl = max(s.retention_seconds, s.dead_retention_seconds)
    await _one(queue, joblog_call(shard, LOG_LINES, [(job_id, ttl, lines)]))
    return encoded(LogResponse(len(lines)))


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


async def complete(request: Request) -> Response:
    body: CompleteRequest = await _body(request, CompleteRequest)
    job_id = job_id_of(request)
    queue: Queue = request.state.queue
    s = queue.settings
    result = b"" if body.result is None else encode_json(body.result)
    if len(result) > s.max_result_bytes:
        detail = f"result is over {s.max_result_bytes} bytes (JOBTIER_MAX_RESULT_BYTES)"
        raise Problem(413, "payload-too-large", detail, field="result")
    shard = queue.keys.shard_of(job_id)
    item = (job_id, body.lease_version, result)
    (code,) = await _one(
        queue, complete_call(shard, _redis_id(body.worker), s.retention_seconds, [item])
    )
    if code != Code.OK:
        raise await refused_now(queue, job_id, Code(code))
    return encoded(Outcome(job_id, "succeeded"))


async def complete_many(request: Request) -> Response:
    """Several jobs succeeded: one request, one pipelined script call per shard, one answer
    per item, as the one-job route would give it (an id of no shard of ours: 404; an id
    twice: the second is refused, 409, the job no longer running). A result over the limit
    refuses the whole batch (413 naming it) before anything is sent."""
    body: CompleteManyRequest = await _body(request, CompleteManyRequest)
    queue: Queue = request.state.queue
    s = queue.settings
    answers: list[ItemOutcome | None] = [None] * len(body.jobs)
    by_shard: dict[int, list[tuple[int, tuple[str, int, bytes]]]] = {}
    for i, item in enumerate(body.jobs):
        result = b"" if item.result is None else encode_json(item.result)
        if len(result) > s.max_result_bytes:
            where = f"jobs[{i}].result"
            detail = f"{where} is over {s.max_result_bytes} bytes (JOBTIER_MAX_RESULT_BYTES)"
            raise Problem(413, "payload-too-large", detail, field=where)
        if not queue.keys.valid_id(item.id):
            answers[i] = item_refused(item.id, Code.NOT_FOUND)
            continue
        by_shard.setdefault(queue.keys.shard_of(item.id), []).append(
            (i, (item.id, item.lease_version, result))
        )
    worker = _redis_id(body.worker)
    calls = [
        complete_call(shard, worker, s.retention_seconds, [it for _, it in items])
        for shard, items in by_shard.items()
    ]
    replies = await queue.scripts.call_many(calls)
    stale: list[tuple[int, tuple[str, Code]]] = []
    for items, reply in zip(by_shard.values(), replies, strict=True):
        for (i, (job_id, _, _)), code in zip(items, reply, strict=True):
            if code == Code.OK:
                answers[i] = ItemOutcome(job_id, 200, "succeeded")
            else:
                stale.append((i, (job_id, Code(code))))
    if stale:
        for (i, _), answer in zip(
            stale, await items_refused_now(queue, [it for _, it in stale]), strict=True
        ):
            answers[i] = answer
    return encoded(CompleteManyResponse([a for a in answers if a is not None]))


async def fail(request: Request) -> Response:
    body: FailRequest = await _body(request, FailRequest)
    job_id = job_id_of(request)
    queue: Queue = request.state.queue
    s = queue.settings
    e = body.error
    error: dict[str, Any] = {"type": e.type, "message": _cut(e.message, ERROR_CHARS)}
    if e.traceback:
        error["traceback"] = _tail(e.traceback, TRACEBACK_CHARS)
    check_fail(body, s.max_future_seconds)
    delay_ms = -1
    if body.retryable:
        delay = body.retry_in if body.retry_in is not None else await _backoff(request, job_id)
        delay_ms = round(delay * 1000)
    shard = queue.keys.shard_of(job_id)
    item = (job_id, body.lease_version, encode_json(error), delay_ms, int(body.held))
    call = fail_call(shard, _redis_id(body.worker), s.dead_retention_seconds, [item])
    ((code, state),) = parse_pairs(await _one(queue, call))
    refusal = None if code is Code.OK else await refused_now(queue, job_id, code)
    if body.block_queue and body.retry_in is not None and held_by(refusal, body.worker):
        await hold_queue(queue, job_id, body.retry_in, body.worker)
    if refusal is not None:
        raise refusal
    return encoded(Outcome(job_id, state.decode()))


def _tail(text: str, limit: int) -> str:
    """The last ``limit`` characters of a traceback (its innermost frames), cut at a line."""
    if len(text) <= limit:
        return text
    tail = text[-(limit - 2) :]
    newline = tail.find("\n")
    if 0 <= newline < len(tail) - 1:
        tail = tail[newline + 1 :]
    return "…\n" + tail


async def _backoff(request: Request, job_id: str) -> float:
    """The retry delay of the job's task as its workers advertise it (``DEFAULT_BACKOFF`` for
    a task nobody advertises), for the attempt that failed; fail.lua decides whether one
    remains."""
    queue: Queue = request.state.queue
    try:
        doc = orjson.loads(await queue.jobs.status_doc(job_id))
    except JobNotFound:
        raise Problem(404, "not-found", f"job {job_id} is not kept in Redis") from None
    ads = {ad.type: ad for ad in request.state.catalog.ads()}
    ad = ads.get(doc.get("type"))
    b = ad.backoff if ad is not None else DEFAULT_BACKOFF
    # jitter spreads the retries of jobs that failed together, as a Python worker's do
    attempt = int(doc.get("attempt") or 1)
    return retry_delay(b, attempt, queue.settings.max_future_seconds, random.random())


async def stopped(request: Request) -> Response:
    body: LeaseRequest = await _body(request, LeaseRequest)
    job_id = job_id_of(request)
    queue: Queue = request.state.queue
    shard = queue.keys.shard_of(job_id)
    item = (job_id, body.lease_version)
    call = stopped_call(shard, _redis_id(body.worker), queue.settings.retention_seconds, [item])
    ((code, state),) = parse_pairs(await _one(queue, call))
    if code is not Code.OK:
        raise await refused_now(queue, job_id, code)
    return encoded(Outcome(job_id, state.decode()))


async def tasks(request: Request) -> Response:
    """Advertise the worker's tasks in the catalogue, as a Python worker does at each full
    heartbeat: the API then checks submits of them (queue, attempts, payload schema)."""
    body: TasksRequest = await _body(request, TasksRequest)
    worker = _redis_id(body.worker)
    now = time.time()
    ads = []
    seen: dict[str, int] = {}
    for i, t in enumerate(body.tasks):
        if (first := seen.setdefault(t.type, i)) != i:
            where = f"tasks[{i}].type"
            detail = f"{where}: {t.type!r} is advertised twice (tasks[{first}] too)"
            raise Problem(422, "validation", detail, field=where)
        if t.payload_schema is not None and (why := schema_problem(t.payload_schema)):
            where = f"tasks[{i}].payload_schema"
            detail = f"{where} is refused, {why}"
            raise Problem(422, "validation", detail, field=where)
        b = t.backoff or RetryBackoff()
        ads.append(
            TaskAd(
                type=t.type, queue=t.queue, max_attempts=t.max_attempts,
                backoff=Backoff(b.base, b.factor, b.cap, b.jitter), timeout=t.timeout,
                payload_schema=t.payload_schema, seen_at=now, worker=worker,
            )
        )  # fmt: skip
    queue: Queue = request.state.queue
    ads = await guarded(queue, ads)
    await publish(queue.redis, queue.keys, ads)
    await request.state.catalog.load()  # this API knows them at once
    return encoded(TasksResponse(ads))


async def leave(request: Request) -> Response:
    body: LeaveRequest = await _body(request, LeaveRequest)
    listed = await forget(request, _redis_id(body.worker))
    return encoded(LeaveResponse(body.worker, listed))


# --- the document -----------------------------------------------------------------------------
_LOST = oa.refuses(
    409,
    "the lease is not this worker's any more (it expired and the job was claimed again, or "
    "the job finished): nothing changed; job_id",
)
_GONE = oa.refuses(404, "an unknown or malformed job id, or a job Redis no longer keeps")


def operations(settings: Settings) -> oa.Paths:
    """The worker routes, under the ``worker`` tag."""
    paths = oa.Paths(settings, auth="worker")

    def add(route: str, *args: Any, **options: Any) -> None:
        op = paths.add(route, *args, **options)
        op["tags"] = ["worker"]

    s = settings
    add(
        "POST /v1/worker/claim",
        claim,
        f"Claim up to count jobs of the named types and queues: a long poll answered as soon "
        f"as one is claimed, or with none after wait seconds (at most "
        f"{s.long_poll_max_seconds:g}, JOBTIER_LONG_POLL_MAX_SECONDS)",
        oa.returns(200, "ClaimResponse", "the jobs claimed (maybe none), and their lease"),
        oa.refuses(
            409,
            "every queue asked has a concurrency or rate limit, whose permits only Python "
            "workers take (queue-limited; queues)",
        ),
        body="ClaimRequest",
    )
    add(
        "PUT /v1/worker/tasks",
        tasks,
        "Advertise the worker's tasks (queue, attempts, backoff, payload schema) in the task "
        "catalogue; again every few minutes, as an advert counts for JOBTIER_TASK_CATALOG_TTL",
        oa.returns(200, "TasksResponse", "the catalogue entries written"),
        oa.refuses(409, "a task a live Python worker advertises: nothing written"),
        body="TasksRequest",
    )
    add(
        "POST /v1/worker/jobs/{job_id}/heartbeat",
        heartbeat,
        f"Extend the job's lease by {s.lease_seconds:g} s (JOBTIER_LEASE_SECONDS; send one every "
        "third of it), with its progress if it changed; the answer says if a cancel was asked",
        oa.returns(200, "HeartbeatResponse", "extended; cancel_requested: stop and say stopped"),
        _GONE,
        _LOST,
        body="HeartbeatRequest",
    )
    add(
        "POST /v1/worker/jobs/{job_id}/progress",
        progress,
        "Report the job's progress (any JSON value); extends its lease too",
        oa.returns(200, "HeartbeatResponse", "recorded; cancel_requested as for a heartbeat"),
        _GONE,
        _LOST,
        body="ProgressRequest",
    )
    add(
        "POST /v1/worker/jobs/{job_id}/logs",
        logs,
        f"Add lines to the job's log (GET /v1/jobs/{{job_id}}/logs): the job keeps its latest "
        f"{LOG_LINES}, each cut at {LOG_LINE_CHARS} characters",
        oa.returns(200, "LogResponse", "written"),
        _GONE,
        _LOST,
        body="LogRequest",
    )
    add(
        "POST /v1/worker/jobs/{job_id}/complete",
        complete,
        "The job succeeded, with its result (any JSON value)",
        oa.returns(200, "Outcome", "succeeded"),
        _GONE,
        _LOST,
        (
            413,
            oa.too_large(s, f"a result over {s.max_result_bytes} bytes (JOBTIER_MAX_RESULT_BYTES)"),
        ),
        body="CompleteRequest",
    )
    add(
        "POST /v1/worker/complete",
        complete_many,
        f"Several jobs succeeded (up to {MAX_CLAIM}), each with its lease and result: one "
        "answer per job, in order, each as the one-job route's (200, 409, 404)",
        oa.returns(200, "CompleteManyResponse", "each job's outcome"),
        (
            413,
            oa.too_large(s, f"a result over {s.max_result_bytes} bytes (JOBTIER_MAX_RESULT_BYTES)"),
        ),
        body="CompleteManyRequest",
    )
    add(
        "POST /v1/worker/jobs/{job_id}/fail",
        fail,
        "The attempt failed: retried after retry_in seconds (else the task's backoff) while "
        "attempts remain and it is retryable, else dead-lettered; the error keeps its traceback. "
        "held: the worker gave the attempt back without running the task (a rate limit or "
        "breaker of its own): retried after retry_in, the attempt not counted; with "
        "block_queue, the job's queue also starts no job for retry_in seconds, on every worker",
        oa.returns(200, "Outcome", "scheduled (to retry), failed, or cancelled (one was asked)"),
        _GONE,
        _LOST,
        body="FailRequest",
    )
    add(
        "POST /v1/worker/leave",
        leave,
        "The worker stops: no longer listed as live (the console, explain, queue scaling), at "
        "once rather than a minute after its last claim; its running jobs are not touched",
        oa.returns(200, "LeaveResponse", "listed: whether it was listed until now"),
        body="LeaveRequest",
    )
    add(
        "POST /v1/worker/jobs/{job_id}/stopped",
        stopped,
        "The worker gives the job up without a result: cancelled if a cancel was asked, else "
        "back to the front of its queue (a shutdown; the attempt does not count)",
        oa.returns(200, "Outcome", "cancelled or queued"),
        _GONE,
        _LOST,
        body="LeaseRequest",
    )
    return paths
