"""Tracing across processes (docs/tracing.md): a submit over HTTP to a real API server with a
``traceparent`` header, and a real ``jobtier worker`` process that runs the job.

The API serves in this process, its spans exported to the SDK's InMemorySpanExporter. The
worker is started as an operator would, with ``JOBTIER_OTEL=1`` and the standard
``OTEL_TRACES_EXPORTER=console`` and ``OTEL_SERVICE_NAME``: its spans come out of its
standard output, read here from a file. Each attempt's span must be in the trace the
client's traceparent named, a child of the API's span of the submit, which is a child of
the client's span.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan

from jobtier.config import Settings
from jobtier.engine.queue import Queue
from jobtier.scheduler import Scheduler
from tests.fixtures.api import StartApi
from tests.fixtures.engine import Background, wait_for
from tests.tracing_helpers import Traced, ids, traced_in_memory

ROOT = Path(__file__).parents[2]
HANG_GUARD = 60.0  # s: only stops a broken test from hanging


@pytest.fixture
def traced() -> Iterator[Traced]:
    with traced_in_memory() as spans:
        yield spans


class TracedWorker:
    """`jobtier worker tests.tracing_tasks`, its spans printed to ``spans`` (console
    exporter), its log to ``log``."""

    def __init__(self, settings: Settings, folder: Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JOBTIER_", "OTEL_"))}
        env.update(
            JOBTIER_REDIS_URL=settings.redis_url,
            JOBTIER_SHARDS=str(settings.shards),
            JOBTIER_OTEL="1",
            OTEL_TRACES_EXPORTER="console",
            OTEL_SERVICE_NAME="tracing-test-worker",
            OTEL_BSP_SCHEDULE_DELAY="20",  # ms between the batches it exports
            PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
        )
        self.spans = folder / "worker-spans.json"
        self.log = folder / "worker.log"
        with self.spans.open("wb") as out, self.log.open("wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jobtier.cli.main", "worker", "tests.tracing_tasks"],
                env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
            )  # fmt: skip

    def exported(self) -> list[dict[str, Any]]:
        """The spans printed so far: JSON documents one after another (a last one still
        being written is left for the next look)."""
        text, decoder, at = self.spans.read_text(), json.JSONDecoder(), 0
        spans: list[dict[str, Any]] = []
        while True:
            while at < len(text) and text[at].isspace():
                at += 1
            if at == len(text):
                return spans
            try:
                span, at = decoder.raw_decode(text, at)
            except json.JSONDecodeError:
                return spans
            spans.append(span)

    def attempts(self) -> dict[str, dict[str, Any]]:
        """The attempt spans exported, by job id (each job here has one attempt)."""
        alive = self.proc.poll() is None
        assert alive, self.log.read_text()[-3000:]
        return {
            s["attributes"]["jobtier.job.id"]: s
            for s in self.exported()
            if "jobtier.job.id" in s["attributes"]
        }

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(HANG_GUARD)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def worker(settings: Settings, tmp_path: Path) -> Iterator[TracedWorker]:
    proc = TracedWorker(settings, tmp_path)
    try:
        yield proc
    finally:
        proc.kill()


def server_span(traced: Traced, route: str, client_span: str) -> ReadableSpan:
    """The API's span of the request ``route`` the client sent from ``client_span``."""
    (span,) = [
        s
        for s in traced.spans(route)
        if s.parent is not None and f"{s.parent.span_id:016x}" == client_span
    ]
    return span


def client(n: int) -> tuple[str, str, str]:
    """A client's span n: (trace id, span id, its traceparent header)."""
    trace_id, span_id = f"{n:032x}", f"{n + 0xABC000:016x}"
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


async def test_a_submit_over_http_and_its_attempt_in_another_process_share_a_trace(
    start_api: StartApi,
    queue: Queue,
    background: Background,
    traced: Traced,
    worker: TracedWorker,
) -> None:
    api = await start_api(require_known_types=False)
    one, batch, flow, failing = client(1), client(2), client(3), client(4)
    async with api.client() as http:

        async def post(path: str, body: Any, sender: tuple[str, str, str]) -> Any:
            answer = await http.post(path, json=body, headers={"traceparent": sender[2]})
            assert answer.status_code in (200, 202), answer.text
            return answer.json()

        sent = {(await post("/v1/jobs", {"type": "traced"}, one))["id"]: one}
        made = await post(
            "/v1/jobs/batch", {"jobs": [{"type": "traced_sync"}, {"type": "traced"}]}, batch
        )
        sent |= {r["job"]["id"]: batch for r in made["results"]}
        jobs = [{"type": "traced", "ref": "a"}, {"type": "traced_sync", "after": ["a"]}]
        made = await post("/v1/flows", {"jobs": jobs}, flow)
        sent |= {j["id"]: flow for j in made["jobs"]}
        bad = {"type": "traced_fail", "max_attempts": 1}
        failed = (await post("/v1/jobs", bad, failing))["id"]
        sent[failed] = failing
    background.start(Scheduler(queue.store))  # the flow's resolver: its second job waits

    await wait_for(lambda: worker.attempts().keys() >= sent.keys(), HANG_GUARD)
    attempts = worker.attempts()
    routes = {one: "POST /v1/jobs", batch: "POST /v1/jobs/batch", flow: "POST /v1/flows"}
    routes[failing] = "POST /v1/jobs"
    for job_id, sender in sent.items():
        span = attempts[job_id]
        submit = server_span(traced, routes[sender], sender[1])
        # the client's trace; the API's span of the submit its parent
        assert f"{ids(submit)[0]:032x}" == sender[0]
        assert span["context"]["trace_id"] == f"0x{sender[0]}", span
        assert span["parent_id"] == f"0x{ids(submit)[1]:016x}", span
        assert span["kind"] == "SpanKind.CONSUMER"
        assert span["resource"]["attributes"]["service.name"] == "tracing-test-worker"
        attrs = span["attributes"]
        status = await queue.status(job_id)
        assert attrs["jobtier.job.type"] == status.type and attrs["jobtier.queue"] == "default"
        assert attrs["jobtier.job.attempt"] == 1
        if job_id == failed:
            assert attrs["jobtier.outcome"] == "failed"
            assert attrs["jobtier.error.type"] == "ValueError"
            assert span["status"]["status_code"] == "ERROR"
            (event,) = span["events"]
            assert event["name"] == "exception"
            assert event["attributes"]["exception.type"] == "ValueError"
            assert event["attributes"]["exception.message"] == "boom on attempt 1"
        else:
            assert attrs["jobtier.outcome"] == "succeeded"
            assert span["status"]["status_code"] == "UNSET" and not span["events"]
            # the task saw its attempt's span current (in the thread pool too)
            _, result = await queue.result(job_id)
            assert f"0x{result['span_id']}" == span["context"]["span_id"]
    assert worker.stop() == 0
