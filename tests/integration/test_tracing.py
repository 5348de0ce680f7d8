"""OpenTelemetry tracing in one process (docs/tracing.md): a submit inside a span hands its
context to the job, whose attempt is that span's child; a failure is the span's exception
event and error status; the API's requests and the persister's batches are spans; untraced
jobs keep nothing. Spans go to the SDK's InMemorySpanExporter, through a provider given to
``tracing.install`` (the process's global provider stays unset: other tests run untraced).
The tracing of separate processes is test_tracing_processes.py's."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.trace import SpanKind, StatusCode

from jobtier.core.errors import ConfigError
from jobtier.core.model import JobSpec, State
from jobtier.engine.queue import Queue
from jobtier.persist.db import Pool
from jobtier.persist.persister import Persister
from jobtier.runtime import tracing
from jobtier.scheduler import Scheduler
from tests import tracing_tasks
from tests.fixtures.api import ApiServer, StartApi
from tests.fixtures.engine import Background, wait_for, worker_for
from tests.tasks import registry as test_registry
from tests.tracing_helpers import Traced, ids, traced_in_memory


@pytest.fixture
def traced() -> Iterator[Traced]:
    with traced_in_memory() as spans:
        yield spans


@pytest.fixture
def queue(queue: Queue) -> Queue:
    queue.produce.tasks = tracing_tasks.registry
    return queue


async def attempts(traced: Traced, job_id: str, n: int = 1) -> list[ReadableSpan]:
    """The job's attempt spans, once ``n`` have ended."""
    await wait_for(lambda: len(traced.attempts(job_id)) >= n)
    return traced.attempts(job_id)


async def finished(queue: Queue, job_id: str) -> State:
    async def done() -> bool:
        return (await queue.status(job_id)).terminal

    await wait_for(done)
    return (await queue.status(job_id)).state


async def test_a_python_submit_in_a_span_makes_each_attempt_its_child(
    queue: Queue, background: Background, traced: Traced
) -> None:
    app = traced.provider.get_tracer("app")
    with app.start_as_current_span("handle order") as parent:
        job = await queue.submit("traced", {"n": 1})
        sync_job = await queue.submit("traced_sync")
    stored = await queue.redis.hget(queue.keys.job(job.job_id), "tp")
    trace_id, span_id = ids(parent)
    flags = parent.get_span_context().trace_flags  # sampled, and the SDK's "random" bit
    assert stored == f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}".encode()

    background.start(worker_for(queue, tracing_tasks.registry))
    for one in (job, sync_job):
        assert await finished(queue, one.job_id) is State.SUCCEEDED
        (span,) = await attempts(traced, one.job_id)
        assert span.parent is not None and span.parent.span_id == span_id
        assert ids(span)[0] == trace_id
        assert span.kind is SpanKind.CONSUMER
        assert span.name == f"attempt {one.status.type}"
        assert dict(span.attributes or {}) == {
            "jobtier.job.id": one.job_id,
            "jobtier.job.type": one.status.type,
            "jobtier.queue": "default",
            "jobtier.job.attempt": 1,
            "jobtier.outcome": "succeeded",
        }
        assert span.status.status_code is StatusCode.UNSET
        # the span was current while the task ran, on the loop and in the thread pool
        _, result = await queue.result(one.job_id)
        assert result == {"trace_id": f"{trace_id:032x}", "span_id": f"{ids(span)[1]:016x}"}


async def test_a_failed_attempt_is_an_exception_event_and_an_error(
    queue: Queue, background: Background, traced: Traced
) -> None:
    with traced.provider.get_tracer("app").start_as_current_span("submit"):
        job = await queue.submit("traced_fail")  # two attempts (retries=1)
    background.start(worker_for(queue, tracing_tasks.registry))
    background.start(Scheduler(queue.store))  # the retry is scheduled
    assert await finished(queue, job.job_id) is State.FAILED
    first, second = await attempts(traced, job.job_id, 2)
    for span, attempt, outcome in ((first, 1, "retry"), (second, 2, "failed")):
        attrs = span.attributes or {}
        assert (attrs["jobtier.job.attempt"], attrs["jobtier.outcome"]) == (attempt, outcome)
        assert attrs["jobtier.error.type"] == "ValueError"
        assert span.status.status_code is StatusCode.ERROR
        assert span.status.description == f"ValueError: boom on attempt {attempt}"
        (event,) = span.events
        assert event.name == "exception"
        assert event.attributes is not None
        assert event.attributes["exception.type"] == "ValueError"
        assert event.attributes["exception.message"] == f"boom on attempt {attempt}"
        assert "traced_fail" in str(event.attributes["exception.stacktrace"])
    # both attempts are children of the one submit, and so is a replay's (the hash keeps it)
    assert first.parent == second.parent and first.parent is not None
    await queue.jobs.replay(job.job_id)
    assert await finished(queue, job.job_id) is State.FAILED
    replayed = (await attempts(traced, job.job_id, 4))[2]
    assert replayed.parent == first.parent
    assert (replayed.attributes or {})["jobtier.job.attempt"] == 1


async def test_a_held_attempt_is_not_an_error(
    queue: Queue, background: Background, traced: Traced
) -> None:
    job = await queue.submit("traced_held")  # retries=0: a failure would end it
    background.start(worker_for(queue, tracing_tasks.registry))
    background.start(Scheduler(queue.store))  # its next run is scheduled
    assert await finished(queue, job.job_id) is State.SUCCEEDED
    held, done = await attempts(traced, job.job_id, 2)
    attrs = dict(held.attributes or {})
    # given back uncounted, as jobtier_jobs_held_total counts it: no error, no exception
    assert (attrs["jobtier.outcome"], attrs["jobtier.held.by"]) == ("held", "RateLimited")
    assert attrs["jobtier.job.attempt"] == 1 and "jobtier.error.type" not in attrs
    assert held.status.status_code is StatusCode.UNSET and not held.events
    assert (done.attributes or {})["jobtier.outcome"] == "succeeded"


async def test_a_compensation_runs_in_the_trace_of_the_job_it_compensates(
    queue: Queue, background: Background, traced: Traced
) -> None:
    queue.produce.tasks = test_registry
    with traced.provider.get_tracer("app").start_as_current_span("checkout") as parent:
        job = await queue.submit("charge", {"fail": True})
    background.start(worker_for(queue, test_registry))
    background.start(Scheduler(queue.store))
    assert await finished(queue, job.job_id) is State.FAILED
    compensation = await queue.jobs.compensation_of(job.job_id)
    assert compensation is not None
    (span,) = await attempts(traced, compensation)
    assert span.parent is not None and span.parent.span_id == ids(parent)[1]


async def test_untraced_jobs_keep_nothing_and_their_attempts_start_traces(
    queue: Queue, background: Background, traced: Traced
) -> None:
    job = await queue.submit("traced")  # tracing on, but no span current
    assert await queue.redis.hget(queue.keys.job(job.job_id), "tp") is None
    background.start(worker_for(queue, tracing_tasks.registry))
    assert await finished(queue, job.job_id) is State.SUCCEEDED
    (span,) = await attempts(traced, job.job_id)
    assert span.parent is None


async def test_with_tracing_off_a_submit_in_a_span_keeps_nothing(queue: Queue) -> None:
    provider = TracerProvider()  # a span, but jobtier was given no provider: off
    with provider.get_tracer("app").start_as_current_span("request"):
        job = await queue.submit("traced")
    assert await queue.redis.hget(queue.keys.job(job.job_id), "tp") is None
    assert tracing.tracer() is None


async def test_the_api_serves_each_request_in_a_server_span(
    start_api: StartApi, queue: Queue, traced: Traced
) -> None:
    api: ApiServer = await start_api(require_known_types=False)
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with api.client("admin") as admin:  # probes and scrapes make no span
        for probe in ("/healthz", "/readyz", "/metrics"):
            assert (await admin.get(probe)).status_code == 200, probe
    async with api.client() as http:
        made = await http.post("/v1/jobs", json={"type": "traced"}, headers={"traceparent": parent})
        assert made.status_code == 202, made.text
        job_id = made.json()["id"]
        assert (await http.get(f"/v1/jobs/{job_id}")).status_code == 200  # the fast path
        assert (await http.post("/v1/jobs", json={"type": 7})).status_code == 422
    await wait_for(lambda: len(traced.spans()) == 3)
    submit, status, refused = traced.spans()
    assert submit.name == "POST /v1/jobs" and submit.kind is SpanKind.SERVER
    assert submit.parent is not None and f"{submit.parent.span_id:016x}" == "b7ad6b7169203331"
    assert f"{ids(submit)[0]:032x}" == "0af7651916cd43dd8448eb211c80319c"
    assert dict(submit.attributes or {}) == {
        "http.request.method": "POST",
        "url.path": "/v1/jobs",
        "url.scheme": "http",
        "network.protocol.version": "1.1",
        "http.route": "/v1/jobs",
        "http.response.status_code": 202,
    }
    assert status.name == "GET /v1/jobs/{job_id}" and status.parent is None
    assert (status.attributes or {})["url.path"] == f"/v1/jobs/{job_id}"
    # a refused request is the client's error, not the server's
    assert (refused.attributes or {})["http.response.status_code"] == 422
    assert refused.status.status_code is StatusCode.UNSET
    # the job keeps the server span's context: its attempt will be that span's child
    stored = await queue.redis.hget(queue.keys.job(job_id), "tp")
    assert submit.context is not None
    flags = submit.context.trace_flags
    assert stored == f"00-{ids(submit)[0]:032x}-{ids(submit)[1]:016x}-{flags:02x}".encode()


async def test_the_persisters_batches_are_spans(
    queue: Queue, pg_settings: Any, pg_pool: Pool, traced: Traced
) -> None:
    await queue.submit_many([JobSpec(type="traced")] * 3)
    persister = Persister(pg_settings, queue.redis, pg_pool, "p1")
    assert await persister.drain() == 3
    batches = traced.spans("persist batch")
    assert batches and all(span.parent is None for span in batches)
    entries = [dict(span.attributes or {}) for span in batches]
    assert sum(e["jobtier.batch.entries"] for e in entries) == 3  # type: ignore[misc]
    assert all(e["jobtier.batch.written"] == e["jobtier.batch.entries"] for e in entries)


def test_an_exporter_that_cannot_be_made_is_a_configuration_error() -> None:
    with pytest.raises(ConfigError, match="no installed exporter"):
        tracing._exporter("no-such-exporter")
    try:
        import opentelemetry.exporter.otlp.proto.http  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match=r"jobtier\[otlp\]"):
            tracing._exporter("otlp")
    assert tracing._exporter("none") is None


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_without_opentelemetry_installed_tracing_is_off() -> None:
    """(Redis-py imports OpenTelemetry itself when it is installed: the import is blocked
    here, as if it were not.)"""
    out = _run(
        "import sys\n"
        "sys.modules['opentelemetry'] = None  # any import of it now fails\n"
        "import jobtier.worker.runner, jobtier.api.app, jobtier.persist.persister\n"
        "from jobtier.runtime import tracing\n"
        "assert tracing.tracer() is None and tracing.traceparent() == ''\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry.')))\n"
    )
    assert out.strip() == "[]"


def test_on_once_the_application_sets_a_provider() -> None:
    _run(
        "from jobtier.runtime import tracing\n"
        "from opentelemetry import trace\n"
        "from opentelemetry.sdk.trace import TracerProvider\n"
        "assert tracing.tracer() is None\n"
        "trace.set_tracer_provider(TracerProvider())\n"
        "assert tracing.tracer() is not None\n"
        "with trace.get_tracer('app').start_as_current_span('s') as s:\n"
        "    tp = tracing.traceparent()\n"
        "    assert tp.split('-')[2] == format(s.get_span_context().span_id, '016x'), tp\n"
    )


def _jobtier(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("JOBTIER_", "OTEL_"))}
    return subprocess.run(
        [sys.executable, "-m", "jobtier.cli.main", *args],
        capture_output=True, text=True, env={**base, **env}, timeout=60,
    )  # fmt: skip


def test_the_roles_refuse_an_exporter_they_cannot_make_before_starting() -> None:
    done = _jobtier(
        "worker", "jobtier.demo",
        JOBTIER_OTEL="1", OTEL_TRACES_EXPORTER="no-such-exporter",
        JOBTIER_REDIS_URL="redis://127.0.0.1:1",
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "configuration error" in done.stderr and "no installed exporter" in done.stderr


def test_config_shows_the_otel_settings_under_their_own_names() -> None:
    done = _jobtier("config", OTEL_SERVICE_NAME="shop", JOBTIER_OTEL="1")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert {"JOBTIER_OTEL=True", "OTEL_SERVICE_NAME=shop", "OTEL_TRACES_EXPORTER=otlp"} <= set(
        lines
    )
