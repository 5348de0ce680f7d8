"""Failures you can debug, cancels that arrive at once, and per-job log lines, against a real
Redis and a real Redis Cluster (``contract``).

Workers here run with a lease of 600 s (a heartbeat every 200 s) where a test must show that
the cancel push, not the heartbeat, stopped a task: within the test's life only the push can
deliver the request.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
import pytest

from jobtier.core.model import LOG_LINE_CHARS, LOG_LINES, LogLine, State
from jobtier.engine.queue import Queue
from jobtier.store.calls import reclaim_call
from jobtier.testing import run_task
from jobtier.worker.attempt import TRACEBACK_CHARS, TRACEBACK_FRAMES, format_traceback
from tests.debug_tasks import gate, registry
from tests.fixtures.engine import Background, wait_for, worker_for

pytestmark = pytest.mark.contract
_lines = msgspec.json.Decoder(LogLine)


@pytest.fixture
def queue(queue: Queue) -> Queue:
    queue.produce.tasks = registry
    return queue


def long_lease(queue: Queue) -> Queue:
    """Heartbeats every 200 s: only the push can deliver a cancel within a test."""
    queue.settings = queue.settings.replace(lease_seconds=600.0)
    return queue


async def until_state(queue: Queue, job_id: str, *states: State) -> None:
    async def reached() -> bool:
        return (await queue.status(job_id)).state in states

    await wait_for(reached, 20)


async def lines_of(queue: Queue, job_id: str) -> list[LogLine]:
    return [_lines.decode(line) for line in await queue.jobs.log_lines(job_id)]


# --- failures ---------------------------------------------------------------------------------
async def test_a_failed_attempt_keeps_a_bounded_traceback_everywhere(
    queue: Queue, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="jobtier.worker")
    sub = await queue.submit("deep_failure", None)
    await worker_for(queue, registry, burst=True).run()
    status = await queue.status(sub.job_id)
    assert status.state is State.FAILED and status.error is not None
    error = status.error
    assert error.type == "ValueError" and error.message.startswith("the record is incomplete")
    tb = error.traceback
    assert tb is not None
    # the innermost part is kept: the exception line, and the cause above it
    assert tb.rstrip().splitlines()[-1].startswith("ValueError: the record is incomplete")
    assert "KeyError: 'missing'" in tb and "in _recurse" in tb
    # bounded: 200 frames deep, yet at most 20 frames per exception and 4,000 characters
    assert len(tb) <= TRACEBACK_CHARS
    assert tb.count('  File "') <= 2 * TRACEBACK_FRAMES
    # the dead-letter listing shows it
    (dead,) = await queue.jobs.dead_letters(10)
    assert dead.id == sub.job_id and dead.error == error
    # one log record for the failure, carrying the traceback
    records = [r for r in caplog.records if "event=job_failed" in r.getMessage()]
    assert len(records) == 1 and records[0].exc_info is not None
    assert "error=ValueError" in records[0].getMessage()
    # its last attempt: a dead letter, a warning, no retry to come (was info, "retry_in_ms")
    assert records[0].levelname == "WARNING" and "dead_lettered=1" in records[0].getMessage()
    assert "retry_in_ms" not in records[0].getMessage()


async def test_a_task_that_raises_cancelled_error_itself_fails_rather_than_being_released(
    queue: Queue,
) -> None:
    """Released as a stop, such a job went back to the front of its queue and failed so again
    at once, tens of thousands of times, never counting an attempt."""
    sub = await queue.submit("cancelled_elsewhere", None)
    await worker_for(queue, registry, burst=True).run()
    status = await queue.status(sub.job_id)
    assert status.state is State.FAILED and status.attempt == 1, status
    assert status.error is not None and status.error.type == "CancelledError"
    assert status.version == 3  # submitted, claimed, failed: once


async def test_a_result_too_deep_to_encode_fails_the_job_rather_than_leaving_it_running(
    queue: Queue,
) -> None:
    sub = await queue.submit("too_deep", None)
    worker = worker_for(queue, registry)
    background = asyncio.create_task(worker.run())
    try:
        await until_state(queue, sub.job_id, State.FAILED)
    finally:
        worker.stop()
        await background
    status = await queue.status(sub.job_id)
    assert status.error is not None and status.error.type == "ResultNotSerialisable"
    assert "RecursionError" in status.error.message


def test_the_traceback_bound_holds_for_any_depth() -> None:
    def fail(depth: int) -> None:
        if depth == 0:
            raise RuntimeError("deep")
        fail(depth - 1)

    for depth in (0, 5, 50, 500):
        try:
            fail(depth)
        except RuntimeError as exc:
            text = format_traceback(exc)
        assert text.rstrip().endswith("RuntimeError: deep") and len(text) <= TRACEBACK_CHARS
        assert text.count('  File "') <= TRACEBACK_FRAMES
        # whole while short; past the frame cap its oldest frames go, said by a header
        assert text.startswith("Traceback (most recent call last):\n")
    long_message = "z" * (2 * TRACEBACK_CHARS)
    try:
        raise RuntimeError(long_message)
    except RuntimeError as exc:
        text = format_traceback(exc)
    # past the character cap the start goes, marked; the end (the exception) stays
    assert text.startswith("…\n") and text.rstrip().endswith("z" * 100)
    assert len(text) <= TRACEBACK_CHARS


async def test_a_refused_result_has_no_traceback(queue: Queue) -> None:
    sub = await queue.submit("unserialisable", None)
    await worker_for(queue, registry, burst=True).run()
    error = (await queue.status(sub.job_id)).error
    assert error is not None and error.type == "ResultNotSerialisable"
    assert error.traceback is None


# --- cancel: the push ---------------------------------------------------------------------------
async def test_the_push_stops_a_running_task_long_before_a_heartbeat(
    queue: Queue, background: Background, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="jobtier.worker")
    long_lease(queue)
    background.start(worker_for(queue, registry))
    sub = await queue.submit("wait_for_cancel", None)
    await until_state(queue, sub.job_id, State.RUNNING)
    await queue.cancel(sub.job_id)
    await until_state(queue, sub.job_id, State.CANCELLED)
    assert any(
        "event=cancel_requested" in r.getMessage() and "via=push" in r.getMessage()
        for r in caplog.records
    )
    status = await queue.status(sub.job_id)
    assert status.error is not None and status.error.type == "Cancelled"


async def test_without_the_push_the_heartbeat_still_delivers(
    queue: Queue, background: Background, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="jobtier.worker")
    queue.settings = queue.settings.replace(lease_seconds=1.5)  # heartbeats every 0.5 s
    background.start(worker_for(queue, registry, cancel_push=False))
    sub = await queue.submit("wait_for_cancel", None)
    await until_state(queue, sub.job_id, State.RUNNING)
    await queue.cancel(sub.job_id)
    await until_state(queue, sub.job_id, State.CANCELLED)
    messages = [
        r.getMessage() for r in caplog.records if "event=cancel_requested" in r.getMessage()
    ]
    assert messages and all("via=heartbeat" in m for m in messages)


async def test_a_push_acts_only_on_the_worker_that_runs_the_job(
    queue: Queue, background: Background
) -> None:
    long_lease(queue)
    a = worker_for(queue, registry, name="worker-a")
    background.start(a)
    sub = await queue.submit("wait_for_cancel", None)
    await until_state(queue, sub.job_id, State.RUNNING)
    b = worker_for(queue, registry, name="worker-b")
    background.start(b)
    await wait_for(lambda: b.idle)
    await queue.cancel(sub.job_id)
    await until_state(queue, sub.job_id, State.CANCELLED)
    assert a.stats.cancelled == 1 and b.stats.cancelled == 0
    assert not b.launcher.early_cancels  # it heard the push and let it be: not its job


async def test_a_push_that_overtakes_the_claim_reply_is_delivered_when_the_job_starts(
    queue: Queue,
) -> None:
    """The push travels on the subscriber's connection, the claim reply on the command
    connection: the push may be read first. The worker keeps it for the job it will start."""
    worker = worker_for(queue, registry, name="worker-early")
    worker.launcher.loop = asyncio.get_running_loop()
    sub = await queue.submit("wait_for_cancel", None)
    shard = queue.keys.shard_of(sub.job_id)
    batch = await queue.scripts.claim(shard, worker.id, 1, 600_000)
    (job,) = batch.jobs
    # the cancel (and its push) land before the worker has read the claim reply
    await queue.cancel(sub.job_id)
    worker._on_wake(queue.keys.wake(shard).encode(), f"x {job.id} {worker.id}".encode())
    assert job.id in worker.launcher.early_cancels
    worker.launcher.start(job, shard, batch.now_ms)
    running = worker.state.running[job.id]
    assert not worker.launcher.early_cancels and running.handle is not None
    await asyncio.wait({running.handle})
    assert running.ctx.cancel_requested
    await worker.reporter._send()  # the stop the attempt reported
    assert (await queue.status(job.id)).state is State.CANCELLED


# --- cancel: what a task that ends after the request ends as -----------------------------------
@pytest.mark.parametrize("kind", ["swallow_cancel", "poll_cancel_sync"])
async def test_a_result_returned_after_the_request_reached_the_task_is_cancelled(
    queue: Queue, background: Background, kind: str
) -> None:
    long_lease(queue)
    worker = worker_for(queue, registry)
    background.start(worker)
    sub = await queue.submit(kind, None)
    await until_state(queue, sub.job_id, State.RUNNING)
    await queue.cancel(sub.job_id)
    await until_state(queue, sub.job_id, State.CANCELLED, State.SUCCEEDED)
    status, result = await queue.result(sub.job_id)
    assert status.state is State.CANCELLED and result is None  # the result is dropped
    assert status.error is not None and status.error.type == "Cancelled"
    assert worker.stats.cancelled == 1 and worker.stats.succeeded == 0


@pytest.mark.parametrize("kind", ["swallow_cancel", "poll_cancel_sync"])
async def test_run_task_agrees_that_a_result_after_the_request_is_cancelled(kind: str) -> None:
    from jobtier.testing import start_task

    task = registry.get(kind)
    assert task is not None
    run = start_task(task, None)
    await asyncio.sleep(0)  # the attempt starts
    run.cancel()
    outcome = await run
    assert outcome.state == "cancelled" and outcome.result is None


async def test_a_success_before_the_request_reached_the_task_wins(
    queue: Queue, background: Background
) -> None:
    long_lease(queue)  # and no push: the request stays in Redis, undelivered
    background.start(worker_for(queue, registry, cancel_push=False))
    sub = await queue.submit("gated", None)
    await until_state(queue, sub.job_id, State.RUNNING)
    asked = await queue.cancel(sub.job_id)
    assert asked.state is State.RUNNING and asked.cancel_requested
    gate(sub.job_id).set()  # the task returns, not having seen the request
    await until_state(queue, sub.job_id, State.SUCCEEDED, State.CANCELLED)
    status, result = await queue.result(sub.job_id)
    assert status.state is State.SUCCEEDED and result == "done"


async def test_a_failure_after_a_cancel_request_is_cancelled_not_retried(
    queue: Queue, background: Background
) -> None:
    long_lease(queue)
    worker = worker_for(queue, registry, cancel_push=False)
    background.start(worker)
    sub = await queue.submit("gated", {"fail": True})
    await until_state(queue, sub.job_id, State.RUNNING)
    await queue.cancel(sub.job_id)
    gate(sub.job_id).set()  # it fails with a retryable error, attempts left
    await until_state(queue, sub.job_id, State.CANCELLED, State.SCHEDULED, State.FAILED)
    status = await queue.status(sub.job_id)
    assert status.state is State.CANCELLED and status.attempt == 1
    error = status.error
    assert error is not None and error.type == "Cancelled"
    assert "ConnectionError" in error.message
    assert error.traceback is not None and "ConnectionError: the downstream went away" in (
        error.traceback
    )
    shard = queue.keys.shard_of(sub.job_id)
    assert await queue.redis.zscore(queue.keys.sched(shard), sub.job_id) is None
    assert await queue.redis.zscore(queue.keys.dead(shard), sub.job_id) is None
    assert worker.stats.cancelled == 1 and worker.stats.retried == 0


async def test_a_cancelled_job_does_not_show_an_earlier_attempts_error(
    queue: Queue, background: Background
) -> None:
    background.start(worker_for(queue, registry))
    sub = await queue.submit("fail_once", None)
    await until_state(queue, sub.job_id, State.SCHEDULED)  # its retry is 10 minutes away
    failed = await queue.status(sub.job_id)
    assert failed.error is not None and failed.error.type == "RuntimeError"
    status = await queue.cancel(sub.job_id)
    assert status.state is State.CANCELLED
    assert status.error is not None and status.error.type == "Cancelled"
    assert status.error.message == "cancelled on request while scheduled"


async def test_a_cancelled_job_whose_worker_died_says_so(queue: Queue) -> None:
    sub = await queue.submit("gated", None)
    shard = queue.keys.shard_of(sub.job_id)
    await queue.scripts.claim(shard, "gone-worker", 1, 1)  # a 1 ms lease, never extended
    await queue.cancel(sub.job_id)

    async def reclaimed() -> bool:
        call = reclaim_call(shard, 10, 60, 60)
        await queue.scripts.call_many([call])
        return (await queue.status(sub.job_id)).state is State.CANCELLED

    await wait_for(reclaimed)
    error = (await queue.status(sub.job_id)).error
    assert error is not None and error.type == "Cancelled" and "gone-worker" in error.message


# --- log lines ----------------------------------------------------------------------------------
async def test_log_lines_reach_the_job_in_order_with_their_attempts(queue: Queue) -> None:
    sub = await queue.submit("chatty", {"n": 3, "fail_first": True})
    from jobtier.scheduler import Scheduler

    scheduler = Scheduler(queue.store)
    run = asyncio.create_task(scheduler.run())
    try:
        worker = worker_for(queue, registry)
        task = asyncio.create_task(worker.run())
        await until_state(queue, sub.job_id, State.SUCCEEDED)
        worker.stop()
        await task
    finally:
        scheduler.stop()
        await run
    lines = await lines_of(queue, sub.job_id)
    assert [(line.attempt, line.message) for line in lines] == [
        (1, "line 0"), (1, "line 1"), (1, "line 2"), (1, "done"),
        (2, "line 0"), (2, "line 1"), (2, "line 2"), (2, "done"),
    ]  # fmt: skip
    assert all(line.at.endswith("Z") for line in lines)
    # they expire with the job (a success: its retention)
    ttl = await queue.redis.ttl(queue.keys.lines(sub.job_id))
    assert 0 < ttl <= queue.settings.retention_seconds


async def test_log_lines_are_bounded_in_count_and_length(queue: Queue) -> None:
    sub = await queue.submit("chatty", {"n": LOG_LINES + 50, "long": 5000})
    thread = await queue.submit("chatty_sync", {"n": 5})
    await worker_for(queue, registry, burst=True).run()
    lines = await lines_of(queue, sub.job_id)
    assert len(lines) == LOG_LINES  # the latest
    assert lines[-1].message == "y" * (LOG_LINE_CHARS - 1) + "…"
    numbered = [line.message for line in lines if line.message.startswith("line ")]
    assert numbered[-1] == f"line {LOG_LINES + 49}"
    dropped = [line.message for line in lines if "dropped" in line.message]
    kept = len(numbered) + len(dropped) + 1
    assert kept == LOG_LINES
    assert [line.message for line in await lines_of(queue, thread.job_id)] == [
        f"thread line {i}" for i in range(5)
    ]
    # run_task shows what the job keeps
    chatty = registry.get("chatty")
    assert chatty is not None
    outcome = await run_task(chatty, {"n": 2, "long": 5000})
    assert outcome.logs == ["line 0", "line 1", "y" * (LOG_LINE_CHARS - 1) + "…"]
    sync = registry.get("chatty_sync")
    assert sync is not None
    assert (await run_task(sync, {"n": 2})).logs == ["thread line 0", "thread line 1"]


async def test_a_job_that_logs_nothing_writes_no_lines(queue: Queue) -> None:
    sub = await queue.submit("echo", 1)
    await worker_for(queue, registry, burst=True).run()
    assert await queue.redis.exists(queue.keys.lines(sub.job_id)) == 0
