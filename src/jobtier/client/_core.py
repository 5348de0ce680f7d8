"""What the sync and async clients share: every operation, written once, without I/O.

An operation is a generator that yields *steps* (send this request, sleep this long, read the
next line of the open stream, hand this status to the caller) and receives each step's outcome
back: the ``httpx.Response``, the line; a transport error is thrown into it. ``Client`` and
``AsyncClient`` only drive them: retry, long-poll and reconnect exist once, no event loop.
"""

from __future__ import annotations

import random
import time
from collections.abc import Generator, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from importlib import metadata
from typing import Any, Generic, Protocol, TypeVar
from urllib.parse import quote

import httpx
import msgspec

from jobtier.client._errors import (
    ApiError,
    WaitTimeout,
    api_error,
    retry_after,
    unexpected,
)
from jobtier.client._types import (
    DeadLetter,
    FlowSubmission,
    JobDetails,
    JobPage,
    QueuePurged,
    Replayed,
    Result,
    Submission,
    batch_decoder,
    dead_letter_decoder,
    dead_letters_decoder,
    dependencies_decoder,
    encoder,
    flow_decoder,
    page_decoder,
    purged_decoder,
    queue_list_decoder,
    replayed_decoder,
    seconds,
    spec_seconds,
    task_list_decoder,
    unblocked_decoder,
)
from jobtier.core.model import (
    Dependency,
    FlowJob,
    JobSpec,
    JobStatus,
    LogLine,
    OnDependencyFailure,
    Priority,
    QueueInfo,
    QueueLimits,
    State,
    TaskAd,
    Transition,
    status_decoder,
)
from jobtier.core.schedule import Schedule, ScheduleSpec

try:
    USER_AGENT = f"jobtier-client/{metadata.version('jobtier')}"
except metadata.PackageNotFoundError:  # running from a source tree
    USER_AGENT = "jobtier-client"

# what the clients (jobtier.client) take from here: the steps, what the operations take and give
__all__ = [
    "BaseClient",
    "Call",
    "DeadLetter",
    "Dependency",
    "Emit",
    "FlowJob",
    "FlowSubmission",
    "JobDetails",
    "JobPage",
    "JobSpec",
    "JobStatus",
    "LogLine",
    "OnDependencyFailure",
    "Op",
    "Priority",
    "QueueInfo",
    "QueueLimits",
    "ReadLine",
    "Result",
    "Schedule",
    "ScheduleSpec",
    "Sleep",
    "State",
    "Submission",
    "TaskAd",
    "Transition",
    "kept",
]

T = TypeVar("T")
TransportT = TypeVar("TransportT", httpx.BaseTransport, httpx.AsyncBaseTransport)


# --- steps ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Call:
    """Send a request; the reply is the ``httpx.Response``. A ``stream`` response has its
    body unread when its status is 200 (read it with ``ReadLine``), read otherwise."""

    method: str
    path: str
    params: dict[str, str] | None = None
    headers: dict[str, str] | None = None
    content: bytes | None = None
    read_timeout: float | None = None  # None: the client's own
    stream: bool = False


@dataclass(frozen=True, slots=True)
class Sleep:
    seconds: float


@dataclass(frozen=True, slots=True)
class ReadLine:
    """The next line of the open stream; the reply is None at its end."""


@dataclass(frozen=True, slots=True)
class Emit:
    """Hand ``status`` to the caller (events); the reply is None."""

    status: JobStatus


Step = Call | Sleep | ReadLine | Emit
Op = Generator[Step, Any, T]
READ_LINE = ReadLine()


def kept(op: Op[T], into: list[T]) -> Op[None]:
    """``op``, its value appended to ``into``: a driver of statuses (events) runs any op."""
    into.append((yield from op))


# --- helpers --------------------------------------------------------------------------------
def path(prefix: str, name: str, suffix: str = "") -> str:
    return f"{prefix}/{quote(name, safe='')}{suffix}"


def job_path(job_id: str, suffix: str = "") -> str:
    if not job_id:
        raise ValueError("job_id is empty")
    return path("/v1/jobs", job_id, suffix)


def json_call(method: str, where: str, body: Any) -> Call:
    headers = {"content-type": "application/json"}
    return Call(method, where, headers=headers, content=encoder.encode(body))


class NamedTask(Protocol):
    """A jobtier task (``@task``), submitted by its name."""

    @property
    def name(self) -> str: ...


def type_name(type: str | NamedTask) -> str:
    """The type a submit names: a task's name, or a task's own (the API applies what its
    workers advertise of it, as for its name)."""
    if isinstance(type, str):
        return type
    name = getattr(type, "name", None)
    if isinstance(name, str) and hasattr(type, "infos"):
        return name
    raise TypeError(f"type must be a task's name or a jobtier task, not {type!r:.100}")


def present(**fields: Any) -> dict[str, Any]:
    """The fields that are not None."""
    return {name: value for name, value in fields.items() if value is not None}


def time_param(value: datetime | str) -> str:
    """A time for a query or a body: ISO 8601 (the server takes one without a zone as UTC)."""
    return value.isoformat() if isinstance(value, datetime) else value


def query(**fields: Any) -> dict[str, str]:
    """Query parameters: the fields that are not None, as text."""
    fields = present(**fields)
    return {k: time_param(v) if isinstance(v, datetime) else str(v) for k, v in fields.items()}


def check(response: httpx.Response, *, job_id: str = "", key: str = "") -> None:
    """Raise the ``ApiError`` for an error answer."""
    if not 200 <= response.status_code < 300:
        raise api_error(
            response.status_code, response.content, response.headers, job_id=job_id, key=key
        )


def decode(decoder: msgspec.json.Decoder[T], data: bytes | str, what: str, status: int) -> T:
    """``data`` decoded; an ``ApiError`` naming ``what`` if it is not one."""
    try:
        return decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise unexpected(status, f"not {what}: {exc}") from None


def submission(status: int, doc: bytes) -> Submission:
    return Submission(decode(status_decoder, doc, "a status document", status), status == 202)


def fetch(call: Call, decoder: msgspec.json.Decoder[T], what: str, job_id: str = "") -> Op[T]:
    """Send ``call``: its answer decoded, or the ``ApiError`` it is."""
    response: httpx.Response = yield call
    check(response, job_id=job_id)
    return decode(decoder, response.content, what, response.status_code)


def spec_key(spec: JobSpec | Mapping[str, Any]) -> str | None:
    key = spec.idempotency_key if isinstance(spec, JobSpec) else spec.get("idempotency_key")
    return key if isinstance(key, str) and key else None


def _flow_job(job: FlowJob | Mapping[str, Any]) -> FlowJob | Mapping[str, Any]:
    """A mapping's ``callback`` may be a bare URL, as ``submit``'s may; a ``delay`` a
    ``timedelta``, sent as seconds."""
    if isinstance(job, FlowJob):
        delay = seconds(job.delay)
        return job if delay is job.delay else msgspec.structs.replace(job, delay=delay)
    if isinstance(job.get("callback"), str):
        job = {**job, "callback": {"url": job["callback"]}}
    return {**job, "delay": seconds(job["delay"])} if "delay" in job else job


class SSEParser:
    """Server-Sent Events, line by line (the WHATWG event-stream rules we need)."""

    __slots__ = ("_data", "_event", "_id", "retry")

    def __init__(self) -> None:
        self._data: list[str] = []
        self._event = ""
        self._id: str | None = None
        self.retry: float | None = None  # seconds, when the server sent ``retry:``

    def feed(self, line: str) -> tuple[str, str, str | None] | None:
        """(event, data, id) when ``line`` completes an event, else None."""
        if not line:
            if not self._data:
                self._event = ""
                return None
            event = (self._event or "message", "\n".join(self._data), self._id)
            self._data.clear()
            self._event = ""
            return event
        if line.startswith(":"):
            return None  # a comment: the server's heartbeat
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._id = value
        elif name == "retry" and value.isdigit():
            self.retry = int(value) / 1000
        return None


# --- the operations -------------------------------------------------------------------------
class BaseClient(Generic[TransportT]):
    """Configuration and the operations; ``Client`` and ``AsyncClient`` add the I/O."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        timeout: float | httpx.Timeout = 10.0,
        transport: TransportT | None = None,
        retries: int = 3,
        retry_unkeyed: bool = False,
        max_retry_wait: float = 30.0,
        reconnects: int = 5,
        stream_timeout: float = 60.0,
    ) -> None:
        """``timeout`` (seconds or an ``httpx.Timeout``) bounds each request; ``retries`` of
        a submit refused with 429/503, after ``Retry-After`` (capped at ``max_retry_wait``),
        only when every job carries an idempotency key unless ``retry_unkeyed``;
        ``reconnects`` of an event stream in a row without an event; ``stream_timeout``, the
        longest silence on an event stream before it counts as dropped; ``transport`` for
        httpx (tests, proxies)."""
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)
        self.retries = retries
        self.retry_unkeyed = retry_unkeyed
        self.max_retry_wait = max_retry_wait
        self.reconnects = reconnects
        self.stream_timeout = stream_timeout
        headers = {"authorization": f"Bearer {api_key}", "accept": "application/json"}
        headers["user-agent"] = USER_AGENT
        self._open(
            base_url=self.base_url, headers=headers, timeout=self.timeout, transport=transport
        )

    def _open(self, **options: Any) -> None:
        """Make the httpx client (``self._http``)."""
        raise NotImplementedError

    def _request(self, http: httpx.Client | httpx.AsyncClient, call: Call) -> httpx.Request:
        t = self.timeout
        if call.read_timeout is not None:
            t = httpx.Timeout(connect=t.connect, read=call.read_timeout, write=t.write, pool=t.pool)
        return http.build_request(
            call.method,
            call.path,
            params=call.params,
            headers=call.headers,
            content=call.content,
            timeout=t,
        )

    def _retrying(self, call: Call, safe: bool) -> Op[httpx.Response]:
        """Send ``call``; when ``safe``, again after a 429 or 503, once ``Retry-After`` has
        passed (without it: jittered exponential back-off). A ``Retry-After`` longer than
        ``max_retry_wait`` is not waited for: the caller gets the error.

        Only submits use it: a 429/503 from jobtier means nothing was done, but one from a
        proxy might come after the server acted, so a resend is safe only when an idempotency
        key makes a duplicate harmless (or the caller said ``retry_unkeyed``).
        """
        attempt = 0
        while True:
            response: httpx.Response = yield call
            if (
                response.status_code not in (429, 503)
                or not (safe or self.retry_unkeyed)
                or attempt >= self.retries
            ):
                return response
            wait = retry_after(response.headers)
            if wait is None:
                wait = random.uniform(0, min(self.max_retry_wait, 0.5 * 2**attempt))
            elif wait > self.max_retry_wait:
                return response
            attempt += 1
            yield Sleep(wait)

    def _submit(
        self,
        type: str | NamedTask,
        payload: Any,
        priority: Priority | str,
        run_at: datetime | None,
        delay: float | None,
        max_attempts: int | None,
        idempotency_key: str | None,
        queue: str | None,
        concurrency_key: str | None,
        concurrency_limit: int | None,
        depends_on: Iterable[str] | None,
        on_dependency_failure: OnDependencyFailure | None,
        callback: str | Mapping[str, Any] | None,
        keyed: Mapping[str, Any],  # debounce, throttle, unique; expires_at or expires_in; timeout
    ) -> Op[Submission]:
        body = {
            "type": type_name(type),
            "payload": payload,
            "priority": priority,
            **keyed,
        } | present(
            callback={"url": callback} if isinstance(callback, str) else callback,
            queue=queue,
            concurrency_key=concurrency_key,
            concurrency_limit=concurrency_limit,
            depends_on=None if depends_on is None else list(depends_on),
            on_dependency_failure=on_dependency_failure,
            run_at=run_at,
            delay=delay,
            max_attempts=max_attempts,
            idempotency_key=idempotency_key,
        )
        call = json_call("POST", "/v1/jobs", body)
        response = yield from self._retrying(call, safe=idempotency_key is not None)
        check(response, key=idempotency_key or "")
        return submission(response.status_code, response.content)

    def _submit_many(
        self, specs: Iterable[JobSpec | Mapping[str, Any]]
    ) -> Op[list[Submission | ApiError]]:
        jobs = [spec_seconds(spec) for spec in specs]
        if not jobs:
            return []
        keys = [spec_key(spec) for spec in jobs]
        call = json_call("POST", "/v1/jobs/batch", {"jobs": jobs})
        response = yield from self._retrying(call, safe=all(keys))
        check(response)
        status = response.status_code
        items = decode(batch_decoder, response.content, "a batch answer", status).results
        if len(items) != len(jobs):
            raise unexpected(status, f"{len(items)} results for {len(jobs)} jobs")
        out: list[Submission | ApiError] = []
        for item, key in zip(items, keys, strict=True):
            if item.job:
                try:
                    out.append(submission(item.status, bytes(item.job)))
                except ApiError as exc:
                    out.append(exc)
            else:
                problem = encoder.encode(item.problem or {})
                out.append(api_error(item.status, problem, {}, key=key or ""))
        return out

    def _submit_flow(
        self, jobs: Iterable[FlowJob | Mapping[str, Any]], idempotency_key: str | None
    ) -> Op[FlowSubmission]:
        body = {"jobs": [_flow_job(job) for job in jobs]}
        body |= present(idempotency_key=idempotency_key)
        call = json_call("POST", "/v1/flows", body)
        response = yield from self._retrying(call, safe=idempotency_key is not None)
        check(response, key=idempotency_key or "")
        return decode(flow_decoder, response.content, "a flow answer", response.status_code)

    def _dependencies(self, job_id: str) -> Op[list[Dependency]]:
        call = Call("GET", job_path(job_id, "/dependencies"))
        found = yield from fetch(call, dependencies_decoder, "a dependency list", job_id)
        return found.dependencies

    def _status(
        self, job_id: str, if_version: int | None = None, wait: float = 0.0
    ) -> Op[JobStatus | None]:
        where = job_path(job_id)
        if if_version is None:
            if wait:
                raise ValueError("wait needs if_version: the version to wait past")
            call = Call("GET", where)
        else:
            params = {"wait": f"{wait:.3f}"} if wait > 0 else None
            read = None
            if wait > 0 and self.timeout.read is not None:
                read = self.timeout.read + wait  # the server holds the answer up to ``wait``
            headers = {"if-none-match": f'"{if_version}"'}
            call = Call("GET", where, params, headers, read_timeout=read)
        response: httpx.Response = yield call
        if if_version is not None and response.status_code == 304:
            return None
        check(response, job_id=job_id)
        return decode(status_decoder, response.content, "a status document", response.status_code)

    def _wait(self, job_id: str, timeout: float | None, poll: float) -> Op[JobStatus]:
        deadline = None if timeout is None else time.monotonic() + timeout
        status = yield from self._status(job_id)
        assert status is not None
        while not status.terminal:
            wait = poll
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WaitTimeout(job_id, status)
                wait = min(poll, left)
            newer = yield from self._status(job_id, status.version, wait)
            if newer is not None:
                status = newer
        return status

    def _job_action(self, job_id: str, action: str, body: Any = None) -> Op[JobStatus]:
        where = job_path(job_id, f"/{action}")
        call = Call("POST", where) if body is None else json_call("POST", where, body)
        return (yield from fetch(call, status_decoder, "a status document", job_id))

    # --- looking into jobs (tenant key) ---------------------------------------------------
    def _list_jobs(
        self,
        state: State | str | None,
        type: str | None,
        queue: str | None,
        created_after: datetime | str | None,
        cursor: str | None,
        limit: int,
        order: str,
    ) -> Op[JobPage]:
        params = query(limit=limit, order=order, state=state, type=type, queue=queue)
        params |= query(cursor=cursor, created_after=created_after)
        call = Call("GET", "/v1/jobs", params=params)
        return (yield from fetch(call, page_decoder, "a page of jobs"))

    # --- dead letters (admin key) -----------------------------------------------------------
    def _dead_letters(
        self, type: str | None, since: datetime | str | None, limit: int
    ) -> Op[list[JobStatus]]:
        params = query(limit=limit, type=type, since=since)
        call = Call("GET", "/v1/admin/dead-letters", params=params)
        return (yield from fetch(call, dead_letters_decoder, "a dead-letter list")).jobs

    def _dead_letter(self, job_id: str) -> Op[DeadLetter]:
        call = Call("GET", path("/v1/admin/dead-letters", job_id))
        return (yield from fetch(call, dead_letter_decoder, "a dead letter", job_id))

    def _replay(self, job_id: str) -> Op[JobStatus]:
        call = Call("POST", path("/v1/admin/dead-letters", job_id, "/replay"))
        return (yield from fetch(call, status_decoder, "a status document", job_id))

    def _replay_dead_letters(
        self, type: str | None, since: datetime | str | None, limit: int, every: bool
    ) -> Op[Replayed]:
        body = present(limit=limit, type=type, since=since and time_param(since), all=every or None)
        call = json_call("POST", "/v1/admin/dead-letters/replay", body)
        answer = yield from fetch(call, replayed_decoder, "a replay answer")
        out = Replayed(answer.replayed)
        out.skipped = answer.skipped
        return out

    # --- queues (admin key) ----------------------------------------------------------------
    def _queues(self) -> Op[list[QueueInfo]]:
        call = Call("GET", "/v1/admin/queues")
        return (yield from fetch(call, queue_list_decoder, "a queue list")).queues

    def _queue_action(self, name: str, action: str, limits: QueueLimits | None = None) -> Op[None]:
        where = path("/v1/admin/queues", name, f"/{action}")
        call = Call("POST", where) if limits is None else json_call("PUT", where, limits)
        response: httpx.Response = yield call
        check(response)

    def _unblock_queue(self, name: str) -> Op[float | None]:
        call = Call("POST", path("/v1/admin/queues", name, "/unblock"))
        return (yield from fetch(call, unblocked_decoder, "an unblock")).blocked_until

    def _purge_queue(self, name: str) -> Op[QueuePurged]:
        call = Call("POST", path("/v1/admin/queues", name, "/purge"))
        return (yield from fetch(call, purged_decoder, "a purge"))

    def _tasks(self) -> Op[list[TaskAd]]:
        call = Call("GET", "/v1/admin/tasks")
        return (yield from fetch(call, task_list_decoder, "a task list")).tasks

    def _events(self, job_id: str, last_event_id: int | str | None) -> Op[None]:
        """Stream the job's statuses until a terminal one; resume after a dropped connection
        with ``Last-Event-ID``, up to ``reconnects`` times in a row without an event."""
        where = job_path(job_id, "/events")
        last = None if last_event_id is None else str(last_event_id)
        failures = 0
        delay = 1.0  # until the server's ``retry:`` says otherwise
        while True:
            error: httpx.TransportError | None = None
            try:
                headers = {"accept": "text/event-stream", "cache-control": "no-cache"}
                if last is not None:
                    headers["last-event-id"] = last
                # stream_timeout: well above the server's heartbeat interval
                response: httpx.Response = yield Call(
                    "GET", where, headers=headers, read_timeout=self.stream_timeout, stream=True
                )
                if response.status_code == 204:
                    return  # we already hold the final status
                check(response, job_id=job_id)
                parser = SSEParser()
                while (line := (yield READ_LINE)) is not None:
                    event = parser.feed(line)
                    if parser.retry is not None:
                        delay = parser.retry
                    if event is None or event[0] != "status":
                        continue
                    status = decode(status_decoder, event[1], "a status event", 200)
                    last = event[2] if event[2] is not None else str(status.version)
                    failures = 0
                    yield Emit(status)
                    if status.terminal:
                        return
            except httpx.TransportError as exc:
                error = exc
            # the stream dropped (or ended early) before a terminal state: resume
            failures += 1
            if failures > self.reconnects:
                if error is not None:
                    raise error
                raise httpx.RemoteProtocolError(
                    f"the event stream of job {job_id} ended {failures} times before a "
                    "terminal state"
                )
            yield Sleep(delay * random.uniform(1.0, 1.5) * min(failures, 4))
