"""Job expiry (docs/expiry.md): a job not started by its expiry is cancelled, its error an
Expired one, when a claim reaches it, and the claim takes another in its place; on the single
Redis and on the Redis Cluster (claim.lua, submit.lua)."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from jobtier.core.debounce import Debounce, Unique
from jobtier.core.errors import InvalidRequest, Retry
from jobtier.core.model import JobSpec, JobStatus, State
from jobtier.engine.queue import Queue
from jobtier.store.calls import claim_call, parse_claim
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import TaskRegistry, task
from tests.fixtures.engine import Background, wait_for, worker_for
from tests.fixtures.redis import logged

pytestmark = pytest.mark.contract  # on the single Redis and on the Redis Cluster


@task(name="notify")
async def notify(ctx: JobContext, payload: Any) -> Any:
    return payload


@task(name="flaky_notify", retries=3)
async def flaky_notify(ctx: JobContext, payload: Any) -> int:
    if ctx.attempt == 1:
        raise Retry("not yet", delay=3600)
    return ctx.attempt


@task(name="refuses", retries=0)
async def refuses(ctx: JobContext, payload: Any) -> None:
    raise RuntimeError("no")


REGISTRY = TaskRegistry([notify, flaky_notify, refuses])


async def redis_ms(queue: Queue) -> int:
    """Redis's clock (claim.lua compares the expiry with it; a Cluster's nodes share this
    machine's)."""
    got = await queue.redis.time()
    seconds, micros = next(iter(got.values())) if isinstance(got, dict) else got
    return int(seconds) * 1000 + int(micros) // 1000


async def past_expiry(queue: Queue, job_id: str, expires_ms: int) -> None:
    """Wait (for Redis's clock, not a fixed time) until the job's expiry has passed."""

    async def passed() -> bool:
        return await redis_ms(queue) > expires_ms

    await wait_for(passed, timeout=20)


async def expiry_of(queue: Queue, job_id: str) -> int:
    base = queue.keys.log(queue.keys.shard_of(job_id)).rpartition("log")[0]
    got = await queue.redis.hget(f"{base}job:{job_id}", "ex")
    assert got is not None
    return int(got)


def expired(status: JobStatus) -> bool:
    return (
        status.state is State.CANCELLED
        and status.error is not None
        and status.error.type == "Expired"
    )


async def test_a_job_past_its_expiry_is_cancelled_by_the_claim_that_reaches_it(
    queue: Queue,
) -> None:
    stale = (await queue.submit("notify", {"n": 1}, expires=0.2)).job_id
    shard = queue.keys.shard_of(stale)
    fresh = (await queue.submit("notify", {"n": 2}, expires=3600)).job_id
    ex = await expiry_of(queue, stale)
    await past_expiry(queue, stale, ex)
    # two jobs asked for (one claim per shard); the stale one expires in the claim
    claimed = []
    for s in {shard, queue.keys.shard_of(fresh)}:
        [reply] = await queue.scripts.call_many([claim_call(s, "w-expiry", 2, 60_000)])
        claimed += [j.id for j in parse_claim(s, reply).jobs]
    assert claimed == [fresh]
    status = await queue.status(stale)
    assert expired(status), status
    assert status.attempt == 0  # never started
    assert status.error is not None and "expiry" in status.error.message
    # an expiry a job was not past when claimed lets it run
    assert (await queue.status(fresh)).state is State.RUNNING


async def test_a_job_claimed_before_its_expiry_runs(queue: Queue, background: Background) -> None:
    at = datetime.now(UTC) + timedelta(hours=1)
    job_id = (await queue.submit("notify", {"n": 3}, expires=at)).job_id
    assert await expiry_of(queue, job_id) == round(at.timestamp() * 1000)
    background.start(worker_for(queue, REGISTRY))

    async def done() -> bool:
        return (await queue.status(job_id)).state is State.SUCCEEDED

    await wait_for(done, timeout=20)


async def test_an_expired_job_gives_up_its_concurrency_keys_place(
    queue: Queue, background: Background
) -> None:
    first = (
        await queue.submit("notify", {"n": 1}, concurrency_key="k", expires=timedelta(seconds=0.2))
    ).job_id
    second = (await queue.submit("notify", {"n": 2}, concurrency_key="k")).job_id
    await past_expiry(queue, first, await expiry_of(queue, first))
    background.start(worker_for(queue, REGISTRY))

    async def second_done() -> bool:
        return (await queue.status(second)).state is State.SUCCEEDED

    await wait_for(second_done, timeout=20)  # held behind `first` until it expired
    assert expired(await queue.status(first))


async def test_an_attempt_whose_retry_is_due_after_the_expiry_ends_the_job_at_once(
    queue: Queue, background: Background, caplog: pytest.LogCaptureFixture
) -> None:
    """flaky_notify's first attempt asks for a retry an hour on: past the job's expiry, so no
    claim would start it. The attempt cancels the job then, rather than schedule it."""
    caplog.set_level(logging.INFO, logger="jobtier.worker")
    job_id = (await queue.submit("flaky_notify", None, expires=60)).job_id
    background.start(worker_for(queue, REGISTRY))

    async def gone() -> bool:
        return expired(await queue.status(job_id))

    await wait_for(gone, timeout=20)
    status = await queue.status(job_id)
    assert status.attempt == 1 and status.run_at is None  # never scheduled
    assert status.error is not None and "its retry would be due at" in status.error.message
    assert "which then failed with Retry" in status.error.message
    assert status.error.message.startswith("not started again by its expiry, ")
    mine = [
        f
        for f in await logged(queue.redis, queue.keys.log(queue.keys.shard_of(job_id)))
        if job_id.encode() in f[b"d"]
    ]
    assert (mine[-1][b"fr"], mine[-1][b"w"]) == (b"running", b"expiry")
    assert not [f for f in mine if b'"state":"scheduled"' in f[b"d"]]
    # the worker logged the attempt as retried before Redis answered; it says what came of it
    said = [r.getMessage() for r in caplog.records if "event=job_cancelled" in r.getMessage()]
    assert len(said) == 1 and f"job={job_id}:" in said[0]


async def test_a_retry_due_before_the_expiry_is_scheduled(
    queue: Queue, background: Background
) -> None:
    job_id = (await queue.submit("flaky_notify", None, expires=7200)).job_id  # retry at 3600
    background.start(worker_for(queue, REGISTRY))

    async def backing_off() -> bool:
        s = await queue.status(job_id)
        return s.state is State.SCHEDULED and s.attempt == 1

    await wait_for(backing_off, timeout=20)


async def test_a_replayed_dead_letter_runs_whatever_its_expiry(
    queue: Queue, background: Background
) -> None:
    job_id = (await queue.submit(refuses, None, expires=0.5)).job_id  # one attempt
    ex = await expiry_of(queue, job_id)
    worker = background.start(worker_for(queue, REGISTRY))

    async def failed() -> bool:
        return (await queue.status(job_id)).state is State.FAILED

    await wait_for(failed, timeout=20)
    await past_expiry(queue, job_id, ex)
    await queue.jobs.replay(job_id)  # an operator's: to run it, past its expiry or not
    assert not worker.done()

    async def failed_again() -> bool:
        s = await queue.status(job_id)
        return s.state is State.FAILED and s.error is not None and s.error.type == "RuntimeError"

    await wait_for(failed_again, timeout=20)
    versions = await queue.status(job_id)
    assert versions.attempt == 1  # ran again (attempts reset by the replay), not expired


class In:
    """A time this many seconds from when the test runs (``time``)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def time(self) -> datetime:
        return datetime.now(UTC) + timedelta(seconds=self.seconds)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"expires_in": 10, "expires_at": In(3600)}, "expires_at"),
        ({"expires_in": 0}, "expires_in"),
        ({"expires_in": -1}, "expires_in"),
        ({"expires_in": float("nan")}, "expires_in"),
        ({"expires_in": True}, "expires_in"),
        ({"expires_in": 10**9}, "expires_in"),
        ({"expires_at": In(-5)}, "expires_at"),
        ({"expires_at": datetime(2030, 1, 1)}, "expires_at"),  # no zone
        ({"expires_in": 60, "delay": 120}, "expires_in"),
        ({"expires_at": In(60), "run_at": In(120)}, "expires_at"),
        ({"expires_in": 60, "unique": Unique(key="u")}, "expires_in"),
        ({"expires_in": 60, "debounce": Debounce(key="d", seconds=5)}, "expires_in"),
    ],
)  # fmt: skip
async def test_bad_expiries_are_refused_and_make_nothing(
    queue: Queue, options: dict[str, Any], field: str
) -> None:
    # times made now, not when the cases were collected (a long run reaches them later)
    given: dict[str, Any] = {k: v.time() if isinstance(v, In) else v for k, v in options.items()}
    spec = JobSpec(type="notify", **given)
    with pytest.raises(InvalidRequest) as refused:
        await queue.submit_many([spec])
    assert refused.value.field == field
    for shard in range(queue.keys.shards):
        assert await queue.redis.xlen(queue.keys.log(shard)) == 0


async def test_a_batch_takes_each_jobs_expiry(queue: Queue) -> None:
    specs = [
        JobSpec(type="notify", payload=1, expires_in=30),
        JobSpec(type="notify", payload=2),
        JobSpec(type="notify", payload=3, expires_in=timedelta(seconds=30)),  # type: ignore[arg-type]
    ]
    made = await queue.submit_many(specs)
    ids = [m.job_id for m in made if not isinstance(m, Exception)]
    assert len(ids) == 3
    assert await expiry_of(queue, ids[0]) > 0 and await expiry_of(queue, ids[2]) > 0
    base = queue.keys.log(queue.keys.shard_of(ids[1])).rpartition("log")[0]
    assert await queue.redis.hget(f"{base}job:{ids[1]}", "ex") is None


async def submit_on_one_shard(queue: Queue, n: int, **options: Any) -> list[str]:
    """``n`` jobs of the shard of concurrency key 'one' (room for all: none is held)."""
    specs = [
        JobSpec(type="notify", payload=i, concurrency_key="one", concurrency_limit=1000, **options)
        for i in range(n)
    ]
    return [s.job_id for s in await queue.submit_many(specs) if not isinstance(s, Exception)]


async def claim(queue: Queue, shard: int, count: int, queues: Any = (("default", -1),)) -> Any:
    [reply] = await queue.scripts.call_many([claim_call(shard, "w-x", count, 60_000, queues)])
    return parse_claim(shard, reply)


async def test_a_claim_goes_past_any_run_of_expired_jobs_to_the_next(queue: Queue) -> None:
    """Expired jobs do not count in the bound on what a call pops (twice what it asks): one
    claim of one job meets 30 expired ones first and still answers the fresh one."""
    stale = await submit_on_one_shard(queue, 30, expires_in=0.2)
    [fresh] = await submit_on_one_shard(queue, 1)
    shard = queue.keys.shard_of(fresh)
    await past_expiry(queue, stale[-1], await expiry_of(queue, stale[-1]))
    batch = await claim(queue, shard, 1)
    assert [j.id for j in batch.jobs] == [fresh] and batch.ready_left == 0
    assert all(expired(s) for s in await asyncio.gather(*map(queue.status, stale)))


async def test_a_claim_stopped_by_its_bound_on_expired_jobs_says_look_again_now(
    queue: Queue,
) -> None:
    """A call cancels 500 expired jobs at most. One that stops there with ready jobs left
    answers its own `now` as when to look again (an HTTP worker's long poll would otherwise
    wait for a wake), and the next call takes the job behind them."""
    stale = await submit_on_one_shard(queue, 501, expires_in=0.2)
    [fresh] = await submit_on_one_shard(queue, 1)
    shard = queue.keys.shard_of(fresh)
    await past_expiry(queue, stale[-1], await expiry_of(queue, stale[-1]))
    first = await claim(queue, shard, 1)
    assert first.jobs == [] and first.ready_left == 2
    assert first.wake_at_ms == first.now_ms
    second = await claim(queue, shard, 1)
    assert [j.id for j in second.jobs] == [fresh] and second.wake_at_ms == -1
    for i in range(0, len(stale), 50):  # (a cluster client's pool: 50 reads at a time)
        assert all(expired(s) for s in await asyncio.gather(*map(queue.status, stale[i : i + 50])))


async def test_a_job_its_key_admits_behind_an_expired_one_is_claimed_by_the_same_call(
    queue: Queue,
) -> None:
    first = (await queue.submit("notify", 1, concurrency_key="k", expires=0.2)).job_id
    second = (await queue.submit("notify", 2, concurrency_key="k")).job_id  # held behind it
    await past_expiry(queue, first, await expiry_of(queue, first))
    batch = await claim(queue, queue.keys.shard_of(first), 2)
    assert [j.id for j in batch.jobs] == [second]
    assert expired(await queue.status(first))


async def test_an_expired_job_takes_none_of_a_limited_claims_permits(queue: Queue) -> None:
    """A claim with one permit for its queue (limit.lua's cap) that meets an expired job
    first still starts one job."""
    stale = await submit_on_one_shard(queue, 3, expires_in=0.2)
    [fresh] = await submit_on_one_shard(queue, 1)
    await past_expiry(queue, stale[-1], await expiry_of(queue, stale[-1]))
    batch = await claim(queue, queue.keys.shard_of(fresh), 5, [("default", 1)])
    assert [j.id for j in batch.jobs] == [fresh]


async def test_a_tiny_expires_in_is_not_refused_as_before_a_delay(queue: Queue) -> None:
    made = await queue.submit("notify", None, expires=1e-9)
    assert await expiry_of(queue, made.job_id) > 0  # a millisecond at least


async def test_explain_names_a_job_past_its_expiry_or_due_after_it(
    queue: Queue, background: Background
) -> None:
    from jobtier.core.explanation import ReasonCode

    stale = (await queue.submit("notify", None, queue="unserved", expires=0.2)).job_id
    fresh = (await queue.submit("notify", None, queue="unserved", expires=3600)).job_id
    await past_expiry(queue, stale, await expiry_of(queue, stale))
    e = await queue.explain(stale)
    [reason] = [r for r in e.reasons if r.code is ReasonCode.EXPIRED]
    assert e.reasons[0] is reason and reason.seconds is not None and reason.seconds < 0
    assert "first claim to reach it cancels it" in reason.message
    assert ReasonCode.EXPIRED not in {r.code for r in (await queue.explain(fresh)).reasons}
    # a retry due after the expiry: an older jobtier's fail.lua scheduled one so (this one's
    # cancels the job instead); made here by moving a scheduled retry's expiry closer
    retried = (await queue.submit("flaky_notify", None, expires=7200)).job_id
    background.start(worker_for(queue, REGISTRY))

    async def backing_off() -> bool:
        s = await queue.status(retried)
        return s.state is State.SCHEDULED and s.attempt == 1

    await wait_for(backing_off, timeout=20)
    base = queue.keys.log(queue.keys.shard_of(retried)).rpartition("log")[0]
    await queue.redis.hset(f"{base}job:{retried}", "ex", await redis_ms(queue) + 60_000)
    e = await queue.explain(retried)
    codes = [r.code for r in e.reasons]
    assert codes[0] is ReasonCode.EXPIRED and ReasonCode.SCHEDULED in codes
    assert "cancelled (Expired) then, not run" in e.reasons[0].message
    assert e.reasons[0].seconds is not None and 0 < e.reasons[0].seconds <= 60
