"""Named queues: routing to worker pools, hand-back, pause, concurrency keys, tenant fairness."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from jobtier.core.errors import RateLimited
from jobtier.core.model import JobSpec, QueueLimits, State
from jobtier.engine.queue import Queue
from jobtier.scheduler import Scheduler
from jobtier.store.calls import complete_call
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import TaskRegistry, task
from tests.fixtures.engine import Background, wait_for, worker_for

pytestmark = pytest.mark.contract  # on the single Redis and on the Redis Cluster

ran: dict[str, list[str]] = {}  # worker name -> job ids it ran


@task(queue="emails")
async def send_email(ctx: JobContext, payload: Any) -> str:
    ran.setdefault(ctx.worker_id, []).append(ctx.job_id)
    return "sent"


@task(queue="reports")
async def build_report(ctx: JobContext, payload: Any) -> str:
    ran.setdefault(ctx.worker_id, []).append(ctx.job_id)
    return "built"


@task
async def checksum(ctx: JobContext, payload: Any) -> str:
    ran.setdefault(ctx.worker_id, []).append(ctx.job_id)
    return "sum"


@task
async def resize(ctx: JobContext, payload: Any) -> str:
    ran.setdefault(ctx.worker_id, []).append(ctx.job_id)
    return "resized"


gates: dict[str, asyncio.Event] = {}  # one per test: an Event belongs to one event loop


@task(queue="slow")
async def hold(ctx: JobContext, payload: Any) -> str:
    await gates["hold"].wait()
    return "released"


async def test_a_job_goes_to_its_task_queue_and_the_status_says_which(queue: Queue) -> None:
    sub = await queue.submit(send_email, {"to": "a@b"})
    assert sub.status.queue == "emails"
    assert (await queue.submit("send_email", None, queue="reports")).status.queue == "reports"
    assert (await queue.submit("anything", None)).status.queue == "default"
    stats = await queue.admin.stats()
    assert stats["queues"]["emails"]["queued"]["normal"] == 1
    assert stats["queues"]["reports"]["queued"]["normal"] == 1


async def test_two_worker_pools_never_touch_each_others_jobs(queue: Queue) -> None:
    ran.clear()
    emails = [(await queue.submit(send_email, i)).job_id for i in range(40)]
    reports = [(await queue.submit(build_report, i)).job_id for i in range(40)]
    a = worker_for(queue, TaskRegistry([send_email]), burst=True, name="pool-a")
    b = worker_for(queue, TaskRegistry([build_report]), burst=True, name="pool-b")
    assert a.queues == ["emails"] and b.queues == ["reports"]
    await asyncio.gather(a.run(), b.run())
    assert sorted(ran["pool-a"]) == sorted(emails)
    assert sorted(ran["pool-b"]) == sorted(reports)
    assert a.stats.handed_back == b.stats.handed_back == 0
    for job_id in emails + reports:
        status = await queue.status(job_id)
        assert status.state is State.SUCCEEDED and status.attempt == 1


async def test_pools_sharing_a_queue_hand_jobs_to_the_one_that_has_the_task(
    queue: Queue, background: Background
) -> None:
    """Both pools serve `default` (their tasks name no queue): what one cannot run is handed
    back, untouched, and the other runs it; nothing fails, no attempt is lost."""
    ran.clear()
    jobs = {}
    for i in range(30):
        jobs[(await queue.submit(checksum, i)).job_id] = "sums"
        jobs[(await queue.submit(resize, i)).job_id] = "images"
    sums = worker_for(queue, TaskRegistry([checksum]), name="sums", concurrency=5)
    images = worker_for(queue, TaskRegistry([resize]), name="images", concurrency=5)
    background.start(sums)
    background.start(images)

    async def all_done() -> bool:
        return all([(await queue.status(j)).terminal for j in jobs])

    await wait_for(all_done, timeout=60)
    for job_id, pool_name in jobs.items():
        status = await queue.status(job_id)
        assert status.state is State.SUCCEEDED and status.attempt == 1, status
        assert job_id in ran[pool_name]
    assert (await queue.admin.stats())["total"]["parked"] == 0


async def test_a_worker_serves_the_queues_it_is_given(queue: Queue) -> None:
    ran.clear()
    e = (await queue.submit(send_email, 1)).job_id
    r = (await queue.submit(build_report, 1)).job_id
    both = TaskRegistry([send_email, build_report])
    only_reports = worker_for(queue, both, burst=True, queues=["reports"], name="r")
    await only_reports.run()
    assert ran["r"] == [r]
    assert (await queue.status(e)).state is State.QUEUED
    await worker_for(queue, both, burst=True, name="all").run()
    assert ran["all"] == [e]


async def test_a_paused_queue_accepts_jobs_and_runs_none_until_resumed(
    queue: Queue, background: Background
) -> None:
    ran.clear()
    await queue.admin.pause("emails")
    first = await queue.submit(send_email, 1)
    other = await queue.submit(build_report, 1)
    worker = worker_for(queue, TaskRegistry([send_email, build_report]), name="w", idle_poll=0.1)
    background.start(worker)

    async def report_done() -> bool:
        return (await queue.status(other.job_id)).state is State.SUCCEEDED

    await wait_for(report_done)
    # the worker has gone round its queues (the report ran) and keeps idling over `emails`
    rounds = worker.stats.claim_round_trips

    async def went_round_again() -> bool:
        return worker.stats.claim_round_trips > rounds + 2

    await wait_for(went_round_again)
    assert (await queue.status(first.job_id)).state is State.QUEUED
    stats = await queue.admin.stats()
    assert stats["queues"]["emails"]["paused"] is True
    await queue.admin.resume("emails")

    async def email_done() -> bool:
        return (await queue.status(first.job_id)).state is State.SUCCEEDED

    await wait_for(email_done)
    assert (await queue.admin.stats())["queues"]["emails"]["paused"] is False


async def test_pause_lets_running_jobs_finish(queue: Queue, background: Background) -> None:
    gates["hold"] = gate = asyncio.Event()
    sub = await queue.submit(hold, None)
    worker = worker_for(queue, TaskRegistry([hold]), name="slow")
    background.start(worker)

    async def running() -> bool:
        return (await queue.status(sub.job_id)).state is State.RUNNING

    await wait_for(running)
    await queue.admin.pause("slow")
    gate.set()

    async def done() -> bool:
        return (await queue.status(sub.job_id)).state is State.SUCCEEDED

    await wait_for(done)


async def test_concurrency_key_lets_one_job_of_a_key_run_at_a_time_in_order(
    queue: Queue,
) -> None:
    shard_ids = []
    for i in range(5):
        sub = await queue.submit("echo", i, concurrency_key="account-7")
        shard_ids.append(sub.job_id)
    other = await queue.submit("echo", "free", concurrency_key="account-8")
    shard = queue.keys.shard_of(shard_ids[0])
    assert {queue.keys.shard_of(j) for j in shard_ids} == {shard}  # a key lives in one shard
    stats = await queue.admin.stats()
    assert stats["total"]["queued"] == 2  # one of each key is ready, four wait behind theirs
    assert stats["total"]["held"] == 4 and stats["queues"]["default"]["held"] == 4
    assert stats["shards"][shard]["held"] == 4
    order = []
    held = []
    for _ in range(5):
        held.append((await queue.admin.stats())["total"]["held"])
        batch = await queue.scripts.claim(queue.keys.shard_of(shard_ids[0]), "w", 10, 30_000)
        mine = [j for j in batch.jobs if j.id in shard_ids]
        assert len(mine) == 1  # never two of the key at once
        order.append(mine[0].id)
        # a second claim while it runs finds nothing of the key
        again = await queue.scripts.claim(shard, "w", 10, 30_000)
        assert not [j for j in again.jobs if j.id in shard_ids]
        code = await queue.scripts.call(
            *complete_call(shard, "w", 60, [(mine[0].id, mine[0].lease_version, b"")])
        )
        assert code == [0]
    assert order == shard_ids  # in submit order
    assert held == [4, 3, 2, 1, 0]  # each admitted as the one before it ended
    assert (await queue.status(other.job_id)).state in (State.QUEUED, State.RUNNING)


async def test_concurrency_limit_above_one_and_cancel_of_a_held_job(queue: Queue) -> None:
    ids = [
        (await queue.submit("echo", i, concurrency_key="k", concurrency_limit=2)).job_id
        for i in range(4)
    ]
    shard = queue.keys.shard_of(ids[0])
    assert (await queue.admin.stats())["total"]["held"] == 2
    await queue.cancel(ids[2])  # held behind the key: cancelled in place
    assert (await queue.admin.stats())["total"]["held"] == 1
    batch = await queue.scripts.claim(shard, "w", 10, 30_000)
    assert [j.id for j in batch.jobs] == ids[:2]
    items = [(j.id, j.lease_version, b"") for j in batch.jobs]
    await queue.scripts.call(*complete_call(shard, "w", 60, items[:1]))
    assert (await queue.admin.stats())["total"]["held"] == 0
    batch = await queue.scripts.claim(shard, "w", 10, 30_000)
    assert [j.id for j in batch.jobs] == [ids[3]]
    assert (await queue.status(ids[2])).state is State.CANCELLED


async def test_jobs_held_before_their_count_was_kept_leave_it_as_it_is(queue: Queue) -> None:
    """A deployment upgraded with jobs already held behind a key: they were never counted
    (nor marked), and as they start they take nothing from the count of those held since."""
    old = [(await queue.submit("echo", i, concurrency_key="old")).job_id for i in range(3)]
    shard = queue.keys.shard_of(old[0])
    for job_id in old:  # as before the count: no mark, no count
        await queue.redis.hdel(queue.keys.job(job_id), "h")
    await queue.redis.hdel(queue.keys.queue_counts(shard), "default:held")
    new = [(await queue.submit("echo", i, concurrency_key="old")).job_id for i in (3, 4)]
    held, order = [], []
    for _ in range(5):
        held.append((await queue.admin.stats())["total"]["held"])
        (job,) = (await queue.scripts.claim(shard, "w", 10, 30_000)).jobs
        order.append(job.id)
        item = [(job.id, job.lease_version, b"")]
        await queue.scripts.call(*complete_call(shard, "w", 60, item))
    assert order == old + new
    assert held == [2, 2, 2, 1, 0]  # exact for the jobs held since, whatever came before


async def test_one_tenants_backlog_does_not_starve_another_tenants_job(queue: Queue) -> None:
    """Tenant `big` has 100K jobs waiting in the same queue and priority; tenant `small`
    submits one: the very next claim of that shard serves it."""
    specs = [JobSpec(type="echo") for _ in range(1000)]
    for _ in range(100):
        await queue.submit_many(specs, tenant="big")
    small = await queue.submit("echo", "me", tenant="small")
    shard = queue.keys.shard_of(small.job_id)
    claims = 0
    found = False
    while not found and claims < 5:
        batch = await queue.scripts.claim(shard, "w", 10, 30_000)
        claims += 1
        found = small.job_id in [j.id for j in batch.jobs]
    assert found and claims == 1
    assert (await queue.admin.stats())["total"]["queued"] == 100_000 + 1 - 10 * claims


# --- limits across every worker ----------------------------------------------------------------
started_at: list[tuple[str, int]] = []  # (job id, claimed at ms: Redis's clock)


@task(queue="partner")
async def call_partner(ctx: JobContext, payload: Any) -> str:
    started_at.append((ctx.job_id, ctx.job.claimed_at_ms))
    await asyncio.sleep(0.02)
    return "ok"


async def running_in_redis(queue: Queue, name: str) -> int:
    """Jobs of the queue Redis counts as running now, summed over shards."""
    pipe = queue.redis.pipeline(transaction=False)
    for shard in range(queue.keys.shards):
        pipe.hget(queue.keys.queue_counts(shard), f"{name}:running")
    return sum(int(v or 0) for v in await pipe.execute())


async def test_global_concurrency_limit_holds_across_workers(
    queue: Queue, background: Background
) -> None:
    await queue.admin.set_limits("partner", QueueLimits(concurrency=3))
    assert (await queue.admin.limits()) == {"partner": QueueLimits(concurrency=3)}
    ids = [(await queue.submit(call_partner, i)).job_id for i in range(60)]
    for n in range(2):
        background.start(
            worker_for(queue, TaskRegistry([call_partner]), concurrency=10, name=f"w{n}")
        )
    most = 0

    async def all_done() -> bool:
        nonlocal most
        most = max(most, await running_in_redis(queue, "partner"))
        assert await queue.admin.running_permits("partner") <= 3
        return all([(await queue.status(j)).state is State.SUCCEEDED for j in ids])

    await wait_for(all_done, timeout=60, interval=0.005)
    assert 1 <= most <= 3
    assert await queue.admin.running_permits("partner") == 0  # every permit came back


async def test_rate_limit_holds_over_any_window(queue: Queue, background: Background) -> None:
    started_at.clear()
    await queue.admin.set_limits("partner", QueueLimits(rate=5, per=0.5))
    ids = [(await queue.submit(call_partner, i)).job_id for i in range(17)]
    background.start(worker_for(queue, TaskRegistry([call_partner]), concurrency=20))

    async def all_done() -> bool:
        return all([(await queue.status(j)).state is State.SUCCEEDED for j in ids])

    await wait_for(all_done, timeout=60)
    times = sorted(at for _, at in started_at)
    assert len(times) == 17
    for i, t in enumerate(times):  # no window of 500 ms holds more than 5 starts
        assert len([u for u in times[i:] if u < t + 500]) <= 5
    # and it is a limit, not a stop: 17 starts need at least three more windows
    assert times[-1] - times[0] >= 3 * 500 - 50


async def test_a_limit_set_while_workers_run_is_obeyed(
    queue: Queue, background: Background
) -> None:
    worker = worker_for(queue, TaskRegistry([call_partner]), concurrency=10, name="early")
    background.start(worker)
    first = await queue.submit(call_partner, 0)

    async def done(job_id: str) -> bool:
        return (await queue.status(job_id)).state is State.SUCCEEDED

    await wait_for(lambda: done(first.job_id))
    await queue.admin.set_limits("partner", QueueLimits(concurrency=1))
    ids = [(await queue.submit(call_partner, i)).job_id for i in range(20)]
    most = 0

    async def all_done() -> bool:
        nonlocal most
        most = max(most, await running_in_redis(queue, "partner"))
        return all([await done(j) for j in ids])

    await wait_for(all_done, timeout=60, interval=0.005)
    assert most == 1
    await queue.admin.set_limits("partner", QueueLimits())  # lifted: claimed freely again
    assert await queue.admin.limits() == {}
    again = await queue.submit(call_partner, 99)
    await wait_for(lambda: done(again.job_id))


limited_once: set[str] = set()


@task(queue="partner", retries=0)
async def slow_down(ctx: JobContext, payload: Any) -> str:
    started_at.append((ctx.job_id, ctx.job.claimed_at_ms))
    if ctx.job_id not in limited_once:
        limited_once.add(ctx.job_id)
        raise RateLimited("429 from partner", retry_after=0.4)
    return "ok"


async def test_rate_limited_pushes_the_queue_back_without_using_an_attempt(
    queue: Queue, background: Background
) -> None:
    started_at.clear()
    limited_once.clear()
    first = await queue.submit(slow_down, 1)
    background.start(worker_for(queue, TaskRegistry([slow_down]), name="rl"))
    background.start(Scheduler(queue.store))  # it promotes the job when its wait is over

    async def blocked_now() -> bool:
        stats = await queue.admin.stats()
        return bool(stats["queues"].get("partner", {}).get("blocked_until_ms"))

    await wait_for(blocked_now)
    blocked = (await queue.admin.stats())["queues"]["partner"]["blocked_until_ms"]
    limited_once.add("next")  # the next job would run at once, were the queue not blocked
    second = await queue.submit(slow_down, 2)
    limited_once.add(second.job_id)

    async def both_done() -> bool:
        states = [(await queue.status(j)).state for j in (first.job_id, second.job_id)]
        return states == [State.SUCCEEDED, State.SUCCEEDED]

    await wait_for(both_done, timeout=30)
    status = await queue.status(first.job_id)
    assert status.attempt == 1 and status.max_attempts == 1  # the limited attempt did not count
    later = dict(started_at)
    assert later[second.job_id] >= blocked  # it waited for the block to end


async def test_a_block_ends_by_redis_clock_and_the_later_of_two_stands(
    queue: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks asked at once (a burst of 429s) leave the latest end on every shard, whatever
    their order; the end is counted from Redis's clock, not the caller's (a host two minutes
    behind still blocks for the seconds asked), and bounded by JOBTIER_MAX_FUTURE_SECONDS;
    resume leaves a block, unblock lifts it, its permits' too, and leaves a pause."""
    import time

    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 120)  # this host's clock, behind
    for _ in range(5):
        ends = await asyncio.gather(*(queue.admin.block("partner", s) for s in (1, 600, 1, 2)))
        assert max(ends) == ends[1]
    seconds, micros = await queue.redis.time()
    now_ms = seconds * 1000 + micros // 1000
    fields = [
        await queue.redis.hget(queue.keys.queue_counts(s), "partner:blocked")
        for s in range(queue.keys.shards)
    ]
    assert all(now_ms + 590_000 <= int(v or 0) <= now_ms + 600_000 for v in fields), fields
    await queue.admin.set_limits("partner", QueueLimits(concurrency=2))
    await queue.scripts.call("limit", queue.keys.home("partner"), ("block", "partner", 60_000))
    assert await queue.redis.hget(queue.keys.limit("partner"), "blocked")
    await queue.admin.pause("partner")
    await queue.admin.resume("partner")
    assert [
        await queue.redis.hget(queue.keys.queue_counts(s), "partner:blocked")
        for s in range(queue.keys.shards)
    ] == fields
    await queue.admin.pause("partner")
    assert await queue.admin.unblock("partner") == max(int(v or 0) for v in fields)
    after = [
        await queue.redis.hget(queue.keys.queue_counts(s), "partner:blocked")
        for s in range(queue.keys.shards)
    ]
    assert after == [None] * queue.keys.shards
    assert await queue.redis.hget(queue.keys.limit("partner"), "blocked") is None
    assert await queue.redis.hget(queue.keys.queue_counts(0), "partner:paused") == b"1"
    await queue.admin.resume("partner")
    await queue.admin.set_limits("partner", QueueLimits())
    # a block past the furthest future a job may be put off to is cut to it
    end = await queue.admin.block("huge", 1e15)
    assert end <= now_ms + 120_000 + queue.settings.max_future_seconds * 1000
    assert (await queue.admin.stats())["queues"]["huge"]["blocked_until_ms"] == end


@task(queue="partner-limited", retries=0)
async def told_to_wait_limited(ctx: JobContext, payload: Any) -> None:
    raise RateLimited("429 from partner", retry_after=60)


async def test_rate_limited_on_a_limited_queue_holds_its_permits_back_too(
    queue: Queue, background: Background
) -> None:
    """A Python task's RateLimited on a limited queue: every shard's claims and the queue's
    permits (limit.lua) wait, through the one block_queue the API's holds use too."""
    await queue.admin.set_limits("partner-limited", QueueLimits(concurrency=2))
    await queue.submit(told_to_wait_limited, 1)
    background.start(worker_for(queue, TaskRegistry([told_to_wait_limited]), name="rl-lim"))
    limit = queue.keys.limit("partner-limited")

    async def permits_held() -> bool:
        return bool(await queue.redis.hget(limit, "blocked"))

    await wait_for(permits_held)
    ends = [
        await queue.redis.hget(queue.keys.queue_counts(s), "partner-limited:blocked")
        for s in range(queue.keys.shards)
    ]
    assert all(int(v or 0) > 0 for v in ends), ends
