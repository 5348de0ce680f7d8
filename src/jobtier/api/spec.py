"""The building blocks of the OpenAPI document (``openapi.py`` assembles it): response
bodies, parameters, answers, and ``operation()``, which gives each operation the error
answers the server gives for what it does. Route modules declare their routes with these
(``Paths``: each endpoint with its description)."""

from __future__ import annotations

import functools
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from jobtier.api.bounds import MAX_HEADER_BYTES, MAX_HEADERS, MAX_URL_BYTES
from jobtier.api.params import Param, parse_query
from jobtier.config import Settings
from jobtier.core.json_depth import MAX_JSON_DEPTH
from jobtier.core.model import JobStatus, QueueInfo, QueueLimits, TaskAd
from jobtier.core.names import (
    IDEMPOTENCY_KEY_RE,
    JOB_ID_RE,
    QUEUE_NAME_RE,
    ULID_RE,
    WEBHOOK_ID_RE,
)


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
    # a durable submit not confirmed in time (Jobtier-Replicas): how many replicas did, of how many
    replicas_confirmed: int | None = None
    replicas_wanted: int | None = None


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


class SkippedReplay(msgspec.Struct):
    """A dead letter a replay by filter passed over: ``why`` "unique-held", its unique key
    held by job ``holder`` (replay it once that job has finished)."""

    id: str
    holder: str
    why: str


class Replayed(msgspec.Struct):
    replayed: list[str]
    count: int
    skipped: list[SkippedReplay]


class QueueList(msgspec.Struct):
    queues: list[QueueInfo]


class QueuePaused(msgspec.Struct):
    queue: str
    paused: bool
    # the listing had the queue (jobs, limits or a task named it): false for a typo; null
    # when the listing could not be read (the pause or resume was made all the same)
    known: bool | None


class QueueUnblocked(msgspec.Struct):
    queue: str
    blocked_until: float | None  # the end of the block lifted (epoch s); null: none was set


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
    data_schema = {"type": "string", "contentMediaType": "application/json", "contentSchema": data}
    schema = {
        "type": "object",
        "required": ["event", "data"],
        "properties": {
            "event": {"const": event},
            "id": {"type": "string", "pattern": "^[0-9]+$"},
            "data": data_schema,
        },
    }
    return {"description": description, "content": {"text/event-stream": {"schema": schema}}}


def content(description: str, media_type: str, schema: Any, headers: Any = None) -> dict[str, Any]:
    """An answer with a body of ``media_type``."""
    answer = {"description": description, "content": {media_type: {"schema": schema}}}
    return {**answer, "headers": headers} if headers else answer


def problem(description: str, headers: Any = None) -> dict[str, Any]:
    return content(description, "application/problem+json", ref("Problem"), headers)


Answer = tuple[int, dict[str, Any]]  # an answer of an operation and its status


def returns(status: int, schema: str, description: str, headers: Any = None) -> Answer:
    """A JSON answer whose body is the component ``schema``."""
    return status, content(description, "application/json", ref(schema), headers)


def page(schema: str, cursor: str = "next_cursor") -> Answer:
    """A page of a listing, whose ``cursor`` member asks for the next."""
    return returns(200, schema, f"a page; {cursor} is null on the last")


def refuses(status: int, description: str, headers: Any = None) -> Answer:
    """A problem document answer."""
    return status, problem(description, headers)


def header(description: str, *, required: bool = False, pattern: str | None = None) -> Any:
    schema: dict[str, Any] = {"type": "string"}
    if pattern:
        schema["pattern"] = pattern
    return {"description": description, "required": required, "schema": schema}


def path_param(name: str, description: str, pattern: re.Pattern[str]) -> dict[str, Any]:
    schema = {"type": "string", "pattern": pattern.pattern}
    return {
        "name": name,
        "in": "path",
        "required": True,
        "description": description,
        "schema": schema,
    }


def unknown(what: str, *, tenants: bool = True) -> Answer:
    """The 404 of an id naming no ``what``: one malformed too, and, on a tenant's routes,
    another tenant's."""
    others = "another tenant's, or " if tenants else ""
    return refuses(404, f"unknown {what} (or {others}a malformed id)")


RETRY_AFTER = {"Retry-After": header("seconds to wait before trying again", pattern="^[0-9]+$")}
# every path parameter by name: Paths.add describes those its path has
PATH_PARAMS = {
    "job_id": path_param(
        "job_id", "a job id as submit returned it (a malformed or unknown one is a 404)", JOB_ID_RE
    ),
    "name": path_param("name", "a queue name", QUEUE_NAME_RE),
    "batch_id": path_param(
        "batch_id",
        "a batch id as submit returned it (a malformed or unknown one is a 404)",
        JOB_ID_RE,
    ),
    "schedule_id": path_param(
        "schedule_id", "a schedule id (a malformed or unknown one is a 404)", ULID_RE
    ),
    "webhook_id": path_param(
        "webhook_id", "a subscription id (a malformed or unknown one is a 404)", WEBHOOK_ID_RE
    ),
}
JOB_404 = unknown("job")
# an encrypted value the API cannot open (docs/encryption.md), for the tenant's routes
SEALED = (
    refuses(500, "an encrypted value fails authentication (type …:encryption; job_id)"),
    refuses(
        503,
        "Redis or Postgres is unavailable; try again — or an encrypted value this server "
        "lacks the key of (type …:encryption-keys-missing; job_id)",
        RETRY_AFTER,
    ),
)
BAD_QUEUE_NAME = refuses(422, "a queue name that breaks its pattern")
DELETED: Answer = (204, {"description": "deleted"})

Auth = Literal["tenant", "admin", "worker", "none"]

# a callback URL (a submit's callback, a subscription's url): webhooks/safety.py checks the rest
CALLBACK_URL = r"^https?://[^\s]+$"
IDEMPOTENCY_KEY = {
    "name": "Idempotency-Key",
    "in": "header",
    "description": "the body's idempotency_key, as a header (both given: the same)",
    "schema": {"type": "string", "pattern": IDEMPOTENCY_KEY_RE.pattern},
}


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
    # a query parameter is refused, never ignored: one the operation takes but malformed or
    # repeated, one it does not take (parse_query; Paths.add where it takes none)
    query = (
        "a query parameter unknown, repeated or malformed (field)"
        if params
        else "a query parameter, which this operation does not take (field)"
    )
    errors["400"] = problem(query)
    if body is not None:
        out["requestBody"] = {
            "required": body_required,
            "description": (
                f"JSON, at most {settings.max_request_bytes} bytes (JOBTIER_MAX_REQUEST_BYTES), "
                f"arrays and objects nested at most {MAX_JSON_DEPTH} deep"
            ),
            "content": {"application/json": {"schema": ref(body)}},
        }
        errors["400"] = problem(f"malformed JSON, or no body; or {query}")
        errors["413"] = too_large(settings)
        errors["415"] = problem("the body is not application/json (or application/*+json)")
        errors["422"] = problem(
            "the body does not fit its schema, or breaks a rule it cannot state "
            "(run_at in the past, cron syntax, time zone name, a depends_on naming no job "
            "of yours that Redis keeps, …); field names the member"
        )
    if auth != "none":
        unauthorized = {"WWW-Authenticate": header("Bearer realm")}
        errors["401"] = problem("missing or unknown API key", unauthorized)
    out["security"] = {
        "tenant": [{"tenantKey": []}],
        "admin": [{"adminKey": []}],
        "worker": [{"workerKey": []}],
        "none": [],
    }[auth]
    if auth == "admin":
        errors["403"] = problem("a tenant key on an admin route")
    elif auth == "worker":
        errors["403"] = problem("a tenant's or the admin key on a worker route")
    elif auth == "tenant":
        errors["403"] = problem("the admin key on a tenant's route (it is no tenant's key)")
    if backend:
        errors["503"] = problem("Redis or Postgres is unavailable; try again", RETRY_AFTER)
    out["responses"] = {**errors, **responses}
    if "400" in responses:  # the operation's own reasons, and the query's
        given = responses["400"]
        out["responses"]["400"] = {**given, "description": f"{given['description']}; or {query}"}
    return out


_PATH_PARAM = re.compile(r"{(\w+)}")
Endpoint = Callable[[Request], Awaitable[Response]]


def takes_no_query(endpoint: Endpoint) -> Endpoint:
    """``endpoint``, for an operation without query parameters: one given is refused (400
    naming it, as ``parse_query`` refuses a parameter its route does not take) rather than
    ignored: ``POST /v1/jobs?priority=high`` would queue a job of normal priority."""

    @functools.wraps(endpoint)
    async def checked(request: Request) -> Response:
        if request.scope["query_string"]:
            parse_query(request, ())
        return await endpoint(request)

    return checked


class Paths:
    """The operations of an API part, each declared once: ``add("GET /v1/…", endpoint,
    summary, *answers, **options)`` routes the method and path to ``endpoint`` and describes
    the operation (``operation``'s options; ``defaults`` apply to each; the path's parameters
    from ``PATH_PARAMS``)."""

    def __init__(self, settings: Settings, **defaults: Any) -> None:
        self.settings = settings
        self.defaults = defaults
        self.paths: dict[str, Any] = {}  # the document's
        self.endpoints: dict[str, dict[str, Endpoint]] = {}  # path -> method -> endpoint

    def add(
        self, route: str, endpoint: Endpoint, summary: str, *answers: Answer, **options: Any
    ) -> dict[str, Any]:
        """Add the operation and return it. An operation that declares no query parameters
        refuses any (``takes_no_query``); one that declares some reads them with
        ``parse_query``, which refuses those it does not declare."""
        method, path = route.split(" ")
        responses = {str(status): answer for status, answer in answers}
        options = {"path": [PATH_PARAMS[p] for p in _PATH_PARAM.findall(path)], **options}
        options = {**self.defaults, **options}
        if not options.get("params"):
            endpoint = takes_no_query(endpoint)
        op = operation(self.settings, summary, responses, **options)
        self.paths.setdefault(path, {})[method.lower()] = op
        self.endpoints.setdefault(path, {})[method] = endpoint
        return op

    def include(self, *parts: Paths) -> Paths:
        """Add the operations of ``parts``, in order (a path's after those it has)."""
        for part in parts:
            for path, item in part.paths.items():
                self.paths.setdefault(path, {}).update(item)
                self.endpoints.setdefault(path, {}).update(part.endpoints[path])
        return self


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
