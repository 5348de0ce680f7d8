"""The Python client against a real API server on a loopback port.

Faults (a dropped event stream, a refused reconnect) are injected by wrapping httpx's real
transport: the requests still reach the real server.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import httpx
import pytest

from jobtier.client import (
    ApiError,
    AsyncClient,
    Client,
    Conflict,
    IdempotencyKeyConflict,
    NotFound,
    RateLimited,
    Submission,
    Unauthorized,
    Unavailable,
    ValidationFailed,
    WaitTimeout,
    WrongState,
)
from jobtier.core.errors import IdempotencyConflict, InvalidRequest, JobNotFound, Overloaded
from jobtier.core.model import JobSpec, JobStatus, State
from jobtier.engine.queue import Queue
from tests.fixtures.api import KEYS, ApiServer, StartApi
from tests.fixtures.engine import Background, worker_for
from tests.tasks import registry


class Recording(httpx.AsyncBaseTransport):
    """The real transport, recording (method, path, query, status) of every exchange and
    setting ``long_polled`` once a long-poll request has been sent."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.exchanges: list[tuple[str, str, str, int]] = []
        self.headers: list[httpx.Headers] = []
        self.long_polled = asyncio.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.headers.append(request.headers)
        if b"wait=" in request.url.query:
            self.long_polled.set()
        response = await self.inner.handle_async_request(request)
        url = request.url
        self.exchanges.append((request.method, url.path, url.query.decode(), response.status_code))
        return await self.wrap(request, response)

    async def wrap(self, request: httpx.Request, response: httpx.Response) -> httpx.Response:
        return response

    def statuses(self, path_suffix: str = "") -> list[int]:
        return [s for _, path, _, s in self.exchanges if path.endswith(path_suffix)]

    async def aclose(self) -> None:
        await self.inner.aclose()


class CutAfterFirstEvent(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream) -> None:
        self.inner = inner

    async def __aiter__(self) -> AsyncIterator[bytes]:
        seen = b""
        async for chunk in self.inner:
            yield chunk
            seen += chunk
            if b"data:" in seen and seen.endswith(b"\n\n"):
                raise httpx.ReadError("connection reset (injected)")

    async def aclose(self) -> None:
        await self.inner.aclose()


class Flaky(Recording):
    """Cuts the first event stream after its first event; with ``refuse_reconnect``, every
    later stream request fails to connect."""

    def __init__(self, refuse_reconnect: bool = False) -> None:
        super().__init__()
        self.refuse_reconnect = refuse_reconnect
        self.streams = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/events"):
            self.streams += 1
            if self.streams > 1 and self.refuse_reconnect:
                self.headers.append(request.headers)
                raise httpx.ConnectError("connection refused (injected)")
        return await super().handle_async_request(request)

    async def wrap(self, request: httpx.Request, response: httpx.Response) -> httpx.Response:
        if not request.url.path.endswith("/events") or self.streams > 1:
            return response
        assert isinstance(response.stream, httpx.AsyncByteStream)
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=CutAfterFirstEvent(response.stream),
            extensions=response.extensions,
        )


def client(api: ApiServer, tenant: str = "acme", **kwargs: Any) -> AsyncClient:
    return AsyncClient(api.url, KEYS[tenant], **kwargs)


async def test_submit_created_duplicate_and_conflict(api: ApiServer) -> None:
    async with client(api) as c:
        first = await c.submit("echo", {"n": 1}, priority="high", idempotency_key="order-1")
        assert isinstance(first, Submission) and first.created
        assert first.job.state is State.QUEUED and first.job.priority == "high"
        assert first.id == first.job.id and first.job.version == 1
        again = await c.submit("echo", {"n": 1}, priority="high", idempotency_key="order-1")
        assert not again.created and again.job == first.job
        with pytest.raises(IdempotencyKeyConflict) as info:
            await c.submit("echo", {"n": 2}, idempotency_key="order-1")
        exc = info.value
        assert isinstance(exc, Conflict) and isinstance(exc, IdempotencyConflict)
        assert (exc.status, exc.slug, exc.key, exc.job_id) == (
            409,
            "idempotency-conflict",
            "order-1",
            first.id,
        )
        plain = await c.submit("echo")
        assert plain.created and plain.id != first.id


async def test_duplicate_of_an_expired_job_is_not_found(api: ApiServer, queue: Queue) -> None:
    async with client(api) as c:
        sub = await c.submit("echo", 1, idempotency_key="old")
        await queue.redis.delete(queue.keys.job(sub.id))  # as if its retention had passed
        with pytest.raises(NotFound) as info:
            await c.submit("echo", 1, idempotency_key="old")
        assert info.value.job_id == sub.id
        (outcome,) = await c.submit_many([{"type": "echo", "payload": 1, "idempotency_key": "old"}])
        assert isinstance(outcome, NotFound) and outcome.job_id == sub.id


async def test_one_dependency_may_be_named_alone(api: ApiServer, queue: Queue) -> None:
    """``depends_on="<id>"``: that job (a str is also an iterable of characters, which the
    client sent as ids, each refused)."""
    async with client(api) as c:
        first = await c.submit("echo", 1)
        then = await c.submit("echo", 2, depends_on=first.id)
        assert then.job.state is State.WAITING
    own = await queue.submit("echo", 3)  # in-process, the same
    alone = await queue.submit("echo", 4, depends_on=own.job_id)
    assert alone.status.state is State.WAITING


async def test_submit_timing_and_attempts(api: ApiServer) -> None:
    async with client(api) as c:
        delayed = await c.submit("echo", delay=60, max_attempts=7)
        assert delayed.job.state is State.SCHEDULED and delayed.job.max_attempts == 7
        later = await c.submit("echo", delay=timedelta(minutes=1, seconds=30))  # as seconds
        due = datetime.fromisoformat(later.job.run_at or "")
        created = datetime.fromisoformat(later.job.created_at)
        assert abs((due - created).total_seconds() - 90) < 1, later.job
        when = (datetime.now(UTC) + timedelta(days=2)).replace(microsecond=0)
        at = await c.submit("echo", run_at=when.astimezone(timezone(timedelta(hours=2))))
        assert at.job.state is State.SCHEDULED
        assert at.job.run_at == when.strftime("%Y-%m-%dT%H:%M:%S.000Z")
        with pytest.raises(ValidationFailed) as info:
            await c.submit("echo", run_at=datetime(2030, 1, 1))  # no time zone
        assert info.value.field == "run_at" and info.value.status == 422


async def test_submit_a_task_itself(api: ApiServer) -> None:
    echo = registry.get("echo")
    assert echo is not None
    async with client(api) as c:
        made = await c.submit(echo, {"by": "the task"})  # sent by its name
        assert made.job.type == "echo" and made.created
        with pytest.raises(TypeError, match="type must be a task's name or a jobtier task"):
            await c.submit(print, 1)  # type: ignore[arg-type]
    with Client(api.url, KEYS["acme"]) as sync:  # the sync mirror, in a thread
        made = await asyncio.to_thread(sync.submit, echo, 2)
    assert made.job.type == "echo"


async def test_submit_many(api: ApiServer) -> None:
    async with client(api) as c:
        original = await c.submit("echo", "x", idempotency_key="dup")
        results = await c.submit_many(
            [
                JobSpec(type="echo", payload=1),
                {"type": "echo", "payload": "x", "idempotency_key": "dup"},
                {"type": "echo", "payload": "y", "idempotency_key": "dup"},
                JobSpec(type="sleep", priority="low", delay=30),  # type: ignore[arg-type]
            ]
        )
        assert [type(r) for r in results] == [
            Submission,
            Submission,
            IdempotencyKeyConflict,
            Submission,
        ]
        first, duplicate, conflict, delayed = results
        assert isinstance(first, Submission) and first.created
        assert isinstance(duplicate, Submission) and not duplicate.created
        assert duplicate.id == original.id
        assert isinstance(conflict, IdempotencyKeyConflict)
        assert conflict.job_id == original.id and conflict.key == "dup"
        assert isinstance(delayed, Submission) and delayed.job.state is State.SCHEDULED
        assert await c.submit_many([]) == []
        with pytest.raises(ValidationFailed) as info:  # one bad job refuses the batch
            await c.submit_many([{"type": "echo"}, {"type": "echo", "max_attempts": 0}])
        assert info.value.field == "jobs[1].max_attempts"


async def test_status_versions_and_long_poll(api: ApiServer, queue: Queue) -> None:
    transport = Recording()
    async with client(api, transport=transport) as c:
        job = (await c.submit("echo", {"a": 1})).job
        status = await c.status(job.id)
        assert isinstance(status, JobStatus) and status == job
        assert await c.status(job.id, if_version=1) is None
        assert await c.status(job.id, if_version=0) == job
        assert await c.status(job.id, if_version=1, wait=0.1) is None  # 304 at the timeout
        assert transport.statuses()[-1] == 304
        await queue.cancel(job.id)
        newer = await c.status(job.id, if_version=1, wait=30)
        assert newer is not None and newer.state is State.CANCELLED and newer.version == 2
        with pytest.raises(ValueError, match="if_version"):
            await c.status(job.id, wait=1)  # type: ignore[call-overload]


async def test_wait_returns_when_a_worker_finishes(
    api: ApiServer, queue: Queue, background: Background
) -> None:
    transport = Recording()
    async with client(api, transport=transport) as c:
        sub = await c.submit("sleep", {"seconds": 0.2})
        waiter = asyncio.create_task(c.wait(sub.id, timeout=60, poll=10))
        await transport.long_polled.wait()  # parked in a long-poll before anyone runs it
        background.start(worker_for(queue, registry))
        done = await waiter
        assert done.state is State.SUCCEEDED and done.terminal
        assert (await c.result(sub.id)).result == {"slept": 0.2}
        # returns at once for a job already finished
        assert await c.wait(sub.id, timeout=0) == done


async def test_wait_times_out_on_a_job_nobody_runs(api: ApiServer) -> None:
    transport = Recording()
    async with client(api, transport=transport) as c:
        sub = await c.submit("echo")
        with pytest.raises(WaitTimeout) as info:
            await c.wait(sub.id, timeout=0.3, poll=0.1)
        assert isinstance(info.value, TimeoutError)
        assert info.value.last == sub.job and info.value.job_id == sub.id
        assert 304 in transport.statuses()
        with pytest.raises(TimeoutError):
            await c.wait(sub.id, timeout=0)


async def test_events_in_order_until_terminal(
    api: ApiServer, queue: Queue, background: Background
) -> None:
    async with client(api) as c:
        sub = await c.submit("sleep", {"seconds": 0.3})
        statuses: list[JobStatus] = []
        async for status in c.events(sub.id):
            statuses.append(status)
            if len(statuses) == 1:  # the stream is open: now let a worker run the job
                background.start(worker_for(queue, registry))
    versions = [s.version for s in statuses]
    assert versions == list(range(1, versions[-1] + 1))
    assert statuses[0].state is State.QUEUED and statuses[-1].state is State.SUCCEEDED
    assert State.RUNNING in {s.state for s in statuses}
    assert [s for s in statuses if s.terminal] == [statuses[-1]]


async def test_events_resume_from_last_event_id(api: ApiServer) -> None:
    async with client(api) as c:
        sub = await c.submit("echo")
        cancelled = await c.cancel(sub.id)  # version 2, terminal
        assert [s async for s in c.events(sub.id)] == [cancelled]
        assert [s async for s in c.events(sub.id, last_event_id=1)] == [cancelled]
        assert [s async for s in c.events(sub.id, last_event_id="2")] == []  # a 204


async def test_events_reconnect_after_a_dropped_stream(api: ApiServer, queue: Queue) -> None:
    transport = Flaky()
    async with client(api, transport=transport) as c:
        sub = await c.submit("echo")
        stream = c.events(sub.id)
        first = await anext(stream)
        assert first.version == 1
        await queue.cancel(sub.id)
        # the next read meets the injected reset; the client resumes after version 1
        rest = [s async for s in stream]
    assert [(s.version, s.state) for s in rest] == [(2, State.CANCELLED)]
    assert transport.streams == 2
    assert transport.headers[-1]["last-event-id"] == "1"


async def test_events_give_up_after_bounded_reconnects(api: ApiServer) -> None:
    transport = Flaky(refuse_reconnect=True)
    async with client(api, transport=transport, reconnects=1) as c:
        sub = await c.submit("echo")
        received = []
        with pytest.raises(httpx.ConnectError):
            async for status in c.events(sub.id):
                received.append(status)
    assert [s.version for s in received] == [1]
    assert transport.streams == 2  # the first, then one reconnect attempt


async def test_events_closed_early(api: ApiServer) -> None:
    async with client(api) as c:
        sub = await c.submit("echo")
        async with contextlib.aclosing(c.events(sub.id)) as stream:
            async for status in stream:
                assert status.version == 1
                break


async def test_cancel_then_conflict(api: ApiServer) -> None:
    async with client(api) as c:
        sub = await c.submit("echo", delay=60)
        cancelled = await c.cancel(sub.id)
        assert cancelled.state is State.CANCELLED and cancelled.version == 2
        with pytest.raises(WrongState) as info:
            await c.cancel(sub.id)
        assert isinstance(info.value, Conflict) and info.value.status == 409
        assert info.value.job == cancelled
        assert info.value.slug == "wrong-state"


async def test_result_of_succeeded_and_failed_jobs(
    api: ApiServer, queue: Queue, background: Background
) -> None:
    async with client(api) as c:
        ok = await c.submit("echo", {"hello": "world"})
        bad = await c.submit("permanent")
        pending = await c.result(ok.id)
        assert pending.state is State.QUEUED and pending.result is None and not pending.terminal
        background.start(worker_for(queue, registry))
        assert (await c.wait(ok.id, timeout=30)).state is State.SUCCEEDED
        assert (await c.wait(bad.id, timeout=30)).state is State.FAILED
        result = await c.result(ok.id)
        assert (result.id, result.state, result.result, result.error) == (
            ok.id,
            State.SUCCEEDED,
            {"hello": "world"},
            None,
        )
        failed = await c.result(bad.id)
        assert failed.state is State.FAILED and failed.result is None
        assert failed.error is not None and failed.error.type == "Permanent"


async def test_error_answers_map_to_exceptions(start_api: StartApi) -> None:
    api = await start_api(max_payload_bytes=1024, max_batch=2, max_request_bytes=16_384)
    async with client(api) as c:
        job = (await c.submit("echo")).job

        async with AsyncClient(api.url, "wrong-key") as stranger:
            with pytest.raises(Unauthorized) as unauthorized:
                await stranger.status(job.id)
        assert unauthorized.value.status == 401 and unauthorized.value.slug == "unauthorized"

        async with client(api, "globex") as other_tenant:
            with pytest.raises(NotFound) as not_found:
                await other_tenant.status(job.id)
        assert isinstance(not_found.value, JobNotFound) and not_found.value.job_id == job.id
        for call in (c.status, c.cancel, c.result, c.wait):
            with pytest.raises(NotFound):
                await call("01M8KK4FZ54RBHFVYBN6HBV0CZ-1")
        with pytest.raises(NotFound):
            await anext(c.events("not-a-job"))

        with pytest.raises(ValidationFailed) as invalid:
            await c.submit("echo", priority="urgent")
        assert isinstance(invalid.value, InvalidRequest) and invalid.value.status == 422
        assert "priority" in invalid.value.detail
        with pytest.raises(ValidationFailed) as attempts:
            await c.submit("echo", max_attempts=0)
        assert (attempts.value.status, attempts.value.field) == (422, "max_attempts")
        with pytest.raises(ValidationFailed) as too_big:
            await c.submit("echo", "x" * 2000)  # over the payload limit
        assert (too_big.value.status, too_big.value.field) == (413, "payload")
        with pytest.raises(ValidationFailed) as too_large:
            await c.submit("echo", "x" * 20_000)  # over the request body limit
        assert too_large.value.status == 413 and too_large.value.slug == "payload-too-large"
        with pytest.raises(ValidationFailed) as batch:
            await c.submit_many([{"type": "echo"}] * 3)
        assert (batch.value.status, batch.value.field) == (413, "jobs")
        with pytest.raises(ValidationFailed) as bad_wait:
            await c.status(job.id, if_version=job.version, wait=3600)
        assert bad_wait.value.status == 400 and bad_wait.value.slug == "bad-request"
        assert "wait" in bad_wait.value.detail and bad_wait.value.body["status"] == 400


async def test_tenant_limit_is_rate_limited(start_api: StartApi) -> None:
    api = await start_api(max_waiting_per_tenant=1)
    async with client(api) as c:
        await c.submit("echo", delay=60)
        with pytest.raises(RateLimited) as limited:
            await c.submit("echo")  # no idempotency key: not retried
        assert isinstance(limited.value, Overloaded) and limited.value.retry_after == 2.0
        assert limited.value.status == 429 and limited.value.slug == "tenant-limit"
    transport = Recording()
    async with client(api, transport=transport, max_retry_wait=1.0) as c:
        with pytest.raises(RateLimited):  # keyed, but Retry-After is longer than we wait
            await c.submit("echo", idempotency_key="k")
    assert transport.statuses() == [429]


async def test_back_pressure_is_unavailable(start_api: StartApi) -> None:
    api = await start_api(max_waiting_total=1)
    async with client(api, "globex") as c:
        await c.submit("echo", delay=60)
        with pytest.raises(Unavailable) as unavailable:
            await c.submit("echo")
        assert unavailable.value.status == 503 and unavailable.value.retry_after == 2.0
        assert isinstance(unavailable.value, ApiError) and isinstance(unavailable.value, Overloaded)


async def test_keyed_submit_is_retried_after_429(start_api: StartApi) -> None:
    # one job per second, no burst: the second submit is refused with Retry-After: 1
    api = await start_api(rate_limit_per_second=1.0, max_batch=1)
    transport = Recording()
    async with client(api, transport=transport, retries=10) as c:
        assert (await c.submit("echo", 1)).created
        sub = await c.submit("echo", 2, idempotency_key="retry-me")
        assert sub.created and sub.job.state is State.QUEUED
        statuses = transport.statuses("/v1/jobs")
        assert statuses[0] == 202 and statuses[-1] == 202 and 429 in statuses
        assert set(statuses[1:-1]) == {429}


async def test_sync_client(api: ApiServer, queue: Queue, background: Background) -> None:
    background.start(worker_for(queue, registry))

    def use_it() -> None:
        with Client(api.url, KEYS["acme"]) as c:
            sub = c.submit("echo", {"sync": True}, idempotency_key="sync-1")
            assert (
                sub.created
                and not c.submit("echo", {"sync": True}, idempotency_key="sync-1").created
            )
            done = c.wait(sub.id, timeout=30, poll=5)
            assert done.state is State.SUCCEEDED
            assert c.status(sub.id) == done and c.status(sub.id, if_version=done.version) is None
            assert c.result(sub.id).result == {"sync": True}
            statuses = list(c.events(sub.id))
            assert statuses == [done]
            assert list(c.events(sub.id, last_event_id=done.version)) == []

            streamed = c.submit("sleep", {"seconds": 0.2})
            seen = list(c.events(streamed.id))
            versions = [s.version for s in seen]
            assert versions == list(range(versions[0], versions[-1] + 1))
            assert seen[-1].state is State.SUCCEEDED

            results = c.submit_many([JobSpec(type="echo", delay=60), {"type": "echo", "delay": 60}])
            assert all(isinstance(r, Submission) and r.created for r in results)
            first = results[0]
            assert isinstance(first, Submission)
            assert c.cancel(first.id).state is State.CANCELLED
            try:
                c.cancel(first.id)
                raise AssertionError("a second cancel must be refused")
            except WrongState as exc:
                assert exc.job is not None and exc.job.state is State.CANCELLED
            try:
                c.status("01M8KK4FZ54RBHFVYBN6HBV0CZ-1")
                raise AssertionError("an unknown job must be a 404")
            except NotFound as exc:
                assert exc.status == 404
            never = c.submit("echo", delay=60)
            try:
                c.wait(never.id, timeout=0.2, poll=0.1)
                raise AssertionError("wait must time out")
            except WaitTimeout as exc:
                assert exc.last.state is State.SCHEDULED

    await asyncio.to_thread(use_it)
