"""Plain ``def`` tasks in the worker's process pool (worker/procpool.py), against a real Redis:
a child killed mid-job, cancel and timeout ending the child, recycling, and progress, logs
and ``ctx.cancel_requested`` from the child.

The tasks are in tests/procpool_tasks.py: a child imports them by name. Children show their
pid as the job's progress, so that a test can find (and kill) the process of a job.
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import threading
from typing import Any

import msgspec
import pytest

from jobtier.core.model import LogLine, State
from jobtier.engine.queue import Queue
from jobtier.metrics.snapshot import labels
from jobtier.scheduler import Scheduler
from jobtier.store.calls import reclaim_call
from jobtier.worker.procpool import ProcessOptions, ProcessPool
from jobtier.worker.registry import TaskRegistry
from jobtier.worker.runner import Worker
from tests.fixtures.engine import Background, wait_for, worker_for
from tests.procpool_tasks import registry

MIB = 1024 * 1024
_lines = msgspec.json.Decoder(LogLine)


@pytest.fixture
def queue(queue: Queue) -> Queue:
    queue.produce.tasks = registry
    return queue


def pool_worker(queue: Queue, **options: Any) -> Worker:
    burst = options.pop("burst", False)
    concurrency = options.pop("concurrency", 4)
    executor = options.pop("executor", "thread")
    opts = ProcessOptions(**{"size": 2, "cancel_grace": 0.5, "kill_grace": 1.0, **options})
    return worker_for(
        queue,
        registry,
        burst=burst,
        concurrency=concurrency,
        executor=executor,
        processes=opts,
    )


def pool_of(worker: Worker) -> ProcessPool:
    pool = worker.launcher.processes
    assert pool is not None
    return pool


async def until_state(queue: Queue, job_id: str, *states: State) -> None:
    async def reached() -> bool:
        return (await queue.status(job_id)).state in states

    await wait_for(reached, 30)


async def pid_shown(queue: Queue, job_id: str) -> int:
    """The pid a child reported as its job's progress."""
    shown: list[int] = []

    async def reported() -> bool:
        progress = (await queue.status(job_id)).progress
        if isinstance(progress, dict) and "pid" in progress:
            shown.append(progress["pid"])
        return bool(shown)

    await wait_for(reported, 30)
    return shown[0]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_a_child_killed_mid_job_is_survived(queue: Queue, background: Background) -> None:
    background.start(Scheduler(queue.store))
    worker = pool_worker(queue)
    background.start(worker)
    other = await queue.submit("steady", {"seconds": 3.0})
    victim = await queue.submit("killed_once", None)
    other_pid = await pid_shown(queue, other.job_id)
    victim_pid = await pid_shown(queue, victim.job_id)
    assert victim_pid != other_pid and victim_pid in pool_of(worker).pids

    os.kill(victim_pid, signal.SIGKILL)
    beside = await queue.submit("echo", {"async": "job"})  # the worker's loop goes on too

    await until_state(queue, victim.job_id, State.SUCCEEDED)
    status, result = await queue.result(victim.job_id)
    assert status.attempt == 2 and result["attempt"] == 2 and result["pid"] != victim_pid
    await until_state(queue, other.job_id, State.SUCCEEDED)
    assert (await queue.result(other.job_id))[1] == {"pid": other_pid}  # its child untouched
    await until_state(queue, beside.job_id, State.SUCCEEDED)
    pool = pool_of(worker)
    assert pool.stats["died"] == 1 and not alive(victim_pid)
    assert worker.metrics().counters["worker_processes_total"][labels(event="died")] == 1
    assert len(pool.pids) == 2  # the pool replaced the dead child


async def test_a_crashed_child_fails_the_attempt_retryably_naming_the_signal(
    queue: Queue, background: Background
) -> None:
    background.start(Scheduler(queue.store))
    background.start(pool_worker(queue))
    sub = await queue.submit("aborts", None)  # two attempts, each an os.abort()
    await until_state(queue, sub.job_id, State.FAILED)
    status = await queue.status(sub.job_id)
    assert status.attempt == 2 and status.error is not None  # the first was retried
    assert status.error.type == "ProcessDied"
    assert "killed by signal SIGABRT" in status.error.message
    segv = await queue.submit("segfaults", None)
    await until_state(queue, segv.job_id, State.FAILED)
    status = await queue.status(segv.job_id)
    assert status.error is not None and status.error.type == "ProcessDied"
    assert "killed by signal SIGSEGV" in status.error.message


async def test_a_cancel_ends_a_child_that_does_not_listen(
    queue: Queue, background: Background
) -> None:
    worker = pool_worker(queue)
    background.start(worker)
    sub = await queue.submit("spins", None)
    pid = await pid_shown(queue, sub.job_id)
    await queue.cancel(sub.job_id)
    await until_state(queue, sub.job_id, State.CANCELLED)
    await wait_for(lambda: not alive(pid))
    assert pool_of(worker).stats["ended"] == 1


async def test_a_timeout_ends_the_child(queue: Queue, background: Background) -> None:
    worker = pool_worker(queue)
    background.start(worker)
    sub = await queue.submit("spins_too_long", None)  # timeout=1.0, no retry
    pool = pool_of(worker)
    await wait_for(lambda: sub.job_id in pool.busy)
    pid = pool.busy[sub.job_id]
    await until_state(queue, sub.job_id, State.FAILED)
    status = await queue.status(sub.job_id)
    assert status.error is not None and status.error.type == "TimeoutError"
    await wait_for(lambda: not alive(pid))
    assert pool.stats["ended"] == 1


async def test_progress_logs_and_cancel_requested_work_from_the_child(
    queue: Queue, background: Background
) -> None:
    worker = pool_worker(queue)
    background.start(worker)
    sub = await queue.submit("cooperative", None)
    pid = await pid_shown(queue, sub.job_id)
    progress = (await queue.status(sub.job_id)).progress
    assert progress == {"pid": pid, "attempt": 1, "job": sub.job_id} and pid != os.getpid()
    await queue.cancel(sub.job_id)
    await until_state(queue, sub.job_id, State.CANCELLED)

    async def both_lines() -> bool:
        return len(await queue.jobs.log_lines(sub.job_id)) == 2

    await wait_for(both_lines)
    lines = [_lines.decode(x) for x in await queue.jobs.log_lines(sub.job_id)]
    assert [x.message for x in lines] == [f"started in {pid}", "saw the cancel request"]
    assert all(x.attempt == 1 for x in lines)
    # the task stopped by itself: its child was not ended, and serves the next job
    pool = pool_of(worker)
    assert pool.stats["ended"] == 0 and alive(pid) and pid in pool.pids


async def test_a_task_error_from_the_child_keeps_its_type_and_traceback(queue: Queue) -> None:
    sub = await queue.submit("raises", {"n": 1})
    exits = await queue.submit("exits", None)
    await pool_worker(queue, burst=True).run()  # returns: the SystemExit stayed the job's
    status = await queue.status(exits.job_id)
    assert status.state is State.FAILED and status.error is not None
    assert (status.error.type, status.error.message) == ("RemoteError", "SystemExit: 3")
    status = await queue.status(sub.job_id)
    assert status.state is State.FAILED and status.error is not None
    assert status.error.type == "ValueError" and status.error.message == "bad input {'n': 1}"
    assert status.error.traceback is not None and "procpool_tasks.py" in status.error.traceback


async def test_children_are_replaced_after_max_jobs(queue: Queue) -> None:
    subs = [await queue.submit("pid_of", None) for _ in range(5)]
    worker = pool_worker(queue, burst=True, concurrency=1, size=1, max_jobs=2)
    await worker.run()
    pids = collections.Counter([(await queue.result(s.job_id))[1]["pid"] for s in subs])
    assert sorted(pids.values()) == [1, 2, 2]  # 2 jobs a child, the last child's third job
    assert pool_of(worker).stats["recycled"] == 2


async def test_children_are_replaced_past_max_rss(queue: Queue) -> None:
    # each job keeps 100 MiB more in its child: a child's second job passes 160 MiB whatever
    # its interpreter took to start (well under 60 MiB), its first does not
    subs = [await queue.submit("leak", {"mib": 100}) for _ in range(4)]
    worker = pool_worker(queue, burst=True, concurrency=1, size=1, max_rss_bytes=160 * MIB)
    await worker.run()
    pids = collections.Counter([(await queue.result(s.job_id))[1]["pid"] for s in subs])
    assert sorted(pids.values()) == [2, 2]
    assert pool_of(worker).stats["recycled"] == 2


async def test_the_worker_option_moves_plain_def_tasks_to_processes(queue: Queue) -> None:
    in_thread = await queue.submit("plain", None)
    await pool_worker(queue, burst=True).run()
    assert (await queue.result(in_thread.job_id))[1] == {"pid": os.getpid()}
    in_process = await queue.submit("plain", None)
    worker = pool_worker(queue, burst=True, executor="process")
    await worker.run()
    pid = (await queue.result(in_process.job_id))[1]["pid"]
    assert pid != os.getpid() and pool_of(worker).stats["started"] >= 1


async def test_dependencies_and_a_retry_delay_cross_between_worker_and_child(
    queue: Queue, background: Background
) -> None:
    background.start(Scheduler(queue.store))
    background.start(pool_worker(queue))
    first = await queue.submit("echo", {"n": 7})
    after = await queue.submit("reads_previous", None, depends_on=[first.job_id])
    later = await queue.submit("retry_then_ok", None)
    await until_state(queue, after.job_id, State.SUCCEEDED)
    assert (await queue.result(after.job_id))[1] == {"previous": {"n": 7}, "ids": [first.job_id]}
    # the Retry raised in the child kept its delay: the task's 60 s back-off would time out
    await until_state(queue, later.job_id, State.SUCCEEDED)
    assert (await queue.result(later.job_id))[1] == 2


async def test_a_shutdown_releases_a_process_job_and_ends_its_child(queue: Queue) -> None:
    worker = pool_worker(queue)
    worker.shutdown_grace = 0.3
    running = asyncio.create_task(worker.run())
    try:
        sub = await queue.submit("spins", None)
        pool = pool_of(worker)
        await wait_for(lambda: sub.job_id in pool.busy)
        pid = pool.busy[sub.job_id]
    finally:
        worker.stop()
        await running
    status = await queue.status(sub.job_id)
    assert status.state is State.QUEUED and status.attempt == 0  # released, no attempt used
    assert not alive(pid) and worker.stuck == 0


async def test_a_lost_lease_ends_the_child(queue: Queue, background: Background) -> None:
    # a beat every 0.5 s; the worker's beats are held back until the lease has expired and
    # the job was taken back, so that the next one is refused
    queue.settings = queue.settings.replace(lease_seconds=1.5)
    worker = pool_worker(queue)
    beat = worker.heartbeat._beat
    holding = asyncio.Event()

    async def beat_unless_holding(progress_only: bool) -> None:
        if not holding.is_set():
            await beat(progress_only)

    worker.heartbeat._beat = beat_unless_holding  # type: ignore[method-assign]
    background.start(worker)
    sub = await queue.submit("spins", None)
    pool = pool_of(worker)
    await wait_for(lambda: sub.job_id in pool.busy)
    pid = pool.busy[sub.job_id]
    holding.set()
    shard = queue.keys.shard_of(sub.job_id)

    async def taken_back() -> bool:  # its lease expired: a reclaim (the scheduler's) moves it
        await queue.scripts.call_many([reclaim_call(shard, 10, 60, 60)])
        status = await queue.status(sub.job_id)
        return status.state is not State.RUNNING or status.attempt > 1

    await wait_for(taken_back)
    assert alive(pid) and worker.stats.leases_lost == 0
    holding.clear()
    await wait_for(lambda: worker.stats.leases_lost == 1)
    await wait_for(lambda: not alive(pid))
    assert pool.stats["ended"] >= 1


async def test_a_large_payload_to_a_child_not_reading_yet_leaves_the_loop_free(
    queue: Queue, background: Background
) -> None:
    worker = pool_worker(queue, size=1)
    background.start(worker)
    pool = pool_of(worker)

    async def spawned() -> bool:
        return bool(pool.pids)

    await wait_for(spawned)
    (pid,) = pool.pids
    # a child that reads nothing (as one still importing): the payload overfills its pipe
    os.kill(pid, signal.SIGSTOP)
    resumed = threading.Event()

    def resume() -> None:  # the guard: a blocked loop cannot resume the child itself
        resumed.set()
        os.kill(pid, signal.SIGCONT)

    guard = threading.Timer(5.0, resume)
    guard.start()
    try:
        payload = "x" * (200 * 1024)
        job = await queue.submit("size_of", payload)

        async def sending() -> bool:
            return bool(pool.busy)

        await wait_for(sending)
        # the worker is writing to the stopped child; the loop still answers
        await queue.redis.ping()
        assert not resumed.is_set(), "the event loop was held until the child read"
    finally:
        guard.cancel()
        os.kill(pid, signal.SIGCONT)
    await until_state(queue, job.job_id, State.SUCCEEDED)
    assert (await queue.result(job.job_id))[1] == len(payload)


async def test_a_child_reads_the_checkpoint_an_earlier_attempt_saved(
    queue: Queue, background: Background
) -> None:
    from tests.procpool_resume_tasks import resumes_in_child, resumes_on_loop

    background.start(Scheduler(queue.store))
    job = await queue.submit(resumes_in_child, None)
    # attempt 1 on the event loop saves a state; attempt 2 runs in a child
    await worker_for(queue, TaskRegistry([resumes_on_loop]), burst=True).run()
    await until_state(queue, job.job_id, State.SCHEDULED, State.QUEUED)
    background.start(
        worker_for(queue, TaskRegistry([resumes_in_child]), processes=ProcessOptions(size=1))
    )
    await until_state(queue, job.job_id, State.SUCCEEDED, State.FAILED)
    status, result = await queue.result(job.job_id)
    assert status.state is State.SUCCEEDED and status.attempt == 2
    assert result["state"] == {"next": 3} and result["resumed"] is True
    assert result["saves"] == 0
    assert "await it from an async task" in result["refused"]
