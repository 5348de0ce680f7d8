"""HTTP helpers shared by the API's routes: path ids, a job's transitions, and reading a
JSON body with its limits and problem documents."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import msgspec.inspect
import orjson
from starlette.requests import Request
from starlette.responses import Response

from jobtier.api.auth import raw_header, tenant_of
from jobtier.api.bounds import check_depth, too_deep
from jobtier.api.problems import Problem, not_found
from jobtier.core.batch_model import BatchSpec
from jobtier.core.errors import InvalidRequest, JobNotFound, PayloadTooLarge, TransitionRefused
from jobtier.core.model import CallbackSpec, FlowSpec, JobSpec
from jobtier.status.answer import DocResponse

if TYPE_CHECKING:
    from jobtier.engine.control import JobControl
    from jobtier.engine.produce import Registrar
from jobtier.engine.queue import Queue

JSON = "application/json"


def encoded(value: Any, status: int = 200) -> Response:
    """A JSON answer: ``value`` (a Struct, or what msgspec encodes) encoded."""
    return Response(msgspec.json.encode(value), status, media_type=JSON)


def doc_state(doc: bytes) -> str:
    start = doc.find(b'"state":"') + 9
    return doc[start : doc.find(b'"', start)].decode()


# --- path ids -------------------------------------------------------------------------------
def job_id_of(request: Request) -> str:
    """The ``{job_id}`` of the path, checked before any backend is asked: a malformed id (a
    NUL, a foreign shard, …) is answered like an unknown one, a 404, as the status read does
    (Postgres would refuse some of them outright)."""
    job_id: str = request.path_params["job_id"]
    if not request.state.queue.keys.valid_id(job_id):
        raise job_not_found(job_id)
    return job_id


def path_id(request: Request, name: str, pattern: re.Pattern[str], what: str) -> str:
    """The ``{name}`` of the path; one that does not match ``pattern`` is a 404, as an unknown
    ``what`` is."""
    value: str = request.path_params[name]
    if not pattern.fullmatch(value):
        raise not_found(f"{what} {value[:40]}")
    return value


def job_not_found(job_id: str) -> Problem:
    return not_found(f"job {job_id[:64]}")


Change = Callable[["JobControl", str, str | None], Awaitable[bytes]]
Refused = Callable[[str, str], str]  # (job id, its state) -> why the change is refused


async def transition(
    queue: Queue, job_id: str, tenant: str | None, change: Change, refused: Refused
) -> bytes:
    """The job's status document after ``change(jobs, job_id, tenant)`` (``tenant`` None: any
    tenant's job). An unknown job (or another tenant's) is a 404, and a job whose state does
    not allow the change a 409 ``wrong-state`` whose detail is ``refused(job_id, state)``,
    with the job's status document."""
    try:
        return await change(queue.jobs, job_id, tenant)
    except JobNotFound:
        raise job_not_found(job_id) from None
    except TransitionRefused as exc:
        try:
            current = await queue.jobs.status_doc(job_id, tenant)
        except JobNotFound:  # expired between the two reads
            raise job_not_found(job_id) from None
        detail = exc.reason or refused(job_id, doc_state(current))
        if exc.holder is not None:  # a replay of a unique job whose key another job holds
            job = orjson.loads(current)
            raise Problem(409, "unique-held", detail, job=job, holder=exc.holder) from exc
        raise Problem(409, "wrong-state", detail, job=orjson.loads(current)) from exc


async def job_transition(
    request: Request, change: Change, refused: Refused, *, cancel: bool = False
) -> Response:
    """``transition`` of the tenant's job, the change a client asks of it (cancel, retry)
    (``outbox_transition``)."""
    doc = await outbox_transition(
        request, job_id_of(request), tenant_of(request), change, refused, cancel=cancel
    )
    return DocResponse(doc)


async def outbox_transition(
    request: Request,
    job_id: str,
    tenant: str | None,
    change: Change,
    refused: Refused,
    *,
    cancel: bool,
) -> bytes:
    """``transition`` of the job (the tenant's; any tenant's with None: the console). A job
    Redis does not hold that only the outbox does (submitted with SQL and not relayed yet, or
    refused or cancelled there) is not a 404: it exists. A ``cancel`` of one not relayed yet
    cancels its row, which the relay then never takes; any other change of it is a 409 saying
    it has not run, and of a refused or cancelled one a 409 saying it has finished."""
    queue = request.state.queue
    try:
        return await transition(queue, job_id, tenant, change, refused)
    except Problem as problem:
        outbox = getattr(request.state, "outbox_doc", None)
        if problem.status != 404 or outbox is None or not (doc := await outbox(job_id, tenant)):
            raise
        lost = problem
    _refuse_ended(job_id, doc, refused)
    if not cancel:
        detail = (
            f"job {job_id} is still in the outbox: the relay has not taken it into Redis yet, "
            "and it has not run"
        )
        raise Problem(409, "not-relayed-yet", detail, job=orjson.loads(doc)) from None
    cancelled: bytes | None = await request.state.outbox_cancel(job_id, tenant)
    # None: a relay took the row meanwhile (the cancel waited for its lock), and the job is in
    # Redis. Either way Redis is asked again: a relay whose Redis submit ran and whose mark of
    # the row failed leaves the job in Redis and the row to be taken again
    try:
        return await transition(queue, job_id, tenant, change, refused)
    except Problem as problem:
        if problem.status != 404:
            raise
    if cancelled is not None:
        return cancelled
    # neither has it: its row ended while the cancel waited (refused, or another cancel won)
    if ended := await outbox(job_id, tenant):
        _refuse_ended(job_id, ended, refused)
    raise lost


def _refuse_ended(job_id: str, doc: bytes, refused: Refused) -> None:
    """A 409 for an outbox row that has ended without reaching Redis: refused by the relay, or
    cancelled before it."""
    state = doc_state(doc)
    if state == "failed":  # refused by the relay: for good
        detail = (
            f"job {job_id} was refused by the outbox relay and never reached Redis (its error "
            "says why): there is nothing to change; submit it again once the cause is mended"
        )
        raise Problem(409, "wrong-state", detail, job=orjson.loads(doc))
    if state != "submitted":  # cancelled before its relay
        raise Problem(409, "wrong-state", refused(job_id, state), job=orjson.loads(doc))


def finished(job_id: str, state: str) -> str:
    """Why a cancel is refused."""
    return f"job {job_id} has already finished ({state})"


def not_scheduled(job_id: str, state: str) -> str:
    """Why a promote is refused."""
    return f"job {job_id} is {state}, not scheduled: only a scheduled job is promoted"


# --- body reading ---------------------------------------------------------------------------
def _json_media_type(content_type: bytes) -> bool:
    """``application/json`` or a structured ``application/*+json`` type (RFC 6839)."""
    media = content_type.split(b";")[0].strip().lower()
    return media == b"application/json" or (
        media.startswith(b"application/") and media.endswith(b"+json") and b"/" not in media[12:]
    )


async def read_json_body(request: Request) -> bytes:
    """The request body, at most ``JOBTIER_MAX_REQUEST_BYTES`` (a 413 problem past it, said
    before reading when Content-Length tells), of a JSON media type (else 415)."""
    content_type = raw_header(request, b"content-type")
    if content_type is not None and not _json_media_type(content_type):
        raise Problem(
            415,
            "unsupported-media-type",
            "send the body as application/json (or an application/*+json type)",
        )
    limit: int = request.state.settings.max_request_bytes
    length = raw_header(request, b"content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise body_too_large(limit)
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def body_too_large(limit: int) -> Problem:
    return Problem(
        413,
        "payload-too-large",
        f"the body is over the limit of {limit} bytes (JOBTIER_MAX_REQUEST_BYTES)",
    )


def decode_body(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    """The body decoded (and validated) by ``decoder``: a 400 problem for malformed JSON, a
    422 naming the member for one that does not fit (with the valid values of an enum)."""
    if not body:
        raise Problem(400, "invalid-json", "the request has no body; send a JSON object")
    check_depth(body)
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        # msgspec names the offending member: "... - at `$.jobs[1].priority`"
        message = str(exc)
        _, at, path = message.rpartition(" - at `$")
        field = path.rstrip("`").lstrip(".") if at and path.strip("`") else None
        # a member missing or unknown: the object's path is where it is, the member is the field
        if named := _NAMED_MEMBER.match(message):
            field = f"{field}.{named.group(1)}" if field else named.group(1)
        if field and message.startswith("Invalid enum value"):
            values = enum_values(decoder.type, field)
            if values:
                message = f"{field} must be one of {', '.join(map(str, values))}; {message}"
        extra: dict[str, Any] = {"field": field} if field else {}
        raise Problem(422, "validation", message, **extra) from None
    except msgspec.DecodeError as exc:
        raise Problem(
            400, "invalid-json", f"the body is not valid JSON: {_why(body, exc)}"
        ) from None
    except RecursionError:
        raise too_deep() from None


def _why(body: bytes, exc: msgspec.DecodeError) -> str:
    """msgspec's reason, unless it says "truncated" of a body that may not be: a lone
    surrogate escape (``"\\ud800"`` with no low half after it) reads so to msgspec, and
    orjson names it, with where it is."""
    message = str(exc)
    if "truncated" in message:
        try:
            orjson.loads(body)
        except orjson.JSONDecodeError as precise:
            return str(precise)
    return message


_NAMED_MEMBER = re.compile(r"Object (?:missing required|contains unknown) field `([^`]+)`")
_PATH_PART = re.compile(r"\.?([A-Za-z_][A-Za-z0-9_]*)|\[([0-9]+)\]")


def enum_values(type_: Any, field: str) -> list[Any]:
    """The valid values of the enum (or literal) at ``field`` (msgspec's path, e.g.
    ``jobs[1].priority``) of a decoder's type; empty if it is not one."""
    info: Any = msgspec.inspect.type_info(type_)
    for name, index in _PATH_PART.findall(field):
        info = _member(info, name, bool(index))
        if info is None:
            return []
    for option in info.types if isinstance(info, msgspec.inspect.UnionType) else [info]:
        if isinstance(option, msgspec.inspect.EnumType):
            return [member.value for member in option.cls]
        if isinstance(option, msgspec.inspect.LiteralType):
            return list(option.values)
    return []


def _member(info: Any, name: str, item: bool) -> Any:
    for option in info.types if isinstance(info, msgspec.inspect.UnionType) else [info]:
        if item and isinstance(option, msgspec.inspect.ListType | msgspec.inspect.VarTupleType):
            return option.item_type
        if not item and isinstance(option, msgspec.inspect.StructType):
            return next((f.type for f in option.fields if f.encode_name == name), None)
    return None


def invalid(exc: InvalidRequest) -> Problem:
    """The problem for a request the queue refused: 413 for a payload over
    ``JOBTIER_MAX_PAYLOAD_BYTES``, else 422."""
    extra: dict[str, Any] = {"field": exc.field} if exc.field else {}
    if isinstance(exc, PayloadTooLarge):
        return Problem(413, "payload-too-large", str(exc), **extra)
    return Problem(422, "validation", str(exc), **extra)


# --- submits -------------------------------------------------------------------------------
Submit = TypeVar("Submit", JobSpec, FlowSpec, BatchSpec)


async def submit_body(request: Request, decoder: msgspec.json.Decoder[Submit]) -> Submit:
    """A submit's body, its idempotency key the ``Idempotency-Key`` header's or the body's
    ``idempotency_key``; both given and different is a 400."""
    body: Submit = decode_body(decoder, await read_json_body(request))
    header = raw_header(request, b"idempotency-key")
    if header is not None:
        key = header.decode("latin-1")
        if body.idempotency_key not in (None, key):
            raise Problem(
                400,
                "bad-request",
                "the Idempotency-Key header and the body's idempotency_key differ",
                field="idempotency_key",
            )
        body.idempotency_key = key
    return body


def registrar(
    request: Request, callbacks: Sequence[CallbackSpec | None], prefix: str
) -> Registrar | None:
    """What writes a submit's callbacks before it: the API's webhook service. Without its
    Postgres part the API has none, and refuses the first callback given (a 422 naming it,
    ``prefix`` formatted with its index)."""
    service: Registrar | None = getattr(request.state, "webhooks", None)
    first = next((i for i, cb in enumerate(callbacks) if cb is not None), None)
    if service is None and first is not None:
        detail = "callbacks need the API's Postgres part, which this API runs without"
        raise Problem(422, "validation", detail, field=f"{prefix.format(first)}callback.url")
    return service


async def repeat_doc(request: Request, job_id: str, tenant: str, gone: str) -> bytes:
    """The status document of a repeated submit's job that Redis no longer keeps (Postgres
    may); a 410 whose detail is ``gone`` when nothing does."""
    found = await request.state.reader.get_for(job_id, tenant)
    if found is None:
        raise Problem(410, "gone", gone, job_id=job_id)
    return bytes(found[1])
