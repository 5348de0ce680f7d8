"""What the sync and async clients share: every operation, written once, without I/O.

An operation is a generator that yields *steps* — send this request, sleep this long, read
the next line of the open stream, hand this status to the caller — and receives each step's
outcome back (the ``httpx.Response``, the line; a transport error is thrown into it). The
clients only drive them: ``Client`` with ``httpx.Client`` and ``time.sleep``, ``AsyncClient``
with ``httpx.AsyncClient`` and ``asyncio.sleep``. Retry, long-poll and reconnect logic thus
exist once, and the sync client never runs an event loop.
"""

from __future__ import annotations

import random
import time
from collections.abc import Generator, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from importlib import metadata
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
import msgspec

from jobtier.client._errors import (
    ApiError,
    NotFound,
    WaitTimeout,
    api_error,
    retry_after,
    unexpected,
)
from jobtier.core.model import (
    Dependency,
    FlowJob,
    JobError,
    JobSpec,
    JobStatus,
    LogLine,
    OnDependencyFailure,
    Priority,
    QueueInfo,
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

T = TypeVar("T")


class Submission(msgspec.Struct, frozen=True):
    """The outcome of a submit: the job's status, and whether this call created it.

    ``created`` is False for a duplicate: an earlier submit with the same idempotency key
    (and the same type and payload) made the job, and ``job`` is that job's status now.
    """

    job: JobStatus
    created: bool

    @property
    def id(self) -> str:
        return self.job.id


class FlowSubmission(msgspec.Struct, frozen=True):
    """The outcome of a flow submit: each job's status, in the order of the flow, and
    whether this call created the flow (False: a repeat of an earlier submit with the same
    idempotency key; ``jobs`` are then the flow's jobs as they are now)."""

    created: bool
    jobs: list[JobStatus]

    @property
    def ids(self) -> list[str]:
        return [job.id for job in self.jobs]


class _DependencyList(msgspec.Struct):
    id: str
    dependencies: list[Dependency]


class Result(msgspec.Struct, frozen=True):
    """``GET /v1/jobs/{id}/result``: ``result`` is the task's return value once the job has
    succeeded (else None); ``error`` says why it failed."""

    id: str
    state: State
    version: int
    result: Any = None
    error: JobError | None = None
    # the result kept outside Redis: where the server streams it (``result()`` follows it)
    result_url: str | None = None

    @property
    def terminal(self) -> bool:
        return self.state.terminal


class JobPage(msgspec.Struct, frozen=True):
    """A page of ``GET /v1/jobs`` (from Postgres): ``next_cursor`` for the next page (None on
    the last); ``lag`` says how far behind the write-behind is (``transitions``,
    ``seconds``): jobs changed within it may show an older state."""

    jobs: list[JobStatus]
    next_cursor: str | None
    lag: dict[str, float]


class JobDetails(msgspec.Struct, frozen=True):
    """Everything about one job (``show``): its status, its result (once succeeded), its
    history (None when the API has no Postgres), and its log lines (``ctx.log``)."""

    status: JobStatus
    result: Any
    history: list[Transition] | None
    lines: list[LogLine]


class DeadLetter(msgspec.Struct, frozen=True):
    """One dead-lettered job in full (admin): its status (the error and its traceback), its
    payload and its log lines."""

    job: JobStatus
    payload: Any
    lines: list[LogLine]


class _History(msgspec.Struct):
    transitions: list[Transition]


class _Logs(msgspec.Struct):
    lines: list[LogLine]


class _DeadLetters(msgspec.Struct):
    jobs: list[JobStatus]


class _Replayed(msgspec.Struct):
    replayed: list[str]


class _BatchItem(msgspec.Struct):
    status: int
    job: msgspec.Raw = msgspec.Raw()  # empty when absent; decoded by ``submission``
    problem: dict[str, Any] | None = None


class _BatchResults(msgspec.Struct):
    results: list[_BatchItem]


_batch_decoder = msgspec.json.Decoder(_BatchResults)
_page_decoder = msgspec.json.Decoder(JobPage)
_history_decoder = msgspec.json.Decoder(_History)
_logs_decoder = msgspec.json.Decoder(_Logs)
_dead_letters_decoder = msgspec.json.Decoder(_DeadLetters)
_dead_letter_decoder = msgspec.json.Decoder(DeadLetter)
_replayed_decoder = msgspec.json.Decoder(_Replayed)
_result_decoder = msgspec.json.Decoder(Result)
_flow_decoder = msgspec.json.Decoder(FlowSubmission)


def _flow_job(job: FlowJob | Mapping[str, Any]) -> FlowJob | Mapping[str, Any]:
    """A job of a flow as the body has it: a mapping's ``callback`` may be a bare URL, as
    ``submit``'s may."""
    if isinstance(job, FlowJob) or not isinstance(job.get("callback"), str):
        return job
    return {**job, "callback": {"url": job["callback"]}}


_dependencies_decoder = msgspec.json.Decoder(_DependencyList)
_encoder = msgspec.json.Encoder()


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


# --- helpers --------------------------------------------------------------------------------
def job_path(job_id: str, suffix: str = "") -> str:
    if not job_id:
        raise ValueError("job_id is empty")
    return f"/v1/jobs/{quote(job_id, safe='')}{suffix}"


def check(response: httpx.Response, *, job_id: str = "", key: str = "") -> None:
    """Raise the ``ApiError`` for an error answer."""
    if not 200 <= response.status_code < 300:
        raise api_error(
            response.status_code, response.content, response.headers, job_id=job_id, key=key
        )


def decode_status(response: httpx.Response) -> JobStatus:
    try:
        return status_decoder.decode(response.content)
    except msgspec.DecodeError as exc:
        raise unexpected(response.status_code, f"not a status document: {exc}") from None


def submission(status: int, doc: bytes, created: bool) -> Submission:
    try:
        return Submission(status_decoder.decode(doc), created)
    except msgspec.DecodeError as exc:
        raise unexpected(status, f"not a status document: {exc}") from None


def decode_as(decoder: msgspec.json.Decoder[T], response: httpx.Response, what: str) -> T:
    """The body decoded by ``decoder``; an ``ApiError`` naming ``what`` if it is not one."""
    try:
        return decoder.decode(response.content)
    except msgspec.DecodeError as exc:
        raise unexpected(response.status_code, f"not {what}: {exc}") from None


def time_param(value: datetime | str) -> str:
    """A time for a query parameter or a body: ISO 8601 (a datetime without a time zone is
    taken as UTC by the server)."""
    return value.isoformat() if isinstance(value, datetime) else value


def spec_key(spec: JobSpec | Mapping[str, Any]) -> str | None:
    key = spec.idempotency_key if isinstance(spec, JobSpec) else spec.get("idempotency_key")
    return key if isinstance(key, str) and key else None


class _QueueList(msgspec.Struct):
    queues: list[QueueInfo]


class _TaskList(msgspec.Struct):
    tasks: list[TaskAd]


_queue_list_decoder = msgspec.json.Decoder(_QueueList)
_task_list_decoder = msgspec.json.Decoder(_TaskList)


class _ScheduleList(msgspec.Struct):
    schedules: list[Schedule]
    next_after: str | None = None


_schedule_decoder = msgspec.json.Decoder(Schedule)
_schedule_list_decoder = msgspec.json.Decoder(_ScheduleList)


def _decode_schedule(response: httpx.Response) -> Schedule:
    try:
        return _schedule_decoder.decode(response.content)
    except msgspec.DecodeError as exc:
        raise unexpected(response.status_code, f"not a schedule: {exc}") from None


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
class BaseClient:
    """Configuration and the operations; ``Client`` and ``AsyncClient`` add the I/O."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        timeout: float | httpx.Timeout = 10.0,
        retries: int = 3,
        retry_unkeyed: bool = False,
        max_retry_wait: float = 30.0,
        reconnects: int = 5,
        stream_timeout: float = 60.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)
        self.retries = retries
        self.retry_unkeyed = retry_unkeyed
        self.max_retry_wait = max_retry_wait
        self.reconnects = reconnects
        self.stream_timeout = stream_timeout
        self._headers = {
            "authorization": f"Bearer {api_key}",
            "accept": "application/json",
            "user-agent": USER_AGENT,
        }

    def _http_options(self) -> dict[str, Any]:
        return {"base_url": self.base_url, "headers": self._headers, "timeout": self.timeout}

    def _timeout_for(self, call: Call) -> httpx.Timeout:
        if call.read_timeout is None:
            return self.timeout
        t = self.timeout
        return httpx.Timeout(connect=t.connect, read=call.read_timeout, write=t.write, pool=t.pool)

    def _retrying(self, call: Call, safe: bool) -> Op[httpx.Response]:
        """Send ``call``; when ``safe``, again after a 429 or 503, once ``Retry-After`` has
        passed (without it: jittered exponential back-off). A ``Retry-After`` longer than
        ``max_retry_wait`` is not waited for: the caller gets the error and its
        ``retry_after``.

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
        type: str,
        payload: Any,
        priority: Priority | str,
        run_at: datetime | None,
        delay: float | None,
        max_attempts: int | None,
        idempotency_key: str | None,
        queue: str | None = None,
        concurrency_key: str | None = None,
        concurrency_limit: int | None = None,
        depends_on: Iterable[str] | None = None,
        on_dependency_failure: OnDependencyFailure | None = None,
        callback: str | Mapping[str, Any] | None = None,
    ) -> Op[Submission]:
        body: dict[str, Any] = {"type": type, "payload": payload, "priority": priority}
        if callback is not None:
            body["callback"] = {"url": callback} if isinstance(callback, str) else callback
        for name, value in (
            ("queue", queue),
            ("concurrency_key", concurrency_key),
            ("concurrency_limit", concurrency_limit),
            ("depends_on", list(depends_on) if depends_on is not None else None),
            ("on_dependency_failure", on_dependency_failure),
        ):
            if value is not None:
                body[name] = value
        if run_at is not None:
            body["run_at"] = run_at
        if delay is not None:
            body["delay"] = delay
        if max_attempts is not None:
            body["max_attempts"] = max_attempts
        if idempotency_key is not None:
            body["idempotency_key"] = idempotency_key
        call = Call(
            "POST",
            "/v1/jobs",
            headers={"content-type": "application/json"},
            content=_encoder.encode(body),
        )
        response = yield from self._retrying(call, safe=idempotency_key is not None)
        check(response, key=idempotency_key or "")
        return submission(response.status_code, response.content, response.status_code == 202)

    def _submit_many(
        self, specs: Iterable[JobSpec | Mapping[str, Any]]
    ) -> Op[list[Submission | ApiError]]:
        jobs = list(specs)
        if not jobs:
            return []
        call = Call(
            "POST",
            "/v1/jobs/batch",
            headers={"content-type": "application/json"},
            content=_encoder.encode({"jobs": jobs}),
        )
        keys = [spec_key(spec) for spec in jobs]
        response = yield from self._retrying(call, safe=all(keys))
        check(response)
        try:
            items = _batch_decoder.decode(response.content).results
        except msgspec.DecodeError as exc:
            raise unexpected(response.status_code, f"not a batch answer: {exc}") from None
        if len(items) != len(jobs):
            raise unexpected(response.status_code, f"{len(items)} results for {len(jobs)} jobs")
        out: list[Submission | ApiError] = []
        for item, key in zip(items, keys, strict=True):
            if item.job:
                try:
                    out.append(submission(item.status, bytes(item.job), item.status == 202))
                except ApiError as exc:
                    out.append(exc)
            else:
                problem = _encoder.encode(item.problem or {})
                out.append(api_error(item.status, problem, {}, key=key or ""))
        return out

    def _submit_flow(
        self, jobs: Iterable[FlowJob | Mapping[str, Any]], idempotency_key: str | None
    ) -> Op[FlowSubmission]:
        body: dict[str, Any] = {"jobs": [_flow_job(job) for job in jobs]}
        if idempotency_key is not None:
            body["idempotency_key"] = idempotency_key
        call = Call(
            "POST",
            "/v1/flows",
            headers={"content-type": "application/json"},
            content=_encoder.encode(body),
        )
        response = yield from self._retrying(call, safe=idempotency_key is not None)
        check(response, key=idempotency_key or "")
        try:
            return _flow_decoder.decode(response.content)
        except msgspec.DecodeError as exc:
            raise unexpected(response.status_code, f"not a flow answer: {exc}") from None

    def _dependencies(self, job_id: str) -> Op[list[Dependency]]:
        response: httpx.Response = yield Call("GET", job_path(job_id, "/dependencies"))
        check(response, job_id=job_id)
        try:
            return _dependencies_decoder.decode(response.content).dependencies
        except msgspec.DecodeError as exc:
            raise unexpected(response.status_code, f"not a dependency list: {exc}") from None

    def _status(
        self, job_id: str, if_version: int | None = None, wait: float = 0.0
    ) -> Op[JobStatus | None]:
        path = job_path(job_id)
        if if_version is None:
            if wait:
                raise ValueError("wait needs if_version: the version to wait past")
            response: httpx.Response = yield Call("GET", path)
        else:
            params = {"wait": f"{wait:.3f}"} if wait > 0 else None
            read = None
            if wait > 0 and self.timeout.read is not None:
                read = self.timeout.read + wait  # the server holds the answer up to ``wait``
            headers = {"if-none-match": f'"{if_version}"'}
            response = yield Call("GET", path, params, headers, read_timeout=read)
            if response.status_code == 304:
                return None
        check(response, job_id=job_id)
        return decode_status(response)

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

    def _cancel(self, job_id: str) -> Op[JobStatus]:
        response: httpx.Response = yield Call("POST", job_path(job_id, "/cancel"))
        check(response, job_id=job_id)
        return decode_status(response)

    def _result(self, job_id: str) -> Op[Result]:
        response: httpx.Response = yield Call("GET", job_path(job_id, "/result"))
        check(response, job_id=job_id)
        try:
            found = _result_decoder.decode(response.content)
        except msgspec.DecodeError as exc:
            raise unexpected(response.status_code, f"not a result document: {exc}") from None
        if found.result_url is None:
            return found
        # a large result is kept outside Redis: the answer names where it streams from
        content: httpx.Response = yield Call("GET", found.result_url)
        check(content, job_id=job_id)
        try:
            value = msgspec.json.decode(content.content)
        except msgspec.DecodeError as exc:
            raise unexpected(content.status_code, f"not a JSON result: {exc}") from None
        return msgspec.structs.replace(found, result=value)

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
        params = {"limit": str(limit), "order": order}
        for name, value in (
            ("state", state), ("type", type), ("queue", queue), ("cursor", cursor),
        ):  # fmt: skip
            if value is not None:
                params[name] = str(value)
        if created_after is not None:
            params["created_after"] = time_param(created_after)
        response: httpx.Response = yield Call("GET", "/v1/jobs", params=params)
        check(response)
        return decode_as(_page_decoder, response, "a page of jobs")

    def _history(self, job_id: str) -> Op[list[Transition]]:
        response: httpx.Response = yield Call("GET", job_path(job_id, "/history"))
        check(response, job_id=job_id)
        return decode_as(_history_decoder, response, "a history").transitions

    def _logs(self, job_id: str) -> Op[list[LogLine]]:
        response: httpx.Response = yield Call("GET", job_path(job_id, "/logs"))
        check(response, job_id=job_id)
        return decode_as(_logs_decoder, response, "log lines").lines

    def _show(self, job_id: str) -> Op[JobDetails]:
        status = yield from self._status(job_id)
        assert status is not None
        result = yield from self._result(job_id)
        try:
            history: list[Transition] | None = yield from self._history(job_id)
        except NotFound:
            history = None  # an API without Postgres has no history route
        lines = yield from self._logs(job_id)
        return JobDetails(status, result.result, history, lines)

    def _retry(self, job_id: str) -> Op[JobStatus]:
        response: httpx.Response = yield Call("POST", job_path(job_id, "/retry"))
        check(response, job_id=job_id)
        return decode_status(response)

    # --- dead letters (admin key) -----------------------------------------------------------
    def _dead_letters(
        self, type: str | None, since: datetime | str | None, limit: int
    ) -> Op[list[JobStatus]]:
        params = {"limit": str(limit)}
        if type is not None:
            params["type"] = type
        if since is not None:
            params["since"] = time_param(since)
        response: httpx.Response = yield Call("GET", "/v1/admin/dead-letters", params=params)
        check(response)
        return decode_as(_dead_letters_decoder, response, "a dead-letter list").jobs

    def _dead_letter(self, job_id: str) -> Op[DeadLetter]:
        path = f"/v1/admin/dead-letters/{quote(job_id, safe='')}"
        response: httpx.Response = yield Call("GET", path)
        check(response, job_id=job_id)
        return decode_as(_dead_letter_decoder, response, "a dead letter")

    def _replay(self, job_id: str) -> Op[JobStatus]:
        path = f"/v1/admin/dead-letters/{quote(job_id, safe='')}/replay"
        response: httpx.Response = yield Call("POST", path)
        check(response, job_id=job_id)
        return decode_status(response)

    def _replay_dead_letters(
        self, type: str | None, since: datetime | str | None, limit: int
    ) -> Op[list[str]]:
        body: dict[str, Any] = {"limit": limit}
        if type is not None:
            body["type"] = type
        if since is not None:
            body["since"] = time_param(since)
        raw = yield from self._json("POST", "/v1/admin/dead-letters/replay", body)
        try:
            return _replayed_decoder.decode(raw).replayed
        except msgspec.DecodeError as exc:
            raise unexpected(200, f"not a replay answer: {exc}") from None

    # --- queues (admin key) ----------------------------------------------------------------
    def _json(self, method: str, path: str, body: Any = None) -> Op[bytes]:
        headers, content = {}, None
        if body is not None:
            headers, content = {"content-type": "application/json"}, _encoder.encode(body)
        response: httpx.Response = yield Call(method, path, headers=headers, content=content)
        check(response)
        return response.content

    def _queues(self) -> Op[list[QueueInfo]]:
        raw = yield from self._json("GET", "/v1/admin/queues")
        try:
            return _queue_list_decoder.decode(raw).queues
        except msgspec.DecodeError as exc:
            raise unexpected(200, f"not a queue list: {exc}") from None

    def _queue_action(self, name: str, action: str, body: Any = None) -> Op[bytes]:
        method = "PUT" if action == "limits" else "POST"
        path = f"/v1/admin/queues/{quote(name, safe='')}/{action}"
        return (yield from self._json(method, path, body))

    def _tasks(self) -> Op[list[TaskAd]]:
        raw = yield from self._json("GET", "/v1/admin/tasks")
        try:
            return _task_list_decoder.decode(raw).tasks
        except msgspec.DecodeError as exc:
            raise unexpected(200, f"not a task list: {exc}") from None

    # --- recurring schedules -----------------------------------------------------------------
    def _create_schedule(self, spec: ScheduleSpec | Mapping[str, Any]) -> Op[Schedule]:
        body = _encoder.encode(spec)
        response: httpx.Response = yield Call(
            "POST", "/v1/schedules", headers={"content-type": "application/json"}, content=body
        )
        check(response)
        return _decode_schedule(response)

    def _schedules(self, after: str, limit: int) -> Op[list[Schedule]]:
        params = {"limit": str(limit), **({"after": after} if after else {})}
        response: httpx.Response = yield Call("GET", "/v1/schedules", params=params)
        check(response)
        try:
            return _schedule_list_decoder.decode(response.content).schedules
        except msgspec.DecodeError as exc:
            raise unexpected(response.status_code, f"not a schedule list: {exc}") from None

    def _schedule_call(
        self, method: str, schedule_id: str, suffix: str = ""
    ) -> Op[Schedule | None]:
        response: httpx.Response = yield Call(
            method, f"/v1/schedules/{quote(schedule_id, safe='')}{suffix}"
        )
        check(response, job_id=schedule_id)
        return None if response.status_code == 204 else _decode_schedule(response)

    def _events(self, job_id: str, last_event_id: int | str | None) -> Op[None]:
        """Stream the job's statuses until a terminal one; resume after a dropped connection
        with ``Last-Event-ID``, up to ``reconnects`` times in a row without an event."""
        path = job_path(job_id, "/events")
        last = None if last_event_id is None else str(last_event_id)
        failures = 0
        delay = 1.0  # until the server's ``retry:`` says otherwise
        while True:
            error: httpx.TransportError | None = None
            try:
                headers = {"accept": "text/event-stream", "cache-control": "no-cache"}
                if last is not None:
                    headers["last-event-id"] = last
                read = self.stream_timeout  # well above the server's heartbeat interval
                response: httpx.Response = yield Call(
                    "GET", path, headers=headers, read_timeout=read, stream=True
                )
                if response.status_code == 204:
                    return  # we already hold the final status
                check(response, job_id=job_id)
                parser = SSEParser()
                while True:
                    line: str | None = yield READ_LINE
                    if line is None:
                        break
                    event = parser.feed(line)
                    if parser.retry is not None:
                        delay = parser.retry
                    if event is None or event[0] != "status":
                        continue
                    status = status_decoder.decode(event[1])
                    last = event[2] if event[2] is not None else str(status.version)
                    failures = 0
                    yield Emit(status)
                    if status.terminal:
                        return
            except httpx.TransportError as exc:
                error = exc
            except msgspec.DecodeError as exc:
                raise unexpected(200, f"not a status event: {exc}") from None
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
