"""The building blocks of the OpenAPI document (``openapi.py`` assembles it): response
bodies, parameters, and ``operation()``, which gives each operation the error answers the
server gives for what it does. Route modules describe themselves with these."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from jobtier.api.bounds import MAX_HEADER_BYTES, MAX_HEADERS, MAX_JSON_DEPTH, MAX_URL_BYTES
from jobtier.api.params import Param
from jobtier.config import Settings
from jobtier.core.model import JobStatus, QueueInfo, QueueLimits, TaskAd
from jobtier.core.names import JOB_ID_RE, QUEUE_NAME_RE


class Problem(msgspec.Struct):
    """An error (RFC 9457); ``type`` is ``urn:jobtier:problem:<slug>``."""

    type: str
    title: str
    status: int
    detail: str
    field: str | None = None  # the offending parameter or member, e.g. "jobs[1].priority"
    job_id: str | None = None  # idempotency conflict, gone: the job the key names
    job: JobStatus | None = None  # wrong state: the job as it is
    limit: int | None = None  # nesting too deep: the limit


class BatchItem(msgspec.Struct):
    status: int
    job: JobStatus | None = None
    problem: Problem | None = None


class BatchResponse(msgspec.Struct):
    results: list[BatchItem]


class FlowResponse(msgspec.Struct):
    """A submitted flow: ``created`` False for a repeat of an earlier submit with the same
    idempotency key; each job's status document, in the order of the request."""

    created: bool
    jobs: list[JobStatus]


class ResultResponse(msgspec.Struct):
    id: str
    state: str
    version: int
    result: Any = None
    error: Any = None
    # a result kept outside Redis (JOBTIER_RESULT_STORE): result is null, and this is where
    # it streams from
    result_url: str | None = None


class DeadLetters(msgspec.Struct):
    jobs: list[JobStatus]


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


class Health(msgspec.Struct):
    status: str


class Readiness(msgspec.Struct):
    status: str
    checks: dict[str, str]


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def event_stream(description: str, event: str, data: dict[str, Any]) -> dict[str, Any]:
    """A ``text/event-stream`` answer: its schema is each event's (OpenAPI 3.1), whose
    ``data`` is a JSON document of schema ``data``."""
    schema = {
        "type": "object",
        "required": ["event", "data"],
        "properties": {
            "event": {"const": event},
            "id": {"type": "string", "pattern": "^[0-9]+$"},
            "data": {
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": data,
            },
        },
    }
    return {"description": description, "content": {"text/event-stream": {"schema": schema}}}


def json_response(
    name: str, description: str, headers: dict[str, Any] | None = None
) -> dict[str, Any]:
    answer: dict[str, Any] = {
        "description": description,
        "content": {"application/json": {"schema": ref(name)}},
    }
    if headers:
        answer["headers"] = headers
    return answer


def problem(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    answer: dict[str, Any] = {
        "description": description,
        "content": {"application/problem+json": {"schema": ref("Problem")}},
    }
    if headers:
        answer["headers"] = headers
    return answer


def header(description: str, *, required: bool = False, pattern: str | None = None) -> Any:
    schema: dict[str, Any] = {"type": "string"}
    if pattern:
        schema["pattern"] = pattern
    return {"description": description, "required": required, "schema": schema}


RETRY_AFTER = {"Retry-After": header("seconds to wait before trying again", pattern="^[0-9]+$")}
JOB_ID: dict[str, Any] = {
    "name": "job_id", "in": "path", "required": True,
    "description": "a job id as submit returned it (a malformed or unknown one is a 404)",
    "schema": {"type": "string", "pattern": JOB_ID_RE.pattern},
}  # fmt: skip

QUEUE_NAME = {
    "name": "name", "in": "path", "required": True,
    "description": "a queue name",
    "schema": {"type": "string", "pattern": QUEUE_NAME_RE.pattern},
}  # fmt: skip

Auth = Literal["tenant", "admin", "none"]

# a callback URL (a submit's callback, a subscription's url): webhooks/safety.py checks the rest
CALLBACK_URL = r"^https?://[^\s]+$"
CALLBACK_EVENTS = ("terminal", "all")


def too_large(settings: Settings, *more: str) -> dict[str, Any]:
    """The 413 answer: the body over ``JOBTIER_MAX_REQUEST_BYTES``, or ``more`` reasons."""
    reasons = [f"the body is over {settings.max_request_bytes} bytes (JOBTIER_MAX_REQUEST_BYTES)"]
    return problem(", or ".join([*reasons, *more]))


def payload_too_large(settings: Settings) -> str:
    return f"a payload is over {settings.max_payload_bytes} bytes (JOBTIER_MAX_PAYLOAD_BYTES)"


def operation(
    settings: Settings,
    summary: str,
    responses: dict[str, Any],
    *,
    auth: Auth = "tenant",
    params: Sequence[Param] = (),
    path: Sequence[dict[str, Any]] = (),
    headers: Sequence[dict[str, Any]] = (),
    body: str | None = None,
    body_required: bool = True,
    backend: bool = True,
) -> dict[str, Any]:
    """One operation, with the error answers the server gives for what it does."""
    out: dict[str, Any] = {"summary": summary}
    parameters = [*path, *(p.openapi(settings) for p in params), *headers]
    if parameters:
        out["parameters"] = parameters
    errors: dict[str, Any] = {
        "414": problem(f"the URL is over {MAX_URL_BYTES} bytes"),
        "431": problem(f"the headers are over {MAX_HEADER_BYTES} bytes or {MAX_HEADERS} fields"),
    }
    if params:
        errors["400"] = problem("a query parameter is unknown, repeated or malformed (field)")
    if body is not None:
        limit = settings.max_request_bytes
        out["requestBody"] = {
            "required": body_required,
            "description": (
                f"JSON, at most {limit} bytes (JOBTIER_MAX_REQUEST_BYTES), arrays and "
                f"objects nested at most {MAX_JSON_DEPTH} deep"
            ),
            "content": {"application/json": {"schema": ref(body)}},
        }
        errors["400"] = problem("malformed JSON, or no body")
        errors["413"] = too_large(settings)
        errors["415"] = problem("the body is not application/json (or application/*+json)")
        errors["422"] = problem(
            "the body does not fit its schema, or breaks a rule it cannot state "
            "(run_at in the past, cron syntax, time zone name, a depends_on naming no job "
            "of yours that Redis keeps, …); field names the member"
        )
    if auth != "none":
        errors["401"] = problem(
            "missing or unknown API key",
            {"WWW-Authenticate": header("Bearer realm")},
        )
    out["security"] = {"tenant": [{"tenantKey": []}], "admin": [{"adminKey": []}], "none": []}[auth]
    if auth == "admin":
        errors["403"] = problem("a tenant key on an admin route")
    if backend:
        errors["503"] = problem("Redis or Postgres is unavailable; try again", RETRY_AFTER)
    out["responses"] = {**errors, **responses}
    return out


def constrain(components: dict[str, Any], struct: str, field: str, **constraints: Any) -> None:
    """Add JSON Schema keywords to a member of a generated component (to its non-null
    branch when it is optional)."""
    schema = components[struct]["properties"][field]
    for option in schema.get("anyOf", [schema]):
        if option.get("type") != "null":
            option.update(constraints)


def constrain_items(
    components: dict[str, Any], struct: str, field: str, **constraints: Any
) -> None:
    """Add JSON Schema keywords to the items of an array member (optional or not)."""
    schema = components[struct]["properties"][field]
    for option in schema.get("anyOf", [schema]):
        if option.get("type") == "array":
            option["items"].update(constraints)
