"""Why a job has not started (engine/explain.py, store/lua/explain.lua): each reason set up in
real Redis, its numbers checked, and then the cause removed and the job claimed by the claim
script (or a real worker): the explanation agrees with the scheduler."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from jobtier.config import Settings
from jobtier.core.errors import JobNotFound
from jobtier.core.explanation import Explanation, Reason, ReasonCode
from jobtier.core.model import QueueLimits, State
from jobtier.engine import explain as explain_module
from jobtier.engine.explain import OtherTenants
from jobtier.engine.queue import Queue
from jobtier.flows.resolver import Resolver
from jobtier.scheduler import Scheduler
from jobtier.store.calls import complete_call, fail_call
from jobtier.store.redis import RedisClient
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import TaskRegistry, task
from tests.fixtures.engine import Background, wait_for, worker_for
from tests.fixtures.redis import command_calls, on_every_server

pytestmark = pytest.mark.contract  # on the single Redis and on the Redis Cluster

LEASE_MS = 30_000
gates: dict[str, asyncio.Event] = {}  # one per test: an Event belongs to one event loop


@task(queue="mail")
async def send(ctx: JobContext, payload: Any) -> str:
    await gates["send"].wait()
    return "sent"


@pytest.fixture
async def one(settings: Settings) -> AsyncIterator[Queue]:
    """A deployment of one shard: every job in the same lines, so positions are exact."""
    q = await Queue.connect(settings.replace(shards=1), catalog=False)
    gates["send"] = asyncio.Event()
    yield q
    gates["send"].set()
    await q.close()


async def advertise(
    q: Queue,
    worker: str,
    queues: list[str],
    tasks: list[str],
    concurrency: int = 4,
    running: int = 0,
) -> None:
    """A live worker's heartbeat entry, as worker/heartbeat.py writes it."""
    info = {"id": worker, "pid": 1, "host": "h", "concurrency": concurrency, "running": running}
    info |= {"tasks": tasks, "queues": queues, "seen_at": time.time()}
    await q.redis.hset(q.keys.workers(), worker, msgspec.json.encode(info))


async def finish(q: Queue, job_id: str) -> None:
    """Complete a job claimed by ``claim`` (its lease version is its version since then)."""
    lease = (await q.status(job_id)).version
    assert await q.scripts.call(*complete_call(0, "w", 60, [(job_id, lease, b"")])) == [0]


def reason(e: Explanation, code: ReasonCode) -> Reason:
    found = [r for r in e.reasons if r.code is code]
    assert found, (code, e)
    return found[0]


def codes(e: Explanation) -> set[ReasonCode]:
    return {r.code for r in e.reasons}


async def claim(
    q: Queue, n: int = 1, queue: str = "mail", types: tuple[str, ...] = ()
) -> list[str]:
    batch = await q.scripts.claim(0, "w", n, LEASE_MS, [(queue, -1)], list(types))
    return [j.id for j in batch.jobs]


async def test_a_paused_queue_then_resumed(one: Queue) -> None:
    await advertise(one, "w1", ["mail"], ["send"])
    job = (await one.submit("send", None, queue="mail")).job_id
    await one.admin.pause("mail")
    e = await one.explain(job)
    assert e.waiting and e.state == "queued" and e.position == 1
    assert reason(e, ReasonCode.QUEUE_PAUSED).queue == "mail"
    assert await claim(one) == []  # the claimer agrees: nothing
    await one.admin.resume("mail")
    e = await one.explain(job)
    assert codes(e) == {ReasonCode.IN_LINE} and e.position == 1
    assert await claim(one) == [job]
    e = await one.explain(job)
    assert not e.waiting and e.state == "running" and e.position is None
    assert codes(e) == {ReasonCode.NOT_WAITING}


async def test_unknown_and_another_tenants_jobs_are_not_found(one: Queue) -> None:
    job = (await one.submit("send", None, queue="mail", tenant="acme")).job_id
    assert (await one.explain(job, "acme")).id == job
    for job_id, tenant in ((job, "globex"), (one.keys.new_id(), None), ("nope", None)):
        with pytest.raises(JobNotFound):
            await one.explain(job_id, tenant)
    # another tenant's job, or an unknown id asked by a tenant: one HGET, the script never runs
    calls, reads = (
        await command_calls(one.redis, "fcall_ro"),
        await command_calls(one.redis, "hget"),
    )
    for job_id in (job, one.keys.new_id()):
        with pytest.raises(JobNotFound) as caught:
            await one.explain(job_id, "globex")
        assert isinstance(caught.value, OtherTenants) is (job_id == job)
    assert await command_calls(one.redis, "fcall_ro") == calls
    assert await command_calls(one.redis, "hget") == reads + 2


async def test_a_line_longer_than_the_scripts_bound_answers_at_least(
    one: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LPOS reads LINE_BOUND entries from each end of a line: a job at either end gets its
    exact place, one in the middle of a longer line a lower bound and no position."""
    monkeypatch.setattr(explain_module, "LINE_BOUND", 3)
    await advertise(one, "w1", ["mail"], ["send"])
    ids = [(await one.submit("send", i, queue="mail")).job_id for i in range(10)]
    # the oldest three and the newest three are within reach
    for n in (0, 2, 7, 9):
        e = await one.explain(ids[n])
        r = reason(e, ReasonCode.IN_LINE)
        assert (e.position, r.ahead, r.at_least) == (n + 1, n, None), (n, e)
    for n in (3, 6):  # neither end's LPOS finds them: at least 3 ahead, no position
        e = await one.explain(ids[n])
        r = reason(e, ReasonCode.IN_LINE)
        assert (e.position, r.ahead, r.at_least) == (None, 3, True), (n, e)
        assert "at least 3 ahead" in r.message
    # a line within twice the bound is read whole: a job it lacks is in no line
    monkeypatch.setattr(explain_module, "LINE_BOUND", 5)
    assert (await one.explain(ids[4])).position == 5
    # the scheduler agrees with the lower bound: three claims take the three oldest
    monkeypatch.setattr(explain_module, "LINE_BOUND", 3)
    assert await claim(one, 3) == ids[:3]
    assert (await one.explain(ids[3])).position == 1


async def test_a_long_key_line_and_the_holder_scan_are_bounded(
    one: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    await advertise(one, "w1", ["mail"], ["send"])
    keyed = [
        (await one.submit("send", i, queue="mail", concurrency_key="acct")).job_id for i in range(9)
    ]
    assert await claim(one) == keyed[:1]  # it holds the key; the others wait behind it
    plain = [(await one.submit("send", i, queue="mail")).job_id for i in range(6)]
    assert await claim(one, 6) == plain  # running: the holder scan reads them too

    async def hmgets(holder_reads: int, line_bound: int) -> tuple[Reason, int]:
        monkeypatch.setattr(explain_module, "HOLDER_READS", holder_reads)
        monkeypatch.setattr(explain_module, "LINE_BOUND", line_bound)
        before = await command_calls(one.redis, "hmget")
        e = await one.explain(keyed[5])
        return reason(e, ReasonCode.CONCURRENCY_KEY_HELD), await command_calls(
            one.redis, "hmget"
        ) - before

    whole, unbounded = await hmgets(1000, 1000)
    assert (whole.ahead, whole.at_least) == (4, None)
    assert whole.holders is not None and [h.id for h in whole.holders] == keyed[:1]
    bounded_holders, bounded = await hmgets(3, 1000)
    # the holder first in the active set is still found; four fewer jobs are read for it
    assert bounded_holders.holders is not None
    assert [h.id for h in bounded_holders.holders] == keyed[:1]
    assert unbounded - bounded == (1 + len(plain)) - 3
    deep, _ = await hmgets(3, 2)
    assert (deep.ahead, deep.at_least) == (2, True) and "at least 2 jobs" in deep.message


async def test_the_queues_concurrency_limit_is_full_until_a_running_job_ends(
    one: Queue, background: Background
) -> None:
    await one.admin.set_limits("mail", QueueLimits(concurrency=2))
    first = [(await one.submit(send, i)).job_id for i in range(2)]
    last = (await one.submit(send, 2)).job_id
    background.start(worker_for(one, TaskRegistry([send]), concurrency=5, name="real"))

    async def running(ids: list[str]) -> bool:
        return all([(await one.status(i)).state is State.RUNNING for i in ids])

    await wait_for(lambda: running(first))
    e = await one.explain(last)
    full = reason(e, ReasonCode.QUEUE_CONCURRENCY_FULL)
    assert (full.queue, full.running, full.limit) == ("mail", 2, 2)
    assert "2 of 2 running" in full.message
    assert (await one.status(last)).state is State.QUEUED
    gates["send"].set()  # the running ones end, their permits come back: the worker claims it
    await wait_for(lambda: _state_is(one, last, State.SUCCEEDED))


async def _state_is(q: Queue, job_id: str, state: State) -> bool:
    return (await q.status(job_id)).state is state


async def test_the_queues_rate_limit_names_when_the_next_start_may_come(one: Queue) -> None:
    await advertise(one, "w1", ["mail"], ["send"])
    await one.admin.set_limits("mail", QueueLimits(rate=2, per=60))
    home = one.keys.home("mail")
    granted = await one.scripts.call("limit", home, ("acquire", "mail", "w", 2, LEASE_MS))
    assert int(granted[0]) == 2  # the rate's two starts are taken
    job = (await one.submit("send", None, queue="mail")).job_id
    e = await one.explain(job)
    r = reason(e, ReasonCode.RATE_LIMITED)
    assert (r.rate, r.per, r.started) == (2, 60.0, 2)
    assert r.seconds is not None and 0 < r.seconds <= 60 + LEASE_MS / 1000
    assert r.until is not None and r.until.endswith("Z")
    # the claimer agrees: no permit, so nothing
    assert (
        int((await one.scripts.call("limit", home, ("acquire", "mail", "w", 1, LEASE_MS)))[0]) == 0
    )
    await one.admin.set_limits("mail", QueueLimits())  # lifted
    e = await one.explain(job)
    assert ReasonCode.RATE_LIMITED not in codes(e)
    assert await claim(one) == [job]


async def test_a_queue_blocked_by_a_task_is_rate_limited_until_the_block_ends(one: Queue) -> None:
    await advertise(one, "w1", ["mail"], ["send"])
    job = (await one.submit("send", None, queue="mail")).job_id
    await one.admin.block("mail", 0.5)
    r = reason(await one.explain(job), ReasonCode.RATE_LIMITED)
    assert r.seconds is not None and 0 < r.seconds <= 0.5 and "RateLimited" in r.message
    assert await claim(one) == []

    async def unblocked() -> bool:
        return ReasonCode.RATE_LIMITED not in codes(await one.explain(job))

    await wait_for(unblocked)
    assert await claim(one) == [job]


async def test_a_held_concurrency_key_names_its_holder(one: Queue) -> None:
    await advertise(one, "w1", ["mail"], ["send"])
    a, b, c = [
        (await one.submit("send", i, queue="mail", concurrency_key="acct")).job_id for i in range(3)
    ]
    assert await claim(one) == [a]
    e = await one.explain(c)
    held = reason(e, ReasonCode.CONCURRENCY_KEY_HELD)
    assert (held.key, held.running, held.limit, held.ahead) == ("acct", 1, 1, 1)
    assert held.holders is not None and [(h.id, h.state) for h in held.holders] == [(a, "running")]
    assert e.position is None
    assert await claim(one) == []  # the claimer agrees
    await finish(one, a)
    # b was admitted under the key (ready): it now holds it, c still waits
    held = reason(await one.explain(c), ReasonCode.CONCURRENCY_KEY_HELD)
    assert held.holders is not None and [(h.id, h.state) for h in held.holders] == [(b, "queued")]
    assert held.ahead == 0
    assert reason(await one.explain(b), ReasonCode.IN_LINE).ahead == 0
    assert await claim(one) == [b]
    await finish(one, b)
    assert codes(await one.explain(c)) == {ReasonCode.IN_LINE}
    assert await claim(one) == [c]


async def test_dependencies_are_named_with_their_states(one: Queue) -> None:
    await advertise(one, "w1", ["mail"], ["send"])
    first = (await one.submit("send", 1, queue="mail")).job_id
    second = (await one.submit("send", 2, queue="mail", delay=60)).job_id
    job = (await one.submit("send", 3, queue="mail", depends_on=[first, second])).job_id
    e = await one.explain(job)
    assert e.state == "waiting" and e.position is None
    r = reason(e, ReasonCode.WAITING_FOR_DEPENDENCIES)
    assert (r.pending, r.total, r.failed) == (2, 2, 0)
    assert r.dependencies is not None
    assert [(d.id, d.state) for d in r.dependencies] == [(first, "queued"), (second, "scheduled")]
    assert await claim(one) == [first]
    await finish(one, first)
    await one.cancel(second)  # a dependency that did not succeed: the job is cancelled...
    resolver = Resolver(one.store, name="test-resolver")
    await resolver.drain()
    e = await one.explain(job)
    assert not e.waiting and e.state == "cancelled"


async def test_a_job_runs_once_its_dependency_succeeded(one: Queue) -> None:
    await advertise(one, "w1", ["mail"], ["send"])
    first = (await one.submit("send", 1, queue="mail")).job_id
    job = (await one.submit("send", 2, queue="mail", depends_on=[first])).job_id
    assert ReasonCode.WAITING_FOR_DEPENDENCIES in codes(await one.explain(job))
    assert await claim(one) == [first]
    await finish(one, first)
    await Resolver(one.store, name="test-resolver").drain()
    e = await one.explain(job)
    assert codes(e) == {ReasonCode.IN_LINE} and e.position == 1
    assert await claim(one) == [job]


async def test_a_scheduled_job_says_when_then_is_claimed(
    one: Queue, background: Background
) -> None:
    await advertise(one, "w1", ["mail"], ["send"])
    later = (await one.submit("send", None, queue="mail", delay=3600)).job_id
    r = reason(await one.explain(later), ReasonCode.SCHEDULED)
    assert r.seconds is not None and 3590 < r.seconds <= 3600 and r.until is not None
    # a failed attempt's retry, waiting for its backoff
    retried = (await one.submit("send", None, queue="mail")).job_id
    assert await claim(one) == [retried]
    lease = (await one.status(retried)).version
    error = '{"type": "OSError", "message": "down"}'
    failed = await one.scripts.call(*fail_call(0, "w", 60, [(retried, lease, error, 600_000)]))
    assert failed == [0, b"scheduled"]
    r = reason(await one.explain(retried), ReasonCode.SCHEDULED)
    assert r.seconds is not None and 590 < r.seconds <= 600
    assert r.message.startswith("its attempt 2 is scheduled for")
    soon = (await one.submit("send", None, queue="mail", delay=0.3)).job_id
    assert ReasonCode.SCHEDULED in codes(await one.explain(soon))
    background.start(Scheduler(one.store))

    async def promoted() -> bool:
        return (await one.explain(soon)).state == "queued"

    await wait_for(promoted)
    assert codes(await one.explain(soon)) == {ReasonCode.IN_LINE}
    assert await claim(one) == [soon]


async def test_no_live_worker_for_the_queue_or_for_the_type(one: Queue) -> None:
    job = (await one.submit("send", None, queue="mail")).job_id
    r = reason(await one.explain(job), ReasonCode.NO_WORKER_FOR_QUEUE)
    assert (r.queue, r.workers) == ("mail", 0)
    await advertise(one, "elsewhere", ["default"], ["send"])
    assert (
        "1 live worker serves other queues"
        in reason(await one.explain(job), ReasonCode.NO_WORKER_FOR_QUEUE).message
    )
    await advertise(one, "other-pool", ["mail"], ["resize"])
    e = await one.explain(job)
    r = reason(e, ReasonCode.NO_WORKER_FOR_TYPE)
    assert (r.queue, r.type) == ("mail", "send") and ReasonCode.NO_WORKER_FOR_QUEUE not in codes(e)
    # the claimer agrees: that pool hands it back (parked), and it stays explained so
    assert await claim(one, types=("resize",)) == []
    e = await one.explain(job)
    assert ReasonCode.NO_WORKER_FOR_TYPE in codes(e) and e.position == 1
    await advertise(one, "right-pool", ["mail"], ["send"], concurrency=3)
    e = await one.explain(job)
    assert codes(e) == {ReasonCode.IN_LINE}
    assert "handed-back" in reason(e, ReasonCode.IN_LINE).message
    assert await claim(one, types=("send",)) == [job]


async def test_a_worker_that_stopped_beating_is_not_live(one: Queue) -> None:
    job = (await one.submit("send", None, queue="mail")).job_id
    info = {"id": "old", "concurrency": 1, "running": 0, "tasks": ["send"], "queues": ["mail"]}
    info["seen_at"] = time.time() - 3600
    await one.redis.hset(one.keys.workers(), "old", msgspec.json.encode(info))
    assert ReasonCode.NO_WORKER_FOR_QUEUE in codes(await one.explain(job))


async def test_other_tenants_jobs_ahead_by_the_tenants_turns(one: Queue) -> None:
    await advertise(one, "w1", ["mail"], ["send"])
    a = [(await one.submit("send", i, queue="mail", tenant="a")).job_id for i in range(3)]
    b = (await one.submit("send", 0, queue="mail", tenant="b")).job_id
    c = (await one.submit("send", 0, queue="mail", tenant="c")).job_id
    e = await one.explain(c)
    turn = reason(e, ReasonCode.TENANT_TURN)
    assert (turn.ahead, turn.tenants) == (2, 3) and e.position == 3  # a's first, b's, then c's
    e = await one.explain(a[2])
    assert reason(e, ReasonCode.TENANT_TURN).ahead == 2 and e.position == 5  # a a, b c between
    assert e.reasons[-1].ahead == 4
    # the claimer agrees: a claim of two takes a turn each of a and b
    assert await claim(one, 2) == [a[0], b]
    e = await one.explain(c)
    assert codes(e) == {ReasonCode.IN_LINE} and e.position == 1
    assert await claim(one) == [c]


async def test_tenants_take_turns_when_claims_take_one_job(one: Queue) -> None:
    """A claim of one job (a worker with one free slot) serves the tenant at the head of the
    ring and sends it to the back: one tenant's backlog does not hold another's job."""
    a = [(await one.submit("send", i, queue="mail", tenant="a")).job_id for i in range(3)]
    b = (await one.submit("send", 0, queue="mail", tenant="b")).job_id
    assert (await one.explain(b)).position == 2
    order = [*(await claim(one)), *(await claim(one)), *(await claim(one)), *(await claim(one))]
    assert order == [a[0], b, a[1], a[2]]


async def test_nth_in_line_with_the_workers_busy(one: Queue, background: Background) -> None:
    ids = [(await one.submit(send, i)).job_id for i in range(5)]
    background.start(worker_for(one, TaskRegistry([send]), concurrency=2, name="busy"))

    async def busy() -> bool:
        # the worker says how many it runs at its heartbeat (a third of the lease)
        r = reason(await one.explain(ids[4]), ReasonCode.IN_LINE)
        return r.busy == 1

    await wait_for(busy, timeout=30)
    e = await one.explain(ids[4])
    r = reason(e, ReasonCode.IN_LINE)
    assert e.position == 3 and (r.ahead, r.workers, r.slots, r.in_use) == (2, 1, 2, 2)
    assert "3rd in line" in r.message and "its worker is busy: 2 of 2 slots in use" in r.message
    assert codes(e) == {ReasonCode.IN_LINE}
    gates["send"].set()
    await wait_for(lambda: _state_is(one, ids[4], State.SUCCEEDED))


async def test_positions_follow_the_priorities_and_tenants_turns_claim_by_claim(
    one: Queue,
) -> None:
    """Every ready job's position, from a mix of priorities and tenants, is the claim that
    takes it when jobs are claimed one at a time."""
    rng = random.Random(7)
    prios = ["critical", "high", "normal", "low"]
    ids = []
    for _ in range(80):
        prio, tenant = rng.choice(prios), rng.choice("abc")
        sub = await one.submit("send", None, queue="mail", priority=prio, tenant=tenant)
        ids.append(sub.job_id)
    assert await claim(one, 3)  # the rotation's cursor is somewhere other than its start
    ready = [i for i in ids if (await one.status(i)).state is State.QUEUED]
    positions: dict[str, int] = {}
    for i in ready:
        position = (await one.explain(i)).position
        assert position is not None
        positions[i] = position
    order = []
    while taken := await claim(one):
        order += taken
    assert order == sorted(ready, key=lambda i: positions[i])
    assert sorted(positions.values()) == list(range(1, len(ready) + 1))


async def test_explain_writes_nothing(one: Queue, redis: RedisClient) -> None:
    """A read-only function: Redis runs it by FCALL_RO, and the data set is unchanged."""
    await advertise(one, "w1", ["mail"], ["send"])
    job = (await one.submit("send", None, queue="mail", concurrency_key="k")).job_id
    held = (await one.submit("send", None, queue="mail", concurrency_key="k")).job_id
    await one.admin.set_limits("mail", QueueLimits(concurrency=1, rate=5))

    async def dump() -> dict[Any, Any]:
        found = [k for keys in await on_every_server(redis, "KEYS", "jt:*") for k in keys]
        return {k: await one.redis.dump(k) for k in sorted(found)}

    before, calls = await dump(), await command_calls(one.redis, "fcall_ro")
    # the jobs, their shard's lines and counts, the queue's home shard: all of them compared
    assert {one.keys.job(job).encode(), one.keys.limit("mail").encode()} <= set(before)
    for job_id in (job, held):
        await one.explain(job_id)
    assert await dump() == before
    # per job: its shard read, and its limited queue's home shard read
    assert await command_calls(one.redis, "fcall_ro") == calls + 4
