"""The OpenAPI document of the API, served at ``/v1/openapi.json``.

Built from what the server checks with, so the two cannot drift:

* request and response bodies from the msgspec Structs the server decodes and encodes with,
  their extra rules (patterns, ranges) from the same constants the validation uses;
* query parameters from the routes' ``Param`` declarations (api/params.py);
* limits that are settings (payload, request body, batch size, long-poll) from ``Settings``;
* the error answers by what an operation does (``operation()``): every operation can be
  refused for its URL or headers (414/431) and, if it needs a key, with 401 (403 on admin
  routes); one with query parameters with 400; one with a body with 400/413/415/422; one
  that reads Redis or Postgres with 503.

A test checks that every route of the app is described and nothing else is; the fuzzer
(tests/e2e/test_api_fuzz.py) checks the server's answers against this document.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from jobtier.api.admin import DEAD_LETTER_PARAMS, REPLAY_MAX, ReplayFilter
from jobtier.api.debugging import DeadLetter
from jobtier.api.flows import DependencyList
from jobtier.api.jobs import STATUS_PARAMS, BatchBody
from jobtier.api.spec import (
    CALLBACK_EVENTS,
    CALLBACK_URL,
    JOB_ID,
    QUEUE_NAME,
    RETRY_AFTER,
    Auth,
    BatchResponse,
    DeadLetters,
    FlowResponse,
    Health,
    Problem,
    QueueLimitsSet,
    QueueList,
    QueuePaused,
    Readiness,
    Replayed,
    ResultResponse,
    TaskList,
    constrain,
    constrain_items,
    event_stream,
    header,
    json_response,
    operation,
    payload_too_large,
    problem,
    ref,
    too_large,
)
from jobtier.config import Settings
from jobtier.core.model import FlowSpec, JobLogs, JobSpec, JobStatus, QueueLimits
from jobtier.core.names import (
    IDEMPOTENCY_KEY_RE,
    JOB_ID_RE,
    QUEUE_NAME_RE,
    REF_RE,
    TASK_NAME_RE,
    TENANT_RE,
)
from jobtier.engine.validate import MAX_ATTEMPTS_LIMIT, MAX_CONCURRENCY_LIMIT
from jobtier.webhooks.safety import MAX_URL_LENGTH as MAX_URL_LENGTH_CALLBACK
from jobtier.worker.context import LOG_LINE_CHARS, LOG_LINES


def _flow_constraints(c: dict[str, Any], settings: Settings) -> None:
    """A flow's job is a job (the rules of ``JobSpec``) with a ref and its ``after``; a job of
    either kind may name existing jobs it waits for (``depends_on``)."""
    spec = "FlowJob"
    for name, rule in c["JobSpec"]["properties"].items():
        if name in c[spec]["properties"] and name != "depends_on":
            c[spec]["properties"][name] = rule
    constrain(c, spec, "ref", pattern=REF_RE.pattern)
    constrain(c, spec, "after", maxItems=settings.max_flow_jobs)
    constrain_items(c, spec, "after", pattern=REF_RE.pattern)
    c[spec]["properties"]["after"]["description"] = (
        "refs of the jobs of this flow it waits for (its children); a ref no job has, or a "
        "cycle, is refused (422)"
    )
    for struct in ("JobSpec", spec):
        constrain(c, struct, "depends_on", maxItems=settings.max_flow_jobs)
        constrain_items(c, struct, "depends_on", pattern=JOB_ID_RE.pattern)
        c[struct]["properties"]["depends_on"]["description"] = (
            "ids of existing jobs (of yours, still kept by Redis: else 422) it waits for, "
            f"at most {settings.max_flow_jobs} (JOBTIER_MAX_FLOW_JOBS)"
        )
    c["FlowSpec"]["properties"]["jobs"].update(minItems=1, maxItems=settings.max_flow_jobs)
    constrain(c, "FlowSpec", "idempotency_key", pattern=IDEMPOTENCY_KEY_RE.pattern)


def _components(settings: Settings, extra_types: Sequence[type]) -> dict[str, Any]:
    # the Structs the routes decode with: what they refuse (unknown members) is stated too
    _, components = msgspec.json.schema_components(
        [
            JobSpec, JobStatus, Problem, BatchBody, BatchResponse, ResultResponse,
            DeadLetters, ReplayFilter, Replayed, Health, Readiness, QueueList, QueuePaused,
            QueueLimits, QueueLimitsSet, TaskList, FlowSpec, FlowResponse, DependencyList,
            JobLogs, DeadLetter, *extra_types,
        ],
        ref_template="#/components/schemas/{name}",
    )  # fmt: skip
    c = components
    constrain(c, "JobSpec", "type", pattern=TASK_NAME_RE.pattern)
    constrain(c, "JobSpec", "max_attempts", minimum=1, maximum=MAX_ATTEMPTS_LIMIT)
    constrain(c, "JobSpec", "delay", minimum=0, maximum=settings.max_future_seconds)
    constrain(c, "JobSpec", "run_at", format="date-time")
    constrain(c, "JobSpec", "idempotency_key", pattern=IDEMPOTENCY_KEY_RE.pattern)
    c["JobSpec"]["properties"]["payload"]["description"] = (
        f"any JSON value, at most {settings.max_payload_bytes} bytes encoded "
        "(JOBTIER_MAX_PAYLOAD_BYTES; over it: 413)"
    )
    c["JobSpec"]["properties"]["run_at"]["description"] = (
        f"when to run (with a time zone); from {settings.past_tolerance_seconds:g} s ago "
        f"to {settings.max_future_seconds} s ahead (JOBTIER_MAX_FUTURE_SECONDS); "
        "not with delay"
    )
    c["BatchBody"]["properties"]["jobs"].update(minItems=1, maxItems=settings.max_batch)
    constrain(c, "ReplayFilter", "type", pattern=TASK_NAME_RE.pattern)
    constrain(c, "ReplayFilter", "queue", pattern=QUEUE_NAME_RE.pattern)
    constrain(c, "ReplayFilter", "tenant", pattern=TENANT_RE.pattern)
    constrain(c, "ReplayFilter", "limit", minimum=1, maximum=REPLAY_MAX)
    constrain(c, "ReplayFilter", "since", format="date-time")
    c["ReplayFilter"]["properties"]["since"]["description"] = (
        "only jobs dead-lettered at or after this RFC 3339 date-time (without an offset: UTC)"
    )
    constrain(c, "JobSpec", "queue", pattern=QUEUE_NAME_RE.pattern)
    constrain(c, "JobSpec", "concurrency_key", pattern=IDEMPOTENCY_KEY_RE.pattern)
    constrain(c, "JobSpec", "concurrency_limit", minimum=1, maximum=MAX_CONCURRENCY_LIMIT)
    _flow_constraints(c, settings)
    constrain(c, "QueueLimits", "concurrency", minimum=1, maximum=1_000_000)
    constrain(c, "QueueLimits", "rate", minimum=1, maximum=1_000_000)
    c["QueueLimits"]["properties"]["per"].update(minimum=0.001, maximum=86_400)
    constrain(c, "CallbackSpec", "url", maxLength=MAX_URL_LENGTH_CALLBACK, pattern=CALLBACK_URL)
    c["CallbackSpec"]["properties"]["events"]["enum"] = list(CALLBACK_EVENTS)
    return components


def document(
    settings: Settings,
    extra_paths: dict[str, Any] | None = None,
    extra_types: Sequence[type] = (),
    extra_constraints: Sequence[Callable[[dict[str, Any]], None]] = (),
) -> dict[str, Any]:
    """The document of an app with ``settings`` serving the core routes plus ``extra_paths``,
    whose bodies are the msgspec Structs ``extra_types`` (``extra_constraints`` add the rules
    JSON Schema can state to their generated schemas)."""
    s = settings
    op = operation
    metrics_auth: Auth = "none" if s.metrics_public else "admin"
    paths: dict[str, Any] = {
        "/v1/jobs": {
            "post": op(s, "Submit a job", {
                "202": json_response("JobStatus", "created", {"Location": header("the job's URL", required=True)}),
                "200": json_response("JobStatus", "a duplicate of an earlier submit with the same idempotency key", {"Location": header("the job's URL", required=True)}),
                "400": problem("malformed JSON, or the Idempotency-Key header and the body's idempotency_key differ"),
                "409": problem("the idempotency key was used for a different request (job_id), or a callback was given and the tenant has no webhook signing secret"),
                "410": problem("the idempotency key names a job that is no longer kept (job_id)"),
                "413": too_large(s, payload_too_large(s)),
                "429": problem("the tenant's rate limit or waiting-jobs cap", RETRY_AFTER),
                "503": problem("back-pressure (too many waiting jobs, write-behind lag) or Redis unavailable", RETRY_AFTER),
            }, body="JobSpec", headers=[{"name": "Idempotency-Key", "in": "header", "schema": {"type": "string", "pattern": IDEMPOTENCY_KEY_RE.pattern}}]),
        },
        "/v1/jobs/batch": {
            "post": op(s, f"Submit up to {s.max_batch} jobs (JOBTIER_MAX_BATCH); one outcome each", {
                "200": json_response("BatchResponse", "one result per job, in order"),
                "409": problem("a job has a callback and the tenant has no webhook signing secret (nothing was submitted)"),
                "413": too_large(s, payload_too_large(s), f"more than {s.max_batch} jobs (JOBTIER_MAX_BATCH)"),
                "429": problem("the tenant's rate limit or waiting-jobs cap", RETRY_AFTER),
                "503": problem("back-pressure (too many waiting jobs, write-behind lag) or Redis unavailable", RETRY_AFTER),
            }, body="BatchBody"),
        },
        "/v1/flows": {
            "post": op(s, f"Submit a flow: up to {s.max_flow_jobs} jobs (JOBTIER_MAX_FLOW_JOBS), each running once the jobs it waits for have succeeded", {
                "202": json_response("FlowResponse", "created: each job's status, in the order of the request"),
                "200": json_response("FlowResponse", "a repeat of an earlier submit with the same idempotency key: its jobs as they are now"),
                "400": problem("malformed JSON, or the Idempotency-Key header and the body's idempotency_key differ"),
                "409": problem("the idempotency key was used for a different flow (job_id), or a job has a callback and the tenant has no webhook signing secret (nothing was submitted)"),
                "410": problem("the idempotency key names a flow a job of which is no longer kept (job_id)"),
                "413": too_large(s, payload_too_large(s)),
                "422": problem("the body does not fit its schema, or a rule it cannot state: a cycle, an after naming no ref of the flow, a ref used twice, a depends_on naming no job of yours that Redis keeps, a run_at in the past, a callback URL refused by the address policy, …; field names the member (jobs[i].after, jobs[i].callback.url); nothing is submitted"),
                "429": problem("the tenant's rate limit or waiting-jobs cap", RETRY_AFTER),
                "503": problem("back-pressure (too many waiting jobs, write-behind lag) or Redis unavailable", RETRY_AFTER),
            }, body="FlowSpec", headers=[{"name": "Idempotency-Key", "in": "header", "schema": {"type": "string", "pattern": IDEMPOTENCY_KEY_RE.pattern}}]),
        },
        "/v1/jobs/{job_id}/dependencies": {
            "get": op(s, "The jobs this one waits for, in order: pending, or their outcome (result or error)", {
                "200": json_response("DependencyList", "the dependencies (empty for a job without any)"),
                "404": problem("unknown job (or another tenant's, or a malformed id)"),
            }, path=[JOB_ID]),
        },
        "/v1/jobs/{job_id}": {
            "get": op(s, "The job's status document", {
                "200": json_response("JobStatus", "the status", {"ETag": header("the version, quoted", required=True, pattern='^"[0-9]+"$')}),
                "304": {"description": "not changed since the version in If-None-Match", "headers": {"ETag": header("the version, quoted", required=True, pattern='^"[0-9]+"$')}},
                "404": problem("unknown job (or another tenant's, or a malformed id)"),
            }, params=STATUS_PARAMS, path=[JOB_ID], headers=[{"name": "If-None-Match", "in": "header", "schema": {"type": "string"}}]),
        },
        "/v1/jobs/{job_id}/result": {
            "get": op(s, "The job's result (null until it succeeds; a result kept outside Redis is null here and result_url says where it streams from)", {
                "200": json_response("ResultResponse", "state, result (or result_url) and error"),
                "404": problem("unknown job (or another tenant's, or a malformed id)"),
            }, path=[JOB_ID]),
        },
        "/v1/jobs/{job_id}/cancel": {
            "post": op(s, "Cancel a waiting job, or ask the worker running it to stop", {
                "200": json_response("JobStatus", "cancelled, or running with cancel_requested"),
                "404": problem("unknown job (or another tenant's, or a malformed id)"),
                "409": problem("the job has already finished (job: its status)"),
            }, path=[JOB_ID]),
        },
        "/v1/jobs/{job_id}/logs": {
            "get": op(s, f"The lines the job's task logged (ctx.log), oldest first: the latest {LOG_LINES}, each at most {LOG_LINE_CHARS} characters, while Redis holds the job", {
                "200": json_response("JobLogs", "the lines (empty once the job left Redis)"),
                "404": problem("unknown job (or another tenant's, or a malformed id)"),
            }, path=[JOB_ID]),
        },
        "/v1/jobs/{job_id}/retry": {
            "post": op(s, "Retry a failed (dead-lettered) job: back to its queue, attempts reset", {
                "200": json_response("JobStatus", "queued again"),
                "404": problem("unknown job (or another tenant's, or a malformed id)"),
                "409": problem("the job has not failed (job: its status)"),
            }, path=[JOB_ID]),
        },
        "/v1/jobs/{job_id}/events": {
            "get": op(s, "Server-Sent Events: the status, then every change until a terminal state", {
                "200": event_stream("event: status, id: the version, data: the status document", "status", ref("JobStatus")),
                "204": {"description": "Last-Event-ID is the final status: nothing more will come"},
                "404": problem("unknown job (or another tenant's, or a malformed id)"),
            }, path=[JOB_ID], headers=[{"name": "Last-Event-ID", "in": "header", "description": "the version the client has (ASCII digits; anything else is ignored)", "schema": {"type": "string"}}]),
        },
        "/v1/admin/dead-letters": {
            "get": op(s, "Dead-lettered jobs, newest first", {
                "200": json_response("DeadLetters", "the jobs"),
            }, auth="admin", params=DEAD_LETTER_PARAMS),
        },
        "/v1/admin/dead-letters/{job_id}": {
            "get": op(s, "One dead-lettered job in full: its status (error and traceback), payload and log lines", {
                "200": json_response("DeadLetter", "the dead letter"),
                "404": problem("not in the dead-letter set (or expired from Redis, or a malformed id)"),
            }, auth="admin", path=[JOB_ID]),
        },
        "/v1/admin/dead-letters/{job_id}/replay": {
            "post": op(s, "Send a dead-lettered job back to its queue, attempts reset", {
                "200": json_response("JobStatus", "queued again"),
                "404": problem("unknown job (or a malformed id)"),
                "409": problem("the job is not dead-lettered"),
            }, auth="admin", path=[JOB_ID]),
        },
        "/v1/admin/dead-letters/replay": {
            "post": op(s, "Replay dead-lettered jobs matching a filter (no body: all, up to 100)", {
                "200": json_response("Replayed", "the ids replayed"),
            }, auth="admin", body="ReplayFilter", body_required=False),
        },
        "/v1/admin/stats": {
            "get": op(s, "Queue depth per shard and priority, waiting per tenant, workers, status-tier counters", {
                "200": {"description": "statistics", "content": {"application/json": {"schema": {"type": "object"}}}},
            }, auth="admin"),
        },
        "/v1/admin/queues": {
            "get": op(s, "Every queue: ready jobs by priority, parked, running, paused, limits, oldest age, workers, tasks", {
                "200": json_response("QueueList", "the queues"),
            }, auth="admin"),
        },
        "/v1/admin/queues/{name}/pause": {
            "post": op(s, "Pause a queue: submits are accepted, nothing is claimed from it, running jobs finish", {
                "200": json_response("QueuePaused", "paused"),
                "422": problem("a queue name that breaks its pattern"),
            }, auth="admin", path=[QUEUE_NAME]),
        },
        "/v1/admin/queues/{name}/resume": {
            "post": op(s, "Resume a paused queue", {
                "200": json_response("QueuePaused", "resumed"),
                "422": problem("a queue name that breaks its pattern"),
            }, auth="admin", path=[QUEUE_NAME]),
        },
        "/v1/admin/queues/{name}/limits": {
            "put": op(s, "Limit a queue across every worker (global concurrency, starts per period); {} lifts the limits", {
                "200": json_response("QueueLimitsSet", "the limits now in force"),
            }, auth="admin", path=[QUEUE_NAME], body="QueueLimits"),
        },
        "/v1/admin/tasks": {
            "get": op(s, "The task catalogue: every task a live or recently seen worker runs, its queue, policies and payload schema", {
                "200": json_response("TaskList", "the tasks"),
            }, auth="admin"),
        },
        "/healthz": {"get": op(s, "Liveness", {"200": json_response("Health", "alive")}, auth="none", backend=False)},
        "/readyz": {
            "get": op(s, "Readiness: Redis (and Postgres, its migrations applied) reachable", {
                "200": json_response("Readiness", "ready"),
                "503": json_response("Readiness", "not ready: checks says what is wrong"),
            }, auth="none", backend=False),
        },
        "/metrics": {
            "get": op(s, "Prometheus metrics of every live jobtier process, and queue gauges (admin key unless JOBTIER_METRICS_PUBLIC)", {
                "200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
            }, auth=metrics_auth),
        },
        "/dashboard": {
            "get": op(s, "The live dashboard page (asks for the admin key)", {
                "200": {"description": "HTML", "content": {"text/html": {"schema": {"type": "string"}}}},
            }, auth="none", backend=False),
        },
        "/v1/admin/dashboard/stream": {
            "get": op(s, "Server-Sent Events: a dashboard frame a second", {
                "200": event_stream("event: frame, data: the dashboard's figures", "frame", {"type": "object"}),
            }, auth="admin"),
        },
        "/v1/openapi.json": {
            "get": op(s, "This document", {
                "200": {"description": "OpenAPI 3.1", "content": {"application/json": {"schema": {"type": "object"}}}},
            }, auth="none", backend=False),
        },
    }  # fmt: skip
    for path, item in (extra_paths or {}).items():
        paths.setdefault(path, {}).update(item)
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
        "components": {
            "schemas": components,
            "securitySchemes": {
                "tenantKey": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "a tenant's API key (JOBTIER_API_KEYS): it sees that tenant's jobs and schedules only",
                },
                "adminKey": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "the admin key (JOBTIER_ADMIN_KEY), for the admin routes",
                },
            },
        },
    }


async def serve(request: Request) -> Response:
    """The document, with each task the workers advertise (task_schemas.py)."""
    body = request.state.openapi.render(request.state.catalog.ads())
    return Response(body, media_type="application/json")


routes = [Route("/v1/openapi.json", serve, methods=["GET"])]
