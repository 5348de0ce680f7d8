"""The OpenAPI document of the API, served at ``/v1/openapi.json``.

Schemas of request and response bodies come from the msgspec Structs the server decodes
and encodes with, so they cannot drift from what the server does; a test checks that every
route of the app is described and nothing else is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from jobtier.model import QUEUE_NAME_RE, JobSpec, JobStatus, QueueInfo, QueueLimits, TaskAd


class Problem(msgspec.Struct):
    type: str
    title: str
    status: int
    detail: str
    field: str | None = None  # validation: the offending member, e.g. "jobs[1].priority"
    job_id: str | None = None  # idempotency conflict, gone: the job the key names
    job: JobStatus | None = None  # wrong state: the job as it is


class BatchRequest(msgspec.Struct):
    jobs: list[JobSpec]


class BatchItem(msgspec.Struct):
    status: int
    job: JobStatus | None = None
    problem: Problem | None = None


class BatchResponse(msgspec.Struct):
    results: list[BatchItem]


class ResultResponse(msgspec.Struct):
    id: str
    state: str
    version: int
    result: Any = None
    error: Any = None


class DeadLetters(msgspec.Struct):
    jobs: list[JobStatus]


class ReplayRequest(msgspec.Struct):
    type: str | None = None
    limit: int = 100


class Replayed(msgspec.Struct):
    replayed: list[str]
    count: int


class QueueList(msgspec.Struct):
    queues: list[QueueInfo]


class QueuePaused(msgspec.Struct):
    queue: str
    paused: bool


class QueueLimitsSet(msgspec.Struct):
    queue: str
    limits: QueueLimits | None


class TaskList(msgspec.Struct):
    tasks: list[TaskAd]


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def json_response(name: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": ref(name)}}}


def problem(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/problem+json": {"schema": ref("Problem")}},
    }


JOB_ID = {
    "name": "job_id", "in": "path", "required": True,
    "schema": {"type": "string", "pattern": "^[0-9A-HJKMNP-TV-Z]{26}-[0-9]{1,4}$"},
}  # fmt: skip
QUEUE_NAME = {
    "name": "name", "in": "path", "required": True,
    "schema": {"type": "string", "pattern": QUEUE_NAME_RE.pattern},
}  # fmt: skip
AUTH_ERRORS = {"401": problem("missing or unknown API key")}
ADMIN_ERRORS = {**AUTH_ERRORS, "403": problem("a tenant key on an admin route")}
SUBMIT_ERRORS = {
    "400": problem("malformed JSON"),
    "409": problem("the idempotency key was used for a different request"),
    "410": problem("the idempotency key names a job that is no longer kept"),
    "413": problem("body, payload or batch too large"),
    "415": problem("the body is not JSON"),
    "422": problem("invalid job (unknown field, wrong type, bad priority or run-at, …)"),
    "429": problem("the tenant's rate limit or waiting-jobs cap"),
    "503": problem("back-pressure: too many waiting jobs or write-behind lag; see Retry-After"),
}


def document(
    extra_paths: dict[str, Any] | None = None, extra_types: Sequence[type] = ()
) -> dict[str, Any]:
    """The document of an app serving the core routes plus ``extra_paths``, whose bodies are
    the msgspec Structs ``extra_types``."""
    _, components = msgspec.json.schema_components(
        [
            JobSpec,
            JobStatus,
            Problem,
            BatchRequest,
            BatchResponse,
            ResultResponse,
            DeadLetters,
            ReplayRequest,
            Replayed,
            QueueList,
            QueuePaused,
            QueueLimits,
            QueueLimitsSet,
            TaskList,
            *extra_types,
        ],
        ref_template="#/components/schemas/{name}",
    )
    paths: dict[str, Any] = {
        "/v1/jobs": {
            "post": {
                "summary": "Submit a job",
                "parameters": [{"name": "Idempotency-Key", "in": "header", "schema": {"type": "string"}}],
                "requestBody": {"required": True, "content": {"application/json": {"schema": ref("JobSpec")}}},
                "responses": {
                    "202": json_response("JobStatus", "created"),
                    "200": json_response("JobStatus", "a duplicate of an earlier submit with the same idempotency key"),
                    **AUTH_ERRORS, **SUBMIT_ERRORS,
                },
            }
        },
        "/v1/jobs/batch": {
            "post": {
                "summary": "Submit up to JOBTIER_MAX_BATCH jobs; one outcome each",
                "requestBody": {"required": True, "content": {"application/json": {"schema": ref("BatchRequest")}}},
                "responses": {"200": json_response("BatchResponse", "one result per job, in order"), **AUTH_ERRORS, **SUBMIT_ERRORS},
            }
        },
        "/v1/jobs/{job_id}": {
            "get": {
                "summary": "The job's status document",
                "parameters": [
                    JOB_ID,
                    {"name": "If-None-Match", "in": "header", "schema": {"type": "string"}},
                    {"name": "wait", "in": "query", "description": "long-poll: with If-None-Match, wait up to this many seconds for a newer version", "schema": {"type": "number", "minimum": 0}},
                ],
                "responses": {
                    "200": {**json_response("JobStatus", "the status; ETag is the version"), "headers": {"ETag": {"schema": {"type": "string"}}}},
                    "304": {"description": "not changed since the version in If-None-Match"},
                    "400": problem("bad wait"),
                    "404": problem("unknown job (or another tenant's)"),
                    **AUTH_ERRORS,
                },
            }
        },
        "/v1/jobs/{job_id}/result": {
            "get": {
                "summary": "The job's result (null until it succeeds)",
                "parameters": [JOB_ID],
                "responses": {"200": json_response("ResultResponse", "state, result and error"), "404": problem("unknown job"), **AUTH_ERRORS},
            }
        },
        "/v1/jobs/{job_id}/cancel": {
            "post": {
                "summary": "Cancel a waiting job, or ask the worker running it to stop",
                "parameters": [JOB_ID],
                "responses": {
                    "200": json_response("JobStatus", "cancelled, or running with cancel_requested"),
                    "404": problem("unknown job"),
                    "409": problem("the job has already finished"),
                    **AUTH_ERRORS,
                },
            }
        },
        "/v1/jobs/{job_id}/events": {
            "get": {
                "summary": "Server-Sent Events: the status, then every change until a terminal state",
                "parameters": [JOB_ID, {"name": "Last-Event-ID", "in": "header", "schema": {"type": "string"}}],
                "responses": {
                    "200": {"description": "event: status, id: version, data: the status document", "content": {"text/event-stream": {"schema": {"type": "string"}}}},
                    "204": {"description": "the client already has the final status"},
                    "404": problem("unknown job"),
                    **AUTH_ERRORS,
                },
            }
        },
        "/v1/admin/dead-letters": {
            "get": {
                "summary": "Dead-lettered jobs, newest first",
                "parameters": [
                    {"name": "type", "in": "query", "schema": {"type": "string"}},
                    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 1000}},
                ],
                "responses": {"200": json_response("DeadLetters", "the jobs"), "400": problem("bad limit"), **ADMIN_ERRORS},
            }
        },
        "/v1/admin/dead-letters/{job_id}/replay": {
            "post": {
                "summary": "Send a dead-lettered job back to its queue, attempts reset",
                "parameters": [JOB_ID],
                "responses": {"200": json_response("JobStatus", "queued again"), "404": problem("unknown job"), "409": problem("not dead-lettered"), **ADMIN_ERRORS},
            }
        },
        "/v1/admin/dead-letters/replay": {
            "post": {
                "summary": "Replay dead-lettered jobs matching a filter",
                "requestBody": {"content": {"application/json": {"schema": ref("ReplayRequest")}}},
                "responses": {"200": json_response("Replayed", "the ids replayed"), "422": problem("bad filter"), **ADMIN_ERRORS},
            }
        },
        "/v1/admin/stats": {
            "get": {
                "summary": "Queue depth per shard and priority, waiting per tenant, workers, status-tier counters",
                "responses": {"200": {"description": "statistics", "content": {"application/json": {"schema": {"type": "object"}}}}, **ADMIN_ERRORS},
            }
        },
        "/v1/admin/queues": {
            "get": {
                "summary": "Every queue: ready jobs by priority, parked, running, paused, limits, oldest age, workers, tasks",
                "responses": {"200": json_response("QueueList", "the queues"), **ADMIN_ERRORS},
            }
        },
        "/v1/admin/queues/{name}/pause": {
            "post": {
                "summary": "Pause a queue: submits are accepted, nothing is claimed from it, running jobs finish",
                "parameters": [QUEUE_NAME],
                "responses": {"200": json_response("QueuePaused", "paused"), **ADMIN_ERRORS, "422": problem("bad queue name")},
            }
        },
        "/v1/admin/queues/{name}/resume": {
            "post": {
                "summary": "Resume a paused queue",
                "parameters": [QUEUE_NAME],
                "responses": {"200": json_response("QueuePaused", "resumed"), **ADMIN_ERRORS, "422": problem("bad queue name")},
            }
        },
        "/v1/admin/queues/{name}/limits": {
            "put": {
                "summary": "Limit a queue across every worker (global concurrency, starts per period); {} lifts the limits",
                "parameters": [QUEUE_NAME],
                "requestBody": {"required": True, "content": {"application/json": {"schema": ref("QueueLimits")}}},
                "responses": {"200": json_response("QueueLimitsSet", "the limits now in force"), **ADMIN_ERRORS, "400": problem("malformed JSON"), "415": problem("the body is not JSON"), "422": problem("bad queue name or limit")},
            }
        },
        "/v1/admin/tasks": {
            "get": {
                "summary": "The task catalogue: every task a live or recently seen worker runs, its queue, policies and payload schema",
                "responses": {"200": json_response("TaskList", "the tasks"), **ADMIN_ERRORS},
            }
        },
        "/healthz": {"get": {"summary": "Liveness", "security": [], "responses": {"200": {"description": "alive"}}}},
        "/readyz": {"get": {"summary": "Readiness: Redis (and Postgres) reachable", "security": [], "responses": {"200": {"description": "ready"}, "503": {"description": "not ready"}}}},
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics of every live jobtier process, and queue gauges (admin key unless JOBTIER_METRICS_PUBLIC)",
                "responses": {"200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}, **ADMIN_ERRORS},
            }
        },
        "/dashboard": {"get": {"summary": "The live dashboard page (asks for the admin key)", "security": [], "responses": {"200": {"description": "HTML", "content": {"text/html": {"schema": {"type": "string"}}}}}}},
        "/v1/admin/dashboard/stream": {
            "get": {
                "summary": "Server-Sent Events: a dashboard frame a second",
                "responses": {"200": {"description": "event: frame, data: JSON", "content": {"text/event-stream": {"schema": {"type": "string"}}}}, **ADMIN_ERRORS},
            }
        },
        "/v1/openapi.json": {"get": {"summary": "This document", "security": [], "responses": {"200": {"description": "OpenAPI 3.1"}}}},
    }  # fmt: skip
    for path, item in (extra_paths or {}).items():
        paths.setdefault(path, {}).update(item)
    return {
        "openapi": "3.1.0",
        "info": {"title": "jobtier", "version": "1", "description": "Jobs and their status, served from a sharded Redis write-through cache."},
        "servers": [{"url": "/"}],
        "security": [{"apiKey": []}],
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer"}},
        },
    }  # fmt: skip


async def serve(request: Request) -> Response:
    return Response(request.state.openapi, media_type="application/json")


routes = [Route("/v1/openapi.json", serve, methods=["GET"])]
