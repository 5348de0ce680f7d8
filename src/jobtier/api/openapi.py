"""The OpenAPI document of the API, served at ``/v1/openapi.json``, and the core routes:
each declared once, its endpoint with its description (``spec.Paths.add``), so the app serves
what the document describes and nothing else.

Built from what the server checks with, so the two cannot drift:

* request and response bodies from the msgspec Structs the server decodes and encodes with,
  their extra rules (patterns, ranges) from the same constants the validation uses;
* query parameters from the routes' ``Param`` declarations (api/params.py);
* limits that are settings (payload, request body, batch size, long-poll) from ``Settings``;
* the error answers by what an operation does (``operation()``): every operation can be
  refused for its URL or headers (414/431) and, if it needs a key, with 401 (403 on admin
  routes); one with query parameters with 400; one with a body with 400/413/415/422; one
  that reads Redis or Postgres with 503.

The fuzzer (tests/e2e/test_api_fuzz.py) checks the server's answers against this document.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from jobtier.api import (
    admin,
    batch_routes,
    breakers,
    checkpoints,
    console,
    debugging,
    flows,
    health,
    jobs,
    ops,
    queues,
    scaling,
    sse,
    why,
    worker_bodies,
    worker_routes,
)
from jobtier.api import (
    durable_submit as durable,
)
from jobtier.api import spec as oa
from jobtier.api.admin import DEAD_LETTER_PARAMS, REPLAY_MAX, ReplayFilter
from jobtier.api.debugging import DeadLetter
from jobtier.api.flows import DependencyList
from jobtier.api.jobs import STATUS_PARAMS, BatchBody, PriorityBody, constrain_expiry
from jobtier.config import Settings
from jobtier.core.explanation import Explanation
from jobtier.core.model import (
    LOG_LINE_CHARS,
    LOG_LINES,
    FlowSpec,
    JobLogs,
    JobSpec,
    JobStatus,
    QueueLimits,
    QueueScaling,
)
from jobtier.core.names import (
    IDEMPOTENCY_KEY_RE,
    JOB_ID_RE,
    QUEUE_NAME_RE,
    REF_RE,
    TASK_NAME_RE,
    TENANT_RE,
)
from jobtier.engine.validate import MAX_ATTEMPTS_LIMIT, MAX_CONCURRENCY_LIMIT
from jobtier.webhooks.callbacks import EVENTS
from jobtier.webhooks.safety import MAX_URL_LENGTH as MAX_URL_LENGTH_CALLBACK

# the Structs the core routes decode and encode with (what they refuse, unknown members, is
# stated too)
_CORE_TYPES = (
    JobSpec,
    JobStatus,
    oa.Problem,
    BatchBody,
    PriorityBody,
    oa.BatchResponse,
    oa.ResultResponse,
    oa.DeadLetters,
    ReplayFilter,
    oa.Replayed,
    oa.Health,
    oa.Readiness,
    oa.QueueList,
    oa.QueuePaused,
    oa.QueueUnblocked,
    QueueLimits,
    oa.QueueLimitsSet,
    QueueScaling,
    oa.TaskList,
    FlowSpec,
    oa.FlowResponse,
    DependencyList,
    JobLogs,
    DeadLetter,
    Explanation,
)


def _flow_constraints(c: dict[str, Any], settings: Settings) -> None:
    """A flow's job is a job (the rules of ``JobSpec``) with a ref and its ``after``; a job of
    either kind may name existing jobs it waits for (``depends_on``)."""
    spec = "FlowJob"
    for name, rule in c["JobSpec"]["properties"].items():
        if name in c[spec]["properties"] and name != "depends_on":
            c[spec]["properties"][name] = rule
    oa.constrain(c, spec, "ref", pattern=REF_RE.pattern)
    oa.constrain(c, spec, "after", maxItems=settings.max_flow_jobs)
    oa.constrain_items(c, spec, "after", pattern=REF_RE.pattern)
    c[spec]["properties"]["after"]["description"] = (
        "refs of the jobs of this flow it waits for (its children); a ref no job has, or a "
        "cycle, is refused (422)"
    )
    for struct in ("JobSpec", spec):
        oa.constrain(c, struct, "depends_on", maxItems=settings.max_flow_jobs)
        oa.constrain_items(c, struct, "depends_on", pattern=JOB_ID_RE.pattern)
        c[struct]["properties"]["depends_on"]["description"] = (
            "ids of existing jobs (of yours, still kept by Redis: else 422) it waits for, "
            f"at most {settings.max_flow_jobs} (JOBTIER_MAX_FLOW_JOBS)"
        )
    c["FlowSpec"]["properties"]["jobs"].update(minItems=1, maxItems=settings.max_flow_jobs)
    oa.constrain(c, "FlowSpec", "idempotency_key", pattern=IDEMPOTENCY_KEY_RE.pattern)


def _components(settings: Settings, extra_types: Sequence[type]) -> dict[str, Any]:
    _, components = msgspec.json.schema_components(
        [
            *_CORE_TYPES,
            *console.OPENAPI_TYPES,
            *checkpoints.OPENAPI_TYPES,
            *breakers.OPENAPI_TYPES,
            *batch_routes.OPENAPI_TYPES,
            *worker_bodies.OPENAPI_TYPES,
            *extra_types,
        ],
        ref_template="#/components/schemas/{name}",
    )
    c = components
    oa.constrain(c, "JobSpec", "type", pattern=TASK_NAME_RE.pattern)
    oa.constrain(c, "JobSpec", "max_attempts", minimum=1, maximum=MAX_ATTEMPTS_LIMIT)
    oa.constrain(c, "JobSpec", "delay", minimum=0, maximum=settings.max_future_seconds)
    oa.constrain(c, "JobSpec", "run_at", format="date-time")
    oa.constrain(c, "JobSpec", "idempotency_key", pattern=IDEMPOTENCY_KEY_RE.pattern)
    c["JobSpec"]["properties"]["payload"]["description"] = (
        f"any JSON value, at most {settings.max_payload_bytes} bytes encoded "
        "(JOBTIER_MAX_PAYLOAD_BYTES; over it: 413)"
    )
    c["JobSpec"]["properties"]["run_at"]["description"] = (
        f"when to run (with a time zone); from {settings.past_tolerance_seconds:g} s ago "
        f"to {settings.max_future_seconds} s ahead (JOBTIER_MAX_FUTURE_SECONDS); "
        "not with delay"
    )
    c["JobSpec"]["properties"]["delay"]["description"] = (
        f"seconds from now until the job is due (a number: 1.5 is 1.5 s), at most "
        f"{settings.max_future_seconds} (JOBTIER_MAX_FUTURE_SECONDS); not with run_at"
    )
    c["BatchBody"]["properties"]["jobs"].update(minItems=1, maxItems=settings.max_batch)
    c["ReplayFilter"]["properties"]["all"]["description"] = (
        "true: every dead letter (up to limit); a replay with none of type, since, queue and "
        "tenant must say so (else 422, field all)"
    )
    oa.constrain(c, "ReplayFilter", "type", pattern=TASK_NAME_RE.pattern)
    oa.constrain(c, "ReplayFilter", "queue", pattern=QUEUE_NAME_RE.pattern)
    oa.constrain(c, "ReplayFilter", "tenant", pattern=TENANT_RE.pattern)
    oa.constrain(c, "ReplayFilter", "limit", minimum=1, maximum=REPLAY_MAX)
    oa.constrain(c, "ReplayFilter", "since", format="date-time")
    c["ReplayFilter"]["properties"]["since"]["description"] = (
        "only jobs dead-lettered at or after this RFC 3339 date-time (without an offset: UTC)"
    )
    oa.constrain(c, "JobSpec", "queue", pattern=QUEUE_NAME_RE.pattern)
    oa.constrain(c, "JobSpec", "concurrency_key", pattern=IDEMPOTENCY_KEY_RE.pattern)
    oa.constrain(c, "JobSpec", "concurrency_limit", minimum=1, maximum=MAX_CONCURRENCY_LIMIT)
    c["JobSpec"]["properties"]["concurrency_limit"]["description"] = _CONCURRENCY_LIMIT
    _flow_constraints(c, settings)
    constrain_expiry(c, settings)
    for struct in ("Debounce", "Throttle", "Unique"):  # docs/debounce-throttle.md
        oa.constrain(c, struct, "key", pattern=IDEMPOTENCY_KEY_RE.pattern)
    oa.constrain(c, "Debounce", "seconds", maximum=settings.max_future_seconds)
    oa.constrain(c, "Debounce", "max_wait", maximum=settings.max_future_seconds)
    oa.constrain(c, "Throttle", "period", maximum=settings.max_future_seconds)
    oa.constrain(c, "Throttle", "limit", maximum=MAX_CONCURRENCY_LIMIT)
    for name in ("debounce", "throttle"):
        c["JobSpec"]["properties"][name]["description"] = (
            "not with the others (debounce, throttle, unique), concurrency_key, run_at, delay "
            "or depends_on, nor in a batch; debounce not with idempotency_key nor for an "
            "encrypted payload, max_wait not below seconds (else 422 naming it; "
            "docs/debounce-throttle.md)"
        )
    c["JobSpec"]["properties"]["unique"]["description"] = (
        "at most one job of the key at a time: while the key's job has not finished (until "
        "'finished') or not started ('started'), a submit makes none and answers that job "
        "(200); not with debounce, throttle, idempotency_key, concurrency_key or depends_on, "
        "nor in a batch (else 422 naming it; docs/debounce-throttle.md)"
    )
    batch_routes.constrain(c, settings)
    oa.constrain(c, "QueueLimits", "concurrency", minimum=1, maximum=1_000_000)
    oa.constrain(c, "QueueLimits", "rate", minimum=1, maximum=1_000_000)
    c["QueueLimits"]["properties"]["per"].update(minimum=0.001, maximum=86_400)
    oa.constrain(
        c, "CallbackSpec", "url", maxLength=MAX_URL_LENGTH_CALLBACK, pattern=oa.CALLBACK_URL
    )
    c["CallbackSpec"]["properties"]["events"]["enum"] = list(EVENTS)
    worker_bodies.constrain(c, settings)
    return components


_LOCATION = {"Location": oa.header("the job's URL", required=True)}
_ETAG = {"ETag": oa.header("the version, quoted", required=True, pattern='^"[0-9]+"$')}
_LAST_EVENT_ID = {
    "name": "Last-Event-ID",
    "in": "header",
    "description": "the version the client has (ASCII digits; anything else is ignored)",
    "schema": {"type": "string"},
}
_KEY_DIFFERS = oa.refuses(
    400,
    "malformed JSON, or the Idempotency-Key header and the body's idempotency_key differ, or "
    + durable.REFUSED_400,
)
_RATE_LIMITED = oa.refuses(429, "the tenant's rate limit or waiting-jobs cap", oa.RETRY_AFTER)
_BACK_PRESSURE = oa.refuses(
    503,
    "back-pressure (too many waiting jobs, write-behind lag; a job of a shed priority past "
    "JOBTIER_SHED_WAITING_TOTAL: type …:shed), Redis unavailable, or a job "
    "to encrypt and no JOBTIER_ENCRYPTION_KEYS here (type …:encryption-keys-missing; nothing "
    "is submitted), or " + durable.UNCONFIRMED_503,
    oa.RETRY_AFTER,
)
_ANY_OBJECT = {"type": "object"}
_CONCURRENCY_LIMIT = "at most this many of the key's jobs at once (default 1); only with a key"


def _job_paths(s: Settings) -> oa.Paths:
    paths = oa.Paths(s)
    payload_413 = (413, oa.too_large(s, oa.payload_too_large(s)))
    paths.add(
        "POST /v1/jobs",
        jobs.submit,
        "Submit a job",
        oa.returns(202, "JobStatus", "created", _LOCATION),
        oa.returns(
            200,
            "JobStatus",
            "a duplicate of an earlier submit with the same idempotency key, a debounced "
            "submit that the key's pending job took, or a unique key's job that has not "
            "finished (its id; docs/debounce-throttle.md)",
            _LOCATION,
        ),
        _KEY_DIFFERS,
        oa.refuses(
            409,
            "the idempotency key was used for a different request (job_id), or a callback was "
            "given and the tenant has no webhook signing secret",
        ),
        oa.refuses(410, "the idempotency key names a job that is no longer kept (job_id)"),
        payload_413,
        oa.refuses(
            429,
            "the tenant's rate limit or waiting-jobs cap, or the job's throttle key is full "
            "(throttle.on_limit refuse: type …:throttled)",
            oa.RETRY_AFTER,
        ),
        _BACK_PRESSURE,
        body="JobSpec",
        headers=[oa.IDEMPOTENCY_KEY, durable.PARAMETER],
    )
    batch_413 = oa.too_large(
        s, oa.payload_too_large(s), f"more than {s.max_batch} jobs (JOBTIER_MAX_BATCH)"
    )
    paths.add(
        "POST /v1/jobs/batch",
        jobs.submit_batch,
        f"Submit up to {s.max_batch} jobs (JOBTIER_MAX_BATCH); one outcome each",
        oa.returns(200, "BatchResponse", "one result per job, in order"),
        oa.refuses(
            409,
            "a job has a callback and the tenant has no webhook signing secret (nothing was "
            "submitted)",
        ),
        oa.refuses(400, "malformed JSON, or " + durable.REFUSED_400),
        (413, batch_413),
        _RATE_LIMITED,
        _BACK_PRESSURE,
        body="BatchBody",
        headers=[durable.PARAMETER],
    )
    paths.add(
        "POST /v1/flows",
        flows.submit_flow,
        f"Submit a flow: up to {s.max_flow_jobs} jobs (JOBTIER_MAX_FLOW_JOBS), each running once "
        "the jobs it waits for have succeeded",
        oa.returns(202, "FlowResponse", "created: each job's status, in the order of the request"),
        oa.returns(
            200,
            "FlowResponse",
            "a repeat of an earlier submit with the same idempotency key: its jobs as they are now",
        ),
        _KEY_DIFFERS,
        oa.refuses(
            409,
            "the idempotency key was used for a different flow (job_id), or a job has a callback "
            "and the tenant has no webhook signing secret (nothing was submitted)",
        ),
        oa.refuses(
            410, "the idempotency key names a flow a job of which is no longer kept (job_id)"
        ),
        payload_413,
        oa.refuses(
            422,
            "the body does not fit its schema, or a rule it cannot state: a cycle, an after "
            "naming no ref of the flow, a ref used twice, a depends_on naming no job of yours "
            "that Redis keeps, a run_at in the past, a callback URL refused by the address "
            "policy, …; field names the member (jobs[i].after, jobs[i].callback.url); nothing "
            "is submitted",
        ),
        _RATE_LIMITED,
        _BACK_PRESSURE,
        body="FlowSpec",
        headers=[oa.IDEMPOTENCY_KEY, durable.PARAMETER],
    )
    add = paths.add
    add(
        "GET /v1/jobs/{job_id}/dependencies",
        flows.dependencies,
        "The jobs this one waits for, in order: pending, or their outcome (result or error)",
        oa.returns(200, "DependencyList", "the dependencies (empty for a job without any)"),
        oa.JOB_404,
        *oa.SEALED,
    )
    add(
        "GET /v1/jobs/{job_id}",
        jobs.get_job,
        "The job's status document",
        oa.returns(200, "JobStatus", "the status", _ETAG),
        (304, {"description": "not changed since the version in If-None-Match", "headers": _ETAG}),
        oa.JOB_404,
        params=STATUS_PARAMS,
        headers=[{"name": "If-None-Match", "in": "header", "schema": {"type": "string"}}],
    )
    add(
        "GET /v1/jobs/{job_id}/explain",
        why.explain,
        "Why the job has not started: its queue paused, at its concurrency or rate limit, its "
        "concurrency key held (by which jobs), its dependencies (their states), its run_at, no "
        "live worker for its queue or type, other tenants' turns, its place in line; a job "
        "running or finished says it is not waiting",
        oa.returns(200, "Explanation", "the reasons, each in words and numbers"),
        oa.JOB_404,
    )
    add(
        "GET /v1/jobs/{job_id}/result",
        jobs.get_result,
        "The job's result (null until it succeeds; a result kept outside Redis is null here and "
        "result_url says where it streams from)",
        oa.returns(200, "ResultResponse", "state, result (or result_url) and error"),
        oa.JOB_404,
        *oa.SEALED,
    )
    add(
        "POST /v1/jobs/{job_id}/cancel",
        jobs.cancel,
        "Cancel a waiting job, or ask the worker running it to stop",
        oa.returns(200, "JobStatus", "cancelled, or running with cancel_requested"),
        oa.JOB_404,
        oa.refuses(
            409,
            "the job has already finished (wrong-state; job: its status); a job still in the "
            "outbox, submitted with SQL and not yet relayed, is cancelled there (200)",
        ),
    )
    add(
        "GET /v1/jobs/{job_id}/logs",
        debugging.job_logs,
        f"The lines the job's task logged (ctx.log), oldest first: the latest {LOG_LINES}, each "
        f"at most {LOG_LINE_CHARS} characters, while Redis holds the job",
        oa.returns(200, "JobLogs", "the lines (empty once the job left Redis)"),
        oa.JOB_404,
    )
    add(
        "POST /v1/jobs/{job_id}/retry",
        debugging.retry,
        "Retry a failed (dead-lettered) job: back to its queue, attempts reset",
        oa.returns(200, "JobStatus", "queued again"),
        oa.JOB_404,
        oa.refuses(
            409,
            "the job has not failed (wrong-state; job: its status), its unique key is another "
            "job's (unique-held; holder: that job's id), or it is still in the outbox "
            "(not-relayed-yet)",
        ),
    )
    events = oa.event_stream(
        "event: status, id: the version, data: the status document", "status", oa.ref("JobStatus")
    )
    add(
        "GET /v1/jobs/{job_id}/events",
        sse.events,
        "Server-Sent Events: the status, then every change until a terminal state",
        (200, events),
        (204, {"description": "Last-Event-ID is the final status: nothing more will come"}),
        oa.JOB_404,
        headers=[_LAST_EVENT_ID],
    )
    return paths


def _admin_paths(settings: Settings) -> oa.Paths:
    paths = oa.Paths(settings, auth="admin")
    add = paths.add
    add(
        "GET /v1/admin/dead-letters",
        admin.dead_letters,
        "Dead-lettered jobs, newest first",
        oa.returns(200, "DeadLetters", "the jobs"),
        params=DEAD_LETTER_PARAMS,
    )
    add(
        "GET /v1/admin/dead-letters/{job_id}",
        debugging.dead_letter,
        "One dead-lettered job in full: its status (error and traceback), payload and log lines",
        oa.returns(200, "DeadLetter", "the dead letter"),
        oa.refuses(404, "not in the dead-letter set (or expired from Redis, or a malformed id)"),
    )
    add(
        "POST /v1/admin/dead-letters/{job_id}/replay",
        admin.replay_one,
        "Send a dead-lettered job back to its queue, attempts reset",
        oa.returns(200, "JobStatus", "queued again"),
        oa.unknown("job", tenants=False),
        oa.refuses(409, "not dead-lettered; its unique key another job's (unique-held, holder)"),
    )
    add(
        "POST /v1/admin/dead-letters/replay",
        admin.replay_many,
        "Replay dead-lettered jobs matching a filter, newest first, up to limit (100); no "
        'filter: only with "all": true',
        oa.returns(200, "Replayed", "the ids replayed"),
        oa.refuses(422, 'no filter and no "all": true, a limit out of range, or a bad name'),
        body="ReplayFilter",
        body_required=False,
    )
    add(
        "GET /v1/admin/stats",
        admin.stats,
        "Queue depth per shard and priority, waiting per tenant, workers, status-tier counters",
        (200, oa.content("statistics", "application/json", _ANY_OBJECT)),
    )
    add(
        "GET /v1/admin/queues",
        queues.list_queues,
        "Every queue: ready jobs by priority, parked, running, paused, limits, oldest age, "
        "workers, tasks",
        oa.returns(200, "QueueList", "the queues"),
    )
    add(
        "GET /v1/admin/queues/{name}/scaling",
        scaling.scaling,
        "The workers the queue's pool wants now, from its ready and running jobs, its oldest "
        "job's wait and the slots a worker has, with the inputs (docs/kubernetes.md: the "
        "formula); what KEDA's metrics-api scaler reads",
        oa.returns(200, "QueueScaling", "the desired worker count and its inputs"),
        oa.refuses(404, "no job, limit or task has named the queue"),
        oa.refuses(422, "a queue name that breaks its pattern, or min above max (field)"),
        params=scaling.SCALING_PARAMS,
    )
    add(
        "GET /v1/admin/tasks",
        queues.tasks,
        "The task catalogue: every task a live or recently seen worker runs, its queue, policies "
        "and payload schema",
        oa.returns(200, "TaskList", "the tasks"),
    )
    return paths


def _ops_paths(s: Settings) -> oa.Paths:
    paths = oa.Paths(s)
    add = paths.add
    static = {"auth": "none", "backend": False}
    add("GET /healthz", health.healthz, "Liveness", oa.returns(200, "Health", "alive"), **static)
    add(
        "GET /readyz",
        health.readyz,
        "Readiness: Redis reachable, Postgres's migrations applied (Postgres away: degraded)",
        oa.returns(200, "Readiness", "ready"),
        oa.returns(503, "Readiness", "not ready: checks says what is wrong"),
        **static,
    )
    add(
        "GET /metrics",
        ops.metrics,
        "Prometheus metrics of every live jobtier process, and queue gauges (admin key unless "
        "JOBTIER_METRICS_PUBLIC)",
        (200, oa.content("Prometheus text format", "text/plain", {"type": "string"})),
        auth="none" if s.metrics_public else "admin",
    )
    add(
        "GET /dashboard",
        ops.dashboard,
        "The live dashboard page (asks for the admin key)",
        (200, oa.content("HTML", "text/html", {"type": "string"})),
        **static,
    )
    frames = oa.event_stream("event: frame, data: the dashboard's figures", "frame", _ANY_OBJECT)
    add(
        "GET /v1/admin/dashboard/stream",
        ops.dashboard_stream,
        "Server-Sent Events: a dashboard frame a second",
        (200, frames),
        auth="admin",
    )
    openapi = oa.content("OpenAPI 3.1", "application/json", _ANY_OBJECT)
    add("GET /v1/openapi.json", serve, "This document", (200, openapi), **static)
    return paths


def operations(settings: Settings) -> oa.Paths:
    """The core routes (Redis alone serves them), each with its description."""
    s = settings
    parts = (
        _admin_paths(s),
        _ops_paths(s),
        console.operations(s),
        jobs.operations(s),
        checkpoints.operations(s),
        breakers.operations(s),
        queues.operations(s),
        batch_routes.operations(s),
        worker_routes.operations(s),
    )
    return _job_paths(s).include(*parts)


def document(
    settings: Settings,
    paths: dict[str, Any],
    extra_types: Sequence[type] = (),
    extra_constraints: Sequence[Callable[[dict[str, Any]], None]] = (),
) -> dict[str, Any]:
    """The document of an app with ``settings`` serving ``paths`` (``operations``' and an
    extension's), whose bodies are the core's msgspec Structs and ``extra_types``
    (``extra_constraints`` add the rules JSON Schema can state to their generated schemas)."""
    components = _components(settings, extra_types)
    for add_rules in extra_constraints:
        add_rules(components)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "jobtier",
            "version": "1",
            "description": (
                "Jobs and their status, served from a sharded Redis write-through cache. Errors "
                "are problem documents (application/problem+json). A method a path does not "
                "have is a 405 with Allow. Integers are written without a fraction (3, not "
                "3.0)."
            ),
        },
        "servers": [{"url": "/"}],
        "security": [{"tenantKey": []}],
        "paths": paths,
        "components": {"schemas": components, "securitySchemes": _SECURITY_SCHEMES},
    }


_SECURITY_SCHEMES = {
    "tenantKey": {
        "type": "http",
        "scheme": "bearer",
        "description": (
            "a tenant's API key (JOBTIER_API_KEYS): it sees that tenant's jobs and schedules only"
        ),
    },
    "adminKey": {
        "type": "http",
        "scheme": "bearer",
        "description": "the admin key (JOBTIER_ADMIN_KEY), for the admin routes",
    },
    "workerKey": {
        "type": "http",
        "scheme": "bearer",
        "description": "an HTTP worker's key (JOBTIER_WORKER_KEYS), for the worker routes",
    },
}


async def serve(request: Request) -> Response:
    """The document, with each task the workers advertise (task_schemas.py)."""
    body = request.state.openapi.render(request.state.catalog.ads())
    return Response(body, media_type="application/json")
