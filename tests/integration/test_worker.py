"""The worker runtime against a real Redis and a real Redis Cluster (``contract``): results,
retries, timeouts, cancellation, shutdown."""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Any

import pytest
from redis.exceptions import SlotNotCoveredError

from jobtier.core.model import JobSpec, QueueLimits, State, decode_status
from jobtier.engine.queue import Queue
from jobtier.scheduler import Scheduler
from jobtier.store.calls import parse_claim
from jobtier.worker.permits import LimitedClaimer
from tests.fixtures.engine import Background, wait_for, worker_for
from tests.fixtures.redis import logged
from tests.tasks import registry
from tests.unit.loops import LoopErrors

pytestmark = pytest.mark.contract


@pytest.fixture
def queue(queue: Queue) -> Queue:
    """The engine queue, validating types against the test tasks (and taking their retry
    policies as the jobs' default max attempts)."""
    queue.produce.tasks = registry
    return queue


async def state_of(queue: Queue, job_id: str) -> State:
    return (await queue.status(job_id)).state


async def until_state(queue: Queue, job_id: str, *states: State, timeout: float = 15.0) -> None:
    async def reached() -> bool:
        return await state_of(queue, job_id) in states

    await wait_for(reached, timeout)


async def test_burst_worker_runs_jobs_and_stores_results(queue: Queue) -> None:
    subs = [await queue.submit("echo", {"n": i}) for i in range(30)]
    blocking = await queue.submit("blocking", {"seconds": 0.01})
    stats = await worker_for(queue, registry, burst=True, concurrency=8).run()
    assert stats.succeeded == 31
    for i, sub in enumerate(subs):
        status, result = await queue.result(sub.job_id)
        assert status.state is State.SUCCEEDED and result == {"n": i}
    status, result = await queue.result(blocking.job_id)
    assert result == {"ran_in_thread": True} and status.progress == {"thread": True}


async def test_retries_follow_the_backoff_then_dead_letter(
    queue: Queue, background: Background
) -> None:
    background.start(Scheduler(queue.store))
    background.start(worker_for(queue, registry))
    sub = await queue.submit("flaky", None)  # fails every attempt; 4 attempts
    await until_state(queue, sub.job_id, State.FAILED, timeout=20)
    shard = queue.keys.shard_of(sub.job_id)
    retries = []
    for fields in await logged(queue.redis, queue.keys.log(shard)):
        doc = decode_status(fields[b"d"])
        if doc.id == sub.job_id and doc.state is State.SCHEDULED:
            assert doc.run_at is not None
            waited = (
                datetime.fromisoformat(doc.run_at) - datetime.fromisoformat(doc.updated_at)
            ).total_seconds()
            retries.append((doc.attempt, waited))
    policy = registry.get("flaky").retry  # type: ignore[union-attr]
    assert [a for a, _ in retries] == [1, 2, 3]
    for attempt, waited in retries:
        plain = policy.base * policy.factor ** (attempt - 1)
        assert plain - 0.002 <= waited <= plain * (1 + policy.jitter) + 0.002, (attempt, waited)
    status = await queue.status(sub.job_id)
    assert status.attempt == 4 and status.error is not None and status.error.type == "RuntimeError"
    assert [d.id for d in await queue.jobs.dead_letters()] == [sub.job_id]
    await queue.jobs.replay(sub.job_id)
    await until_state(queue, sub.job_id, State.FAILED, timeout=20)


async def test_success_after_retries(queue: Queue, background: Background) -> None:
    background.start(Scheduler(queue.store))
    background.start(worker_for(queue, registry))
    sub = await queue.submit("flaky", {"succeed_on": 2})
    later = await queue.submit("retry_later", None)
    await until_state(queue, sub.job_id, State.SUCCEEDED)
    await until_state(queue, later.job_id, State.SUCCEEDED)
    assert (await queue.result(sub.job_id))[1] == "ok on 2"
    assert (await queue.result(later.job_id))[1] == "second time lucky"


async def test_non_retryable_errors_and_bad_results_dead_letter_at_once(queue: Queue) -> None:
    permanent = await queue.submit("permanent", None)
    fatal = await queue.submit("fail", {"fatal": True})
    bad = await queue.submit("unserialisable", None)
    await worker_for(queue, registry, burst=True).run()
    for sub, error_type in [
        (permanent, "Permanent"),
        (fatal, "Fatal"),
        (bad, "ResultNotSerialisable"),
    ]:
        status = await queue.status(sub.job_id)
        assert status.state is State.FAILED and status.attempt == 1, sub
        assert status.error is not None and status.error.type == error_type


async def test_a_job_of_a_type_the_worker_lacks_is_handed_back_untouched(queue: Queue) -> None:
    queue.produce.tasks = None  # let a type no worker knows through
    unknown = await queue.submit("not_in_this_worker", None, max_attempts=1)
    known = await queue.submit("echo", "x")
    worker = worker_for(queue, registry, burst=True)
    await worker.run()
    status = await queue.status(unknown.job_id)
    assert (status.state, status.attempt, status.version, status.error) == (
        State.QUEUED,
        0,
        1,
        None,
    )  # no transition, no attempt used
    assert (await queue.status(known.job_id)).state is State.SUCCEEDED
    assert worker.stats.handed_back == 1
    stats = await queue.admin.stats()
    assert stats["total"]["parked"] == 1 and stats["total"]["queued"] == 0
    # a second run of the same worker does not meet it again: parked jobs are out of its way
    again = worker_for(queue, registry, burst=True)
    await again.run()
    assert again.stats.handed_back == 0 and again.stats.claim_round_trips <= 2


async def test_timeout_counts_as_a_retryable_failure(queue: Queue, background: Background) -> None:
    background.start(Scheduler(queue.store))
    background.start(worker_for(queue, registry))
    sub = await queue.submit("too_slow", None)
    await until_state(queue, sub.job_id, State.FAILED)
    status = await queue.status(sub.job_id)
    assert status.attempt == 2 and status.error is not None and status.error.type == "TimeoutError"


async def test_cancel_a_running_job(queue: Queue, background: Background) -> None:
    background.start(worker_for(queue, registry))
    sub = await queue.submit("sleep", {"seconds": 30})
    await until_state(queue, sub.job_id, State.RUNNING)

    async def progressed() -> bool:
        return (await queue.status(sub.job_id)).progress is not None

    await wait_for(progressed)  # progress reports reach the status document
    status = await queue.cancel(sub.job_id)
    assert status.cancel_requested and status.state is State.RUNNING
    await until_state(queue, sub.job_id, State.CANCELLED)


async def test_graceful_stop_releases_unfinished_jobs(queue: Queue) -> None:
    worker = worker_for(queue, registry, shutdown_grace=0.3)
    task = asyncio.create_task(worker.run())
    quick = await queue.submit("slow", {"seconds": 0.05})
    long = await queue.submit("slow", {"seconds": 60})
    await until_state(queue, long.job_id, State.RUNNING)
    await until_state(queue, quick.job_id, State.SUCCEEDED)
    worker.stop()
    stats = await task
    assert stats.released == 1
    status = await queue.status(long.job_id)
    assert status.state is State.QUEUED and status.attempt == 0


async def test_idle_worker_picks_up_new_jobs(queue: Queue, background: Background) -> None:
    worker = worker_for(queue, registry, idle_poll=3600)  # only wakes can bring it work
    background.start(worker)
    for _ in range(3):
        await wait_for(lambda: worker.idle)  # asleep, every queue it knows of empty
        sub = await queue.submit("echo", "hi")
        await until_state(queue, sub.job_id, State.SUCCEEDED)
    assert worker.stats.succeeded == 3
    await wait_for(lambda: worker.idle)


async def test_burst_worker_drains_every_shard(queue: Queue) -> None:
    # concurrency 2 over 4 shards: a claim round asks only two shards, the first round the
    # first two, which are empty; the jobs wait in the others
    last = queue.keys.shards - 1
    specs = [
        queue.produce.prepare(JobSpec(type="echo"), "default", job_id=queue.keys.new_id(s))
        for s in (last, last - 1)
    ]
    await queue.produce.submit_prepared(specs)
    stats = await worker_for(queue, registry, burst=True, concurrency=2).run()
    assert stats.succeeded == 2
    assert (await queue.admin.stats())["total"]["queued"] == 0


async def test_a_task_waiting_for_cancel_sees_it(queue: Queue, background: Background) -> None:
    background.start(worker_for(queue, registry))
    sub = await queue.submit("wait_for_cancel", None)
    await until_state(queue, sub.job_id, State.RUNNING)
    await queue.cancel(sub.job_id)
    await until_state(queue, sub.job_id, State.CANCELLED)


async def test_a_job_released_at_shutdown_ends_without_an_error_in_the_loop(
    queue: Queue,
) -> None:
    """The cancelled attempt of a released job ends after the job left the running set: that
    must be quiet, not an exception in a task nobody awaits."""
    loop_errors = LoopErrors(asyncio.get_running_loop())
    sub = await queue.submit("slow", {"seconds": 30})
    worker = worker_for(queue, registry, shutdown_grace=0.1)
    run = asyncio.create_task(worker.run())

    async def running() -> bool:
        return (await queue.status(sub.job_id)).state is State.RUNNING

    await wait_for(running)
    worker.stop()
    await run
    assert (await queue.status(sub.job_id)).state is State.QUEUED
    loop_errors.check()


async def test_the_claim_for_freed_slots_goes_ahead_of_their_outcomes(queue: Queue) -> None:
    """Jobs that end free their slots and queue their outcomes in the same turn of the event
    loop: the claim for those slots must reach Redis first (reporter.py, _send), so
    that Redis answers it while it records the outcomes and the worker starts the new jobs
    meanwhile. Recorded where each call starts its pipeline, which writes it at once."""

    async def fill(n: int) -> None:
        await queue.produce.submit_prepared(
            [queue.produce.prepare(JobSpec(type="echo"), "default") for _ in range(n)]
        )

    # a first run opens the connections both loops use (a connection being opened would
    # hold back whichever call waits for it)
    await fill(100)
    assert (await worker_for(queue, registry, burst=True, concurrency=50).run()).succeeded == 100
    await fill(600)
    worker = worker_for(queue, registry, burst=True, concurrency=50)
    scripts = worker.state.scripts
    call_many = scripts.call_many
    # the claim round's and the reporter's (each call's reply apart)
    call_many_each = scripts.call_many_each
    sent: list[tuple[str, int]] = []  # ('claim', its number) / ('complete', its jobs' claim)
    claim_of: dict[str, int] = {}  # job id -> the number of the claim that gave it

    async def claim(calls: Any, send: Any) -> list[Any]:
        number = sum(1 for kind, _ in sent if kind == "claim") + 1
        sent.append(("claim", number))
        replies: list[Any] = await send(calls)
        for (_, s, _), reply in zip(calls, replies, strict=True):
            for job in parse_claim(s, reply).jobs:
                claim_of[job.id] = number
        return replies

    async def spy_on(send: Any, calls: Any) -> list[Any]:
        if any(name == "claim" for name, _, _ in calls):
            return await claim(calls, send)
        for script, _, args in calls:
            if script == "complete":
                sent.append(("complete", max(claim_of[i] for i in args[3::3])))
        replies: list[Any] = await send(calls)
        return replies

    async def spy(calls: Any) -> list[Any]:
        return await spy_on(call_many, calls)

    async def spy_each(calls: Any) -> list[Any]:
        return await spy_on(call_many_each, calls)

    scripts.call_many = spy  # type: ignore[method-assign]
    scripts.call_many_each = spy_each  # type: ignore[method-assign]
    assert (await worker.run()).succeeded == 600
    # the last round's outcomes have no claim to wait for: the queues are empty by then
    # the last round's outcomes have no claim to wait for: the queues are empty by then
    last_round = max(claim_of.values())
    checked = [i for i, (kind, k) in enumerate(sent) if kind == "complete" and k < last_round]
    assert len(checked) >= 8, sent  # 50 slots, 600 jobs: 12 rounds or more

    def claim_went_first(i: int) -> bool:
        # the last claim started before these outcomes came after the claim of their jobs
        return [n for kind, n in sent[:i] if kind == "claim"][-1] > sent[i][1]

    # Outcomes sent the other way round, none would be. Not all must: outcomes that end while
    # the reporter waits for its last send's reply go when that reply comes, which can be in
    # the turn the claim loop wakes in, ahead of it.
    assert sum(map(claim_went_first, checked)) >= len(checked) // 2, sent


async def test_a_crash_of_the_heartbeat_stops_the_worker_and_releases_its_jobs(
    queue: Queue, caplog: pytest.LogCaptureFixture
) -> None:
    """A defect of ours in the heartbeat's loop (not Redis away, which it rides out) leaves
    the worker unable to keep its leases: it stops at once, its running job released to its
    queue, and ``run`` raises the crash, logged once (it used to go on claiming, the crash
    unseen until the worker stopped, its jobs' leases expiring meanwhile)."""
    worker = worker_for(queue, registry, shutdown_grace=30.0)
    advertise = worker.heartbeat.advertise
    crash = asyncio.Event()  # set once the job runs: the next full beat's chores crash

    async def advertise_then_crash() -> None:
        if crash.is_set():
            raise RuntimeError("a defect in the chores")
        await advertise()

    worker.heartbeat.advertise = advertise_then_crash  # type: ignore[method-assign]
    task = asyncio.create_task(worker.run())
    try:
        sub = await queue.submit("sleep", {"seconds": 60})
        await until_state(queue, sub.job_id, State.RUNNING)
        crash.set()
        with pytest.raises(RuntimeError, match="a defect in the chores"):
            await asyncio.wait_for(asyncio.shield(task), 60)
        assert worker.state.stop_now.is_set()  # at once, not after a 30 s grace
    finally:
        worker.stop(now=True)
        await asyncio.gather(task, return_exceptions=True)
    status = await queue.status(sub.job_id)
    assert (status.state, status.attempt) == (State.QUEUED, 0), status
    assert worker.stats.released == 1
    crash_lines = [r for r in caplog.records if "a defect in the chores" in r.getMessage()]
    assert len(crash_lines) == 1 and "event=heartbeat_crashed" in crash_lines[0].getMessage()
    assert not [r for r in caplog.records if "shutdown_step_failed" in r.getMessage()]


async def test_a_crash_of_a_limited_queues_loop_stops_the_worker(
    queue: Queue, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A defect of ours in a limited queue's claim loop (not Redis away, which it rides out)
    would leave the queue claimed no more by this worker, unseen: the worker stops, and
    ``run`` raises the crash, logged once."""
    await queue.admin.set_limits("default", QueueLimits(concurrency=2))

    async def crash(self: LimitedClaimer) -> float | None:
        raise RuntimeError("a defect in the limited loop")

    monkeypatch.setattr(LimitedClaimer, "round", crash)
    worker = worker_for(queue, registry, shutdown_grace=5.0)
    task = asyncio.create_task(worker.run())
    try:
        with pytest.raises(RuntimeError, match="a defect in the limited loop"):
            await asyncio.wait_for(asyncio.shield(task), 60)
    finally:
        worker.stop(now=True)
        await asyncio.gather(task, return_exceptions=True)
    lines = [r for r in caplog.records if "a defect in the limited loop" in r.getMessage()]
    assert len(lines) == 1 and "event=claim_loop_crashed" in lines[0].getMessage()


async def test_a_heartbeat_rides_out_the_cluster_clients_own_errors(queue: Queue) -> None:
    """redis-py's cluster client raises some faults of Redis away from a class of its own (a
    slot no node serves, mid-failover), not a RedisError: the heartbeat rides them out as it
    does a lost connection, rather than stopping the worker."""
    worker = worker_for(queue, registry)
    advertise = worker.heartbeat.advertise
    calls = 0

    async def advertise_once_refused() -> None:
        nonlocal calls
        calls += 1
        if calls == 2:  # the first is the start's own
            raise SlotNotCoveredError("Slot 1234 is not covered by the cluster.")
        await advertise()

    worker.heartbeat.advertise = advertise_once_refused  # type: ignore[method-assign]
    task = asyncio.create_task(worker.run())
    try:
        await wait_for(lambda: calls >= 3, timeout=60)  # the chores ran again after it
        assert not worker.state.stopping.is_set() and not task.done()
        sub = await queue.submit("echo", "still working")
        await until_state(queue, sub.job_id, State.SUCCEEDED)
    finally:
        worker.stop()
        await asyncio.gather(task, return_exceptions=True)
    assert task.exception() is None


async def test_a_cancelled_worker_leaves_no_loop_running_and_releases_its_jobs(
    queue: Queue,
) -> None:
    """``run`` cancelled (a task group whose sibling failed, say): its claim loops end with it
    and its running job goes back to its queue (the loops used to go on claiming, with no
    heartbeat keeping the leases of what they started)."""
    await queue.admin.set_limits("partner", QueueLimits(concurrency=2))
    worker = worker_for(queue, registry, queues=["default", "partner"])
    task = asyncio.create_task(worker.run())
    sub = await queue.submit("sleep", {"seconds": 60})
    await until_state(queue, sub.job_id, State.RUNNING)
    # started by the worker, not only claimed in Redis (a claim cut by the cancel is
    # test_a_claim_cut_by_the_stop_gives_its_jobs_back's)
    await wait_for(lambda: sub.job_id in worker.state.running)
    await wait_for(lambda: "partner" in worker.limits)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    def loops_left() -> list[str]:
        names = ("jobtier-claims", "jobtier-heartbeat", "claim partner")
        return [t.get_name() for t in asyncio.all_tasks() if t.get_name() in names]

    await wait_for(lambda: not loops_left(), timeout=30)
    status = await queue.status(sub.job_id)
    assert (status.state, status.attempt) == (State.QUEUED, 0), status


class ReplyLost:
    """A worker's scripts whose first claim to lease a job runs in Redis and whose reply
    never arrives: the worker waits for it until its claim is cancelled (a stop cutting a claim
    in flight, the reply on its way)."""

    def __init__(self, scripts: Any) -> None:
        self._scripts = scripts
        self.leased = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scripts, name)

    async def call_many_each(self, calls: Any) -> list[Any]:
        replies: list[Any] = await self._scripts.call_many_each(calls)
        claimed = any(
            not isinstance(reply, Exception) and int(reply[2]) > 0
            for (name, _, args), reply in zip(calls, replies, strict=True)
            if name == "claim" and int(args[1]) > 0
        )
        if claimed and not self.leased.is_set():
            self.leased.set()
            await asyncio.Event().wait()  # the reply is lost on its way
        return replies


@pytest.mark.parametrize("how", ["cancelled", "deadline"])
@pytest.mark.parametrize("limited", [False, True], ids=["main-loop", "limited-queue"])
async def test_a_claim_cut_by_the_stop_gives_its_jobs_back(
    queue: Queue, how: str, limited: bool
) -> None:
    """A worker stopped while a claim's reply is on its way (``run`` cancelled; or the claim
    abandoned at the shutdown's deadline) gives back the jobs that claim leased in Redis: they
    are queued again, their attempt not counted, when ``run`` ends, rather than ``running``
    under a lease nobody keeps until it expires. A limited queue's claim (its own loop, with
    permits) releases the permit its round held too, not left to hold the queue's one slot for
    a lease; and a cancelled ``run`` waits for that loop a bounded time (it waited for its
    claim for ever)."""
    name = "partner" if limited else "default"
    if limited:
        await queue.admin.set_limits(name, QueueLimits(concurrency=1))
    worker = worker_for(queue, registry, queues=[name], shutdown_grace=0.5)
    lost = ReplyLost(worker.claimer._scripts)
    worker.claimer._scripts = lost  # type: ignore[assignment]
    task = asyncio.create_task(worker.run())
    try:
        sub = await queue.submit("sleep", {"seconds": 60}, queue=name)
        await asyncio.wait_for(lost.leased.wait(), timeout=30)
        assert await state_of(queue, sub.job_id) is State.RUNNING  # leased, never started
        assert sub.job_id not in worker.state.running
        if limited:
            assert await queue.redis.zcard(queue.keys.permits(name)) == 1
        if how == "cancelled":
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), 60)
        else:
            worker.stop()
            await task
    finally:
        worker.stop(now=True)
        await asyncio.gather(task, return_exceptions=True)
    status = await queue.status(sub.job_id)
    assert (status.state, status.attempt) == (State.QUEUED, 0), status
    assert worker.stats.released == 1
    if limited:
        assert await queue.redis.zcard(queue.keys.permits(name)) == 0  # released
