"""Debounce and throttle by key (docs/debounce-throttle.md): keyed.lua decides and creates or
replaces in one step, on the single Redis and on the Cluster, and racing submits of one key
never make a second job (debounce) or a slot over the limit (throttle)."""

from __future__ import annotations

import asyncio
import base64
from datetime import datetime
from typing import Any

import pytest

from jobtier.config import Settings
from jobtier.core.debounce import Debounce, Throttled
from jobtier.core.errors import IdempotencyConflict, InvalidRequest, RateLimited, Retry
from jobtier.core.model import JobSpec, State, Submitted
from jobtier.engine.queue import Queue
from jobtier.scheduler import Scheduler
from jobtier.store.calls import promote_call
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import TaskRegistry, task
from tests.fixtures.engine import Background, wait_for, worker_for

pytestmark = pytest.mark.contract  # on the single Redis and on the Redis Cluster

ran: list[Any] = []  # payloads the task below ran with


@task(queue="digests")
async def digest(ctx: JobContext, payload: Any) -> Any:
    ran.append(payload)
    return payload


def ms_of(iso: str | None) -> int:
    assert iso is not None
    return round(datetime.fromisoformat(iso).timestamp() * 1000)


@task(queue="digests", retries=2)
async def again_later(ctx: JobContext, payload: Any) -> None:
    raise Retry(delay=60)


async def redis_ms(queue: Queue) -> int:
    seconds, micros = await queue.redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def stored_payload(queue: Queue, job_id: str) -> bytes:
    payload = await queue.redis.hget(queue.keys.job(job_id), "payload")
    assert isinstance(payload, bytes)
    return payload


async def test_a_debounced_submit_replaces_the_pending_job_and_restarts_its_wait(
    queue: Queue,
) -> None:
    first = await queue.submit(digest, {"n": 1}, debounce={"key": "user-7", "seconds": 60})
    assert first.created and first.status.state is State.SCHEDULED
    assert first.status.run_at is not None
    second = await queue.submit(
        "digest", {"n": 2}, priority="high", debounce={"key": "user-7", "seconds": 90}
    )
    assert not second.created and second.job_id == first.job_id
    status = second.status
    assert status.state is State.SCHEDULED and status.priority == "high"
    assert ms_of(status.run_at) > ms_of(first.status.run_at)
    assert status.version == first.status.version + 1
    assert await stored_payload(queue, first.job_id) == b'{"n":2}'
    # another key, type, queue or tenant is another job
    other = [
        await queue.submit(digest, 3, debounce={"key": "user-8", "seconds": 60}),
        await queue.submit("other", 3, queue="digests", debounce={"key": "user-7", "seconds": 60}),
        await queue.submit(digest, 3, queue="q2", debounce={"key": "user-7", "seconds": 60}),
        await queue.submit(digest, 3, tenant="t2", debounce={"key": "user-7", "seconds": 60}),
    ]
    assert all(s.created for s in other)
    assert len({s.job_id for s in other} | {first.job_id}) == 5
    # one job in the sorted set of scheduled jobs, not one per submit
    scheduled = sum(
        [await queue.redis.zcard(queue.keys.sched(s)) for s in range(queue.keys.shards)]
    )
    assert scheduled == 5


async def test_max_wait_bounds_the_delay_from_the_first_submit(queue: Queue) -> None:
    option = {"key": "k", "seconds": 60, "max_wait": 60}
    first = await queue.submit(digest, 1, debounce=option)
    again = await queue.submit(digest, 2, debounce=option)
    assert again.job_id == first.job_id
    assert again.status.run_at == first.status.run_at  # capped at first submit + max_wait


async def test_a_spent_max_wait_makes_the_job_ready_at_once(queue: Queue) -> None:
    option = {"key": "k", "seconds": 0.05, "max_wait": 0.05}
    first = await queue.submit(digest, 1, debounce=option)
    run_at_ms = ms_of(first.status.run_at)

    async def due() -> bool:
        return await redis_ms(queue) > run_at_ms

    await wait_for(due)  # no scheduler runs here: the job still waits, its wait spent
    again = await queue.submit(digest, 2, debounce=option)
    assert again.job_id == first.job_id and again.status.state is State.QUEUED
    assert await stored_payload(queue, first.job_id) == b"2"
    # the key is free again: the next submit is a new job
    third = await queue.submit(digest, 3, debounce=option)
    assert third.created and third.job_id != first.job_id


async def test_a_key_whose_job_left_the_schedule_makes_a_new_job(queue: Queue) -> None:
    first = await queue.submit(digest, 1, debounce={"key": "k", "seconds": 60})
    await queue.cancel(first.job_id)
    again = await queue.submit(digest, 2, debounce={"key": "k", "seconds": 60})
    assert again.created and again.job_id != first.job_id


async def test_a_key_whose_job_waits_for_a_retry_makes_a_new_job(
    queue: Queue, background: Background
) -> None:
    first = await queue.submit(again_later, 1, debounce={"key": "k", "seconds": 60})
    # due now, with the key's record still held: only the job's own state can tell it ran
    shard = queue.keys.shard_of(first.job_id)
    await queue.redis.zadd(queue.keys.sched(shard), {first.job_id: 0})
    await queue.scripts.call(*promote_call(shard, 100))
    background.start(worker_for(queue, TaskRegistry([again_later])))

    async def retrying() -> bool:
        status = await queue.status(first.job_id)
        return status.state is State.SCHEDULED and status.attempt == 1

    await wait_for(retrying)  # scheduled again, but it has run: not the key's pending job
    again = await queue.submit(again_later, 2, debounce={"key": "k", "seconds": 60})
    assert again.created and again.job_id != first.job_id


@task(queue="slowed", retries=2)
async def slowed_down(ctx: JobContext, payload: Any) -> None:
    ran.append(payload)  # it ran part-way on this payload before the downstream said no
    raise RateLimited(retry_after=60)


async def test_a_key_whose_job_ran_and_was_refunded_makes_a_new_job(
    queue: Queue, background: Background
) -> None:
    ran.clear()
    first = await queue.submit(slowed_down, 1, debounce={"key": "k", "seconds": 60})
    # due now, the key's record still held (it lives on past the quiet period)
    shard = queue.keys.shard_of(first.job_id)
    await queue.redis.zadd(queue.keys.sched(shard), {first.job_id: 0})
    await queue.scripts.call(*promote_call(shard, 100))
    background.start(worker_for(queue, TaskRegistry([slowed_down])))

    async def refunded() -> bool:  # back in the schedule, its attempt given back
        status = await queue.status(first.job_id)
        return status.state is State.SCHEDULED and status.error is not None

    await wait_for(refunded)
    assert (await queue.status(first.job_id)).attempt == 0 and ran == [1]
    again = await queue.submit(slowed_down, 2, debounce={"key": "k", "seconds": 60})
    assert again.created and again.job_id != first.job_id
    assert await stored_payload(queue, first.job_id) == b"1"  # what it ran with, kept


async def test_racing_debounced_submits_make_one_job(settings: Settings) -> None:
    queues = [await Queue.connect(settings, catalog=False) for _ in range(4)]
    try:
        option = {"key": "race", "seconds": 60}
        results = await asyncio.gather(
            *(queues[i % 4].submit(digest, i, debounce=option) for i in range(40))
        )
        assert len({r.job_id for r in results}) == 1
        assert [r.created for r in results].count(True) == 1
        last = max(results, key=lambda r: r.status.version)
        assert last.status.version == 40  # each submit one transition of the one job
        # the job holds the payload of the submit whose transition came last
        assert await stored_payload(queues[0], last.job_id) in {b"%d" % i for i in range(40)}
    finally:
        for q in queues:
            await q.close()


async def test_the_job_runs_once_with_the_last_payload(
    queue: Queue, background: Background
) -> None:
    ran.clear()
    option = {"key": "burst", "seconds": 0.3}
    subs = [await queue.submit(digest, i, debounce=option) for i in range(5)]
    assert len({s.job_id for s in subs}) == 1
    background.start(Scheduler(queue.store))
    background.start(worker_for(queue, TaskRegistry([digest])))

    async def done() -> bool:
        return (await queue.status(subs[0].job_id)).state is State.SUCCEEDED

    await wait_for(done)
    assert ran == [4]


async def test_throttle_refuses_beyond_its_limit(queue: Queue) -> None:
    option = {"key": "api-x", "limit": 3, "period": 60}
    made = [await queue.submit(digest, i, throttle=option) for i in range(3)]
    assert all(s.created and s.status.state is State.QUEUED for s in made)
    with pytest.raises(Throttled) as refused:
        await queue.submit(digest, 9, throttle=option)
    assert 0 < refused.value.retry_after <= 60
    # the refused submit made nothing
    stats = await queue.admin.stats()
    assert stats["queues"]["digests"]["queued"]["normal"] == 3
    # the key is the tenant's: another tenant has its own
    assert (await queue.submit(digest, 1, tenant="t2", throttle=option)).created


async def test_a_throttle_slot_frees_a_period_after_it(queue: Queue) -> None:
    option = {"key": "slide", "limit": 1, "period": 0.2}
    first = await queue.submit(digest, 1, throttle=option)
    with pytest.raises(Throttled):
        await queue.submit(digest, 2, throttle=option)
    freed = ms_of(first.status.created_at) + 200

    async def passed() -> bool:
        return await redis_ms(queue) >= freed

    await wait_for(passed)  # Redis's clock, the one the window is kept in
    assert (await queue.submit(digest, 3, throttle=option)).created


async def test_a_throttled_repeat_with_its_idempotency_key_takes_no_slot(queue: Queue) -> None:
    option = {"key": "pay", "limit": 2, "period": 60}
    first = await queue.submit(digest, {"n": 1}, idempotency_key="order-1", throttle=option)
    again = await queue.submit(digest, {"n": 1}, idempotency_key="order-1", throttle=option)
    assert first.created and not again.created and again.job_id == first.job_id
    with pytest.raises(IdempotencyConflict):
        await queue.submit(digest, {"n": 2}, idempotency_key="order-1", throttle=option)
    # the repeats took no slot: one is left
    assert (
        await queue.submit(digest, {"n": 3}, idempotency_key="order-2", throttle=option)
    ).created
    with pytest.raises(Throttled):
        await queue.submit(digest, {"n": 4}, idempotency_key="order-3", throttle=option)
    # a repeat of an admitted submit is still answered once the key is full
    assert (
        await queue.submit(digest, {"n": 1}, idempotency_key="order-1", throttle=option)
    ).job_id == first.job_id


async def test_throttle_delay_schedules_at_the_next_free_slot(queue: Queue) -> None:
    option = {"key": "api-y", "limit": 2, "period": 30, "on_limit": "delay"}
    subs = [await queue.submit(digest, i, throttle=option) for i in range(5)]
    states = [s.status.state for s in subs]
    assert states == [State.QUEUED] * 2 + [State.SCHEDULED] * 3
    starts = [ms_of(s.status.run_at or s.status.created_at) for s in subs]
    assert_no_window_over(starts, 2, 30)
    # the third waits a period after the first, the fifth a period after the third
    assert 30_000 <= starts[2] - starts[0] < 31_000
    assert starts[4] - starts[2] == 30_000


async def test_throttle_delay_refuses_a_slot_further_than_a_run_at_may_be(
    settings: Settings,
) -> None:
    async with await Queue.connect(settings.replace(max_future_seconds=60), catalog=False) as queue:
        option = {"key": "far", "limit": 1, "period": 50, "on_limit": "delay"}
        now = await queue.submit(digest, 1, throttle=option)
        later = await queue.submit(digest, 2, throttle=option)
        assert ms_of(later.status.run_at) - ms_of(now.status.created_at) >= 50_000
        with pytest.raises(Throttled) as refused:  # its slot would be 100 s ahead
            await queue.submit(digest, 3, throttle=option)
        assert 30 < refused.value.retry_after <= 40  # then it would be 60 s ahead


def assert_no_window_over(starts: list[int], limit: int, period: float) -> None:
    """No window of ``period`` seconds holds more than ``limit`` of ``starts`` (ms)."""
    ordered = sorted(starts)
    for i in range(len(ordered) - limit):
        assert ordered[i + limit] - ordered[i] >= period * 1000


async def test_racing_throttled_submits_never_pass_the_limit(settings: Settings) -> None:
    queues = [await Queue.connect(settings, catalog=False) for _ in range(4)]
    try:
        refuse = {"key": "r", "limit": 5, "period": 60}
        results = await asyncio.gather(
            *(queues[i % 4].submit(digest, i, throttle=refuse) for i in range(30)),
            return_exceptions=True,
        )
        made = [r for r in results if isinstance(r, Submitted)]
        assert len(made) == 5
        assert all(isinstance(r, Throttled) for r in results if r not in made)
        delay = {"key": "d", "limit": 4, "period": 20, "on_limit": "delay"}
        delayed = await asyncio.gather(
            *(queues[i % 4].submit(digest, i, throttle=delay) for i in range(13))
        )
        starts = [ms_of(s.status.run_at or s.status.created_at) for s in delayed]
        assert_no_window_over(starts, 4, 20)
        assert sum(s.status.state is State.QUEUED for s in delayed) == 4
    finally:
        for q in queues:
            await q.close()


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"debounce": {"key": "k", "seconds": 0}}, "debounce.seconds"),
        ({"debounce": {"key": "k", "seconds": 5, "max_wait": 1}}, "debounce.max_wait"),
        ({"debounce": {"key": "a b", "seconds": 5}}, "debounce.key"),
        ({"debounce": {"key": "k", "seconds": 5}, "delay": 3}, "debounce"),
        ({"debounce": {"key": "k", "seconds": 5}, "idempotency_key": "i"}, "debounce"),
        ({"throttle": {"key": "k", "limit": 0, "period": 1}}, "throttle.limit"),
        ({"throttle": {"key": "k", "limit": 2, "period": 1, "on_limit": "x"}}, "throttle.on_limit"),
        ({"throttle": {"key": "k", "limit": 2, "period": 1e12}}, "throttle.period"),
        ({"throttle": ["k", 2, 1]}, "throttle"),
        ({"throttle": {"key": "k", "limit": 2, "period": 1}, "concurrency_key": "c"}, "throttle"),
        (
            {"debounce": {"key": "k", "seconds": 5}, "throttle": {"key": "k", "limit": 1, "period": 1}},
            "throttle",
        ),
    ],
)  # fmt: skip
async def test_bad_options_are_refused_and_change_nothing(
    queue: Queue, options: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidRequest) as refused:
        await queue.submit(digest, 1, **options)
    assert refused.value.field == field
    for shard in range(queue.keys.shards):
        assert await queue.redis.xlen(queue.keys.log(shard)) == 0


async def test_an_encrypted_payload_may_be_throttled_but_not_debounced(
    settings: Settings,
) -> None:
    key = "k1:" + base64.b64encode(bytes(range(32))).decode()
    sealed = settings.replace(encryption_keys=key, encrypted_queues="digests")
    async with await Queue.connect(sealed, catalog=False) as queue:
        with pytest.raises(InvalidRequest) as refused:
            await queue.submit(digest, {"card": 1}, debounce={"key": "k", "seconds": 5})
        assert refused.value.field == "debounce"
        made = await queue.submit(
            digest, {"card": 1}, throttle={"key": "k", "limit": 1, "period": 5}
        )
        assert made.created
        assert not (await stored_payload(queue, made.job_id)).startswith(b'{"card"')


async def test_a_batch_refuses_keyed_jobs(queue: Queue) -> None:
    specs = [
        JobSpec(type="digest"),
        JobSpec(type="digest", debounce=Debounce(key="k", seconds=5)),
    ]
    with pytest.raises(InvalidRequest) as refused:
        await queue.submit_many(specs)
    assert refused.value.field == "jobs[1].debounce"
