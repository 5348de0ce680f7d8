"""A worker's shutdown keeps its word: real `jobtier worker` processes, real signals, real Redis.

``--grace`` is a bound from the signal however busy the slots are: the worker says it is
draining at once, and what is still running at the deadline is released to its queue (the
``stopped`` script: queued again, the attempt not counted). A second signal releases at once.
A sync task's thread cannot be interrupted: its job is released anyway, the process exits
without it, and what the thread produces later is refused by fencing.

The only time bound here is the hang guard; the order of events and the jobs' states are the
assertions.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import RedisCluster

from jobtier.config import Settings
from jobtier.core.errors import Code
from jobtier.core.model import State, decode_status
from jobtier.engine.queue import Queue
from jobtier.store.calls import complete_call
from tests import shutdown_tasks
from tests.fixtures.engine import wait_for, worker_for
from tests.fixtures.redis import admin, logged

HANG_GUARD = 60.0  # s: only stops a broken test from hanging; far above any grace used here
LONG = 600  # s: a job that will not end by itself during the test


class WorkerProcess:
    """`jobtier worker tests.shutdown_tasks` against the test's Redis, logging to a file."""

    def __init__(self, settings: Settings, log: Path, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("JOBTIER_")}
        env.update(
            JOBTIER_REDIS_URL=settings.redis_url,
            JOBTIER_SHARDS=str(settings.shards),
            JOBTIER_LEASE_SECONDS=str(settings.lease_seconds),
            PYTHONPATH=str(Path(__file__).parents[2]),
        )
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jobtier.cli.main", "worker", "tests.shutdown_tasks", *args],
                env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def events(self) -> list[str]:
        """The ``event=`` names logged so far, in order."""
        return re.findall(r"event=(\w+)", self.log.read_text())

    async def until_logged(self, event: str) -> None:
        async def logged() -> bool:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            return event in self.events()

        await wait_for(logged, HANG_GUARD)

    async def exit_code(self) -> int:
        try:
            return await asyncio.wait_for(asyncio.to_thread(self.proc.wait), HANG_GUARD)
        except TimeoutError:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(
                "the worker did not exit: " + self.log.read_text()[-3000:]
            ) from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def queue(queue: Queue) -> Queue:
    queue.produce.tasks = shutdown_tasks.registry
    return queue


Workers = Callable[..., WorkerProcess]


@pytest.fixture
def workers(settings: Settings, tmp_path: Path) -> Iterator[Workers]:
    started: list[WorkerProcess] = []

    def start(*args: str) -> WorkerProcess:
        worker = WorkerProcess(settings, tmp_path / f"worker{len(started)}.log", *args)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.kill()


async def running(queue: Queue, job_ids: list[str], n: int) -> None:
    async def started() -> bool:
        states = [(await queue.status(j)).state for j in job_ids]
        return states.count(State.RUNNING) == n

    await wait_for(started, HANG_GUARD)


async def history(queue: Queue, job_id: str) -> list[tuple[State, int]]:
    """(state, attempt) of each of the job's transitions, from its shard's log."""
    entries = await logged(queue.redis, queue.keys.log(queue.keys.shard_of(job_id)))
    docs = [decode_status(fields[b"d"]) for fields in entries]
    return [(d.state, d.attempt) for d in docs if d.id == job_id]


async def assert_released(queue: Queue, job_id: str) -> None:
    """Queued again with no attempt used: queued -> running (attempt 1) -> queued (0)."""
    status = await queue.status(job_id)
    assert status.state is State.QUEUED and status.attempt == 0, status
    assert await history(queue, job_id) == [
        (State.QUEUED, 0), (State.RUNNING, 1), (State.QUEUED, 0)
    ]  # fmt: skip


def in_order(events: list[str], *expected: str) -> None:
    """Each of ``expected`` was logged, each after the one before."""
    at = -1
    for event in expected:
        assert event in events[at + 1 :], f"{event} missing after {expected}: {events}"
        at = events.index(event, at + 1)


async def test_grace_is_kept_with_every_slot_busy(queue: Queue, workers: Workers) -> None:
    worker = workers("--concurrency", "2", "--grace", "1")
    jobs = [(await queue.submit("hold", {"seconds": LONG})).job_id for _ in range(3)]
    await running(queue, jobs, 2)  # both slots busy, one job waiting
    worker.proc.send_signal(signal.SIGTERM)
    assert await worker.exit_code() == 0
    events = worker.events()
    in_order(events, "signal", "worker_draining", "worker_releasing", "job_released",
             "job_released", "worker_stopped")  # fmt: skip
    assert "running=2" in worker.log.read_text().split("event=worker_draining")[1].split("\n")[0]
    assert "claim_abandoned" not in events  # the claim loop itself ended at the signal
    statuses = {j: await queue.status(j) for j in jobs}
    held = [j for j in jobs if statuses[j].version > 1]
    assert len(held) == 2
    for job_id in held:
        await assert_released(queue, job_id)
    (waiting,) = set(jobs) - set(held)  # never claimed: claiming stopped at the signal
    assert statuses[waiting].state is State.QUEUED and statuses[waiting].version == 1


async def test_second_signal_releases_at_once(queue: Queue, workers: Workers) -> None:
    worker = workers("--concurrency", "2", "--grace", str(10 * HANG_GUARD))
    jobs = [(await queue.submit("hold", {"seconds": LONG})).job_id for _ in range(2)]
    await running(queue, jobs, 2)
    worker.proc.send_signal(signal.SIGTERM)
    await worker.until_logged("worker_draining")
    worker.proc.send_signal(signal.SIGTERM)
    assert await worker.exit_code() == 0  # well before the grace: the second signal cut it
    in_order(worker.events(), "worker_draining", "worker_stop_now", "worker_releasing",
             "job_released", "job_released", "worker_stopped")  # fmt: skip
    assert "reason=stop_now" in worker.log.read_text()
    for job_id in jobs:
        await assert_released(queue, job_id)


async def test_a_sync_task_is_released_though_its_thread_runs_on(
    queue: Queue, workers: Workers
) -> None:
    worker = workers("--concurrency", "1", "--grace", "0.5")
    job = (await queue.submit("hold_sync", {"seconds": LONG})).job_id
    await running(queue, [job], 1)
    worker.proc.send_signal(signal.SIGTERM)
    assert await worker.exit_code() == 0  # without joining the thread, which sleeps on
    in_order(worker.events(), "worker_draining", "job_released", "worker_stopped",
             "exit_without_waiting")  # fmt: skip
    assert "stuck=1" in worker.log.read_text()
    await assert_released(queue, job)


async def test_the_late_result_of_a_released_sync_task_is_refused(queue: Queue) -> None:
    shutdown_tasks.gate.clear()
    shutdown_tasks.gated_done.clear()
    worker = worker_for(queue, shutdown_tasks.registry, shutdown_grace=0.2)
    run = asyncio.create_task(worker.run())
    job = (await queue.submit("gated", None)).job_id
    await running(queue, [job], 1)
    token = (await queue.status(job)).version  # the attempt's fencing token (version at claim)
    worker.stop()
    stats = await run
    assert stats.released == 1 and worker.stuck == 1  # the thread still waits at the gate
    released = await queue.status(job)
    await assert_released(queue, job)

    shutdown_tasks.gate.set()  # the thread now reports progress and returns its result
    await asyncio.to_thread(shutdown_tasks.gated_done.wait, HANG_GUARD)
    await asyncio.sleep(0)  # let a progress callback it queued on the loop run
    assert await queue.status(job) == released  # neither was applied

    # and had anything sent that result with the attempt's token, Redis would refuse it
    shard = queue.keys.shard_of(job)
    scripts = queue.scripts
    (code,) = await scripts.call(
        *complete_call(shard, worker.id, 60, [(job, token, b'"late result"')])
    )
    assert code != Code.OK
    assert await queue.status(job) == released


async def test_a_release_is_logged_once_redis_has_taken_it(
    queue: Queue, caplog: pytest.LogCaptureFixture
) -> None:
    """While Redis takes no write, a stopping worker says it is releasing its jobs, but not
    that they are released (it did, up to tens of seconds before they were)."""
    caplog.set_level(logging.INFO, logger="jobtier.worker")
    worker = worker_for(queue, shutdown_tasks.registry, shutdown_grace=0.1)
    run = asyncio.create_task(worker.run())
    job = (await queue.submit("hold", {"seconds": LONG})).job_id
    await running(queue, [job], 1)
    async with admin(queue.settings) as redis:  # (jobtier's own user may not pause)
        pause: dict[str, Any] = {}
        if isinstance(redis, RedisCluster):
            pause["target_nodes"] = RedisCluster.PRIMARIES
        await redis.execute_command("CLIENT", "PAUSE", "60000", "WRITE", **pause)
        try:
            worker.stop()
            await wait_for(lambda: "event=worker_releasing" in caplog.text, HANG_GUARD)
            assert "event=job_released" not in caplog.text
        finally:
            await redis.execute_command("CLIENT", "UNPAUSE", **pause)
    stats = await run
    assert stats.released == 1 and f"event=job_released worker={worker.id} job={job} type=hold" in (
        caplog.text
    )
    await assert_released(queue, job)
