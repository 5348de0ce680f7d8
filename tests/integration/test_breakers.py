"""Circuit breakers (docs/breakers.md): opened by the downstream's failures, shared through
Redis by every worker, holding jobs back without using their attempts, probing half-open."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from jobtier.config import Settings
from jobtier.core.breaker import Breaker, DownstreamDown
from jobtier.core.explanation import ReasonCode
from jobtier.core.model import State
from jobtier.engine.queue import Queue
from jobtier.scheduler import Scheduler
from jobtier.store.breaker_state import PROBE, RUN, WAIT, BreakerStates
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import TaskRegistry, task
from tests.fixtures.engine import Background, wait_for, worker_for

pytestmark = pytest.mark.contract  # on the single Redis and on the Redis Cluster


class Downstream:
    """A downstream the test turns off and on; counts the calls it gets."""

    def __init__(self) -> None:
        self.up = True
        self.calls = 0
        self.calls_while_down = 0
        self.refused: dict[str, int] = {}  # job id -> calls refused

    def call(self, job_id: str) -> None:
        self.calls += 1
        if not self.up:
            self.calls_while_down += 1
            self.refused[job_id] = self.refused.get(job_id, 0) + 1
            raise DownstreamDown("connection refused")


ds = Downstream()
PAYMENTS = Breaker("bt-payments", failures=3, window=30, open_for=0.5, max_open=5, probes=1)


class HttpError(Exception):
    """A failure the task declares as the downstream's (breaker_on)."""


@task(breaker=PAYMENTS, retries=5, backoff_base=0.05, backoff_cap=0.1)
async def charge(ctx: JobContext, payload: Any) -> str:
    ds.call(ctx.job_id)
    return "charged"


@task(breaker=Breaker("bt-http", failures=2, open_for=30), breaker_on=(HttpError,), retries=0)
async def fetch(ctx: JobContext, payload: Any) -> str:
    if payload == "bad-input":
        raise ValueError("not the downstream's fault")
    raise HttpError("502 from the partner")


async def _reset(queue: Queue, *names: str) -> BreakerStates:
    states = BreakerStates(queue.store)
    for name in names:
        await states.close(name, "test start")
    return states


async def test_downstream_failures_open_the_breaker_and_it_holds_jobs_without_attempts(
    queue: Queue, background: Background
) -> None:
    global ds
    ds = Downstream()
    states = await _reset(queue, PAYMENTS.name)
    ds.up = False
    first = [await queue.submit(charge, i) for i in range(3)]
    background.start(worker_for(queue, TaskRegistry([charge]), name="b1", concurrency=1))
    background.start(Scheduler(queue.store))

    async def opened() -> bool:
        return (await states.get(PAYMENTS.name)).state == "open"

    await wait_for(opened)
    calls_at_open = ds.calls_while_down
    # jobs submitted while it is open are held back: the task is not called, no attempt used
    later = [await queue.submit(charge, 10 + i) for i in range(5)]

    async def held() -> bool:  # each held back (BreakerOpen), or handed back and parked
        docs = [await queue.status(s.job_id) for s in later]
        back = sum(d.error is not None and d.error.type == "BreakerOpen" for d in docs)
        parked: int = (await queue.admin.stats())["queues"]["default"]["parked"]
        return back + parked >= len(later)

    await wait_for(held)
    for s in later:  # an attempt only for a call it made (as a probe)
        assert (await queue.status(s.job_id)).attempt == ds.refused.get(s.job_id, 0)

    async def explained() -> bool:  # the explain answer names the breaker that holds it back
        for s in later:  # (any: one may be out as a probe just now)
            e = await queue.explain(s.job_id)
            if any(r.code == ReasonCode.BREAKER_OPEN for r in e.reasons):
                (reason,) = [r for r in e.reasons if r.code == ReasonCode.BREAKER_OPEN]
                return reason.breaker == PAYMENTS.name and "holds it back" in reason.message
        return False

    await wait_for(explained)
    # one probe per open period at most while it stays down: far fewer calls than jobs
    assert ds.calls_while_down - calls_at_open <= 2
    ds.up = True

    async def all_done() -> bool:
        docs = [await queue.status(s.job_id) for s in [*first, *later]]
        return all(d.state == State.SUCCEEDED for d in docs)

    await wait_for(all_done, timeout=30)
    assert (await states.get(PAYMENTS.name)).state == "closed"
    for s in later:  # held back as often as it was: an attempt only for each call it made
        assert (await queue.status(s.job_id)).attempt == 1 + ds.refused.get(s.job_id, 0)


MAILS = Breaker("bt-mail", open_for=0.3, max_open=1)
mailed: list[str] = []


@task(breaker=MAILS)
async def mail(ctx: JobContext, payload: Any) -> None:
    mailed.append(ctx.job_id)


async def test_jobs_of_a_held_type_are_parked_not_claimed_again_and_again(
    queue: Queue, background: Background
) -> None:
    mailed.clear()
    states = await _reset(queue, MAILS.name)
    await states.open(MAILS.name, None, "by hand")
    jobs = [await queue.submit(mail, i) for i in range(40)]
    worker = worker_for(queue, TaskRegistry([mail]), name="b3", concurrency=4)
    background.start(worker)
    background.start(Scheduler(queue.store))  # (the held ones come back through it)

    async def parked() -> bool:
        count: int = (await queue.admin.stats())["queues"]["default"]["parked"]
        return count >= 30

    await wait_for(parked)
    # a claim's worth was held back (asked, refused: no call, no attempt); the rest were
    # handed back untouched, and the worker does not claim them while the breaker is open
    holds = worker.launcher.breakers.holds[MAILS.name]
    assert 1 <= holds <= 4 and mailed == []
    assert worker.state.types == ["-"]
    # the explain answer of a parked job names the breaker by the job's type
    reasons = (await queue.explain(jobs[-1].job_id)).reasons
    (held,) = [r for r in reasons if r.code == ReasonCode.BREAKER_OPEN]
    assert held.breaker == MAILS.name and "until it is closed by hand" in held.message
    await states.close(MAILS.name, "by hand")

    async def all_done() -> bool:
        docs = [await queue.status(j.job_id) for j in jobs]
        return all(d.state == State.SUCCEEDED for d in docs)

    await wait_for(all_done)  # the worker claims its type again when its hold ends
    assert sorted(mailed) == sorted(j.job_id for j in jobs)
    assert all([(await queue.status(j.job_id)).attempt == 1 for j in jobs])


async def test_a_failed_probe_opens_it_again_for_longer(queue: Queue) -> None:
    states = await _reset(queue, "bt-probe")
    b = Breaker("bt-probe", failures=1, open_for=0.2, backoff=4, max_open=60)
    assert (await states.admit(b, "w", 5000)).verdict == RUN
    state, changed = await states.record(b, "f", "", "timeout")
    assert (state, changed) == ("open", True)
    first = await states.get("bt-probe")
    assert first.trips == 1 and first.open_until is not None
    shut = await states.admit(b, "w", 5000)
    assert shut.verdict == WAIT and 0 < shut.wait_ms <= 200

    async def half_open() -> bool:
        return (await states.get("bt-probe")).state == "half_open"

    await wait_for(half_open)
    probe = await states.admit(b, "w", 5000)
    assert probe.verdict == PROBE and probe.probe
    # one probe out: the next job waits for its answer
    assert (await states.admit(b, "w2", 5000)).verdict == WAIT
    assert (await states.record(b, "f", probe.probe, "still down"))[0] == "open"
    second = await states.get("bt-probe")
    assert second.trips == 2 and second.open_until is not None
    # the second open lasts backoff (4) times the first: 800 ms against 200
    assert (await states.admit(b, "w", 5000)).wait_ms > 400


async def test_a_probe_success_closes_it_and_a_given_back_probe_frees_its_place(
    queue: Queue,
) -> None:
    states = await _reset(queue, "bt-close")
    b = Breaker("bt-close", failures=1, open_for=0.1, probes=1)
    await states.record(b, "f", "", "down")
    await states.open("bt-close", 0.05, "shorter")  # a manual open for a period ends as any

    probes: list[str] = []

    async def probing() -> bool:
        admission = await states.admit(b, "w", 5000)
        probes.append(admission.probe)
        return admission.verdict == PROBE

    await wait_for(probing)
    # that probe is out; a worker gives it back (its job failed for another reason)
    assert (await states.admit(b, "w", 5000)).verdict == WAIT
    assert (await states.get("bt-close")).state == "half_open"
    await states.record(b, "n", probes[-1], "")
    probe = await states.admit(b, "w", 5000)
    assert probe.verdict == PROBE
    assert await states.record(b, "s", probe.probe, "") == ("closed", True)
    assert (await states.admit(b, "w", 5000)).verdict == RUN


async def test_manual_open_holds_until_closed_by_hand(queue: Queue) -> None:
    states = await _reset(queue, "bt-manual")
    b = Breaker("bt-manual", open_for=0.05)
    view = await states.open("bt-manual", None, "maintenance window")
    assert view.state == "open" and view.manual and view.reason == "maintenance window"
    assert (await states.admit(b, "w", 5000)).verdict == WAIT
    names = [v.name for v in await states.all()]
    assert "bt-manual" in names
    assert (await states.close("bt-manual", "done")).state == "closed"
    assert (await states.admit(b, "w", 5000)).verdict == RUN


async def test_a_failure_ratio_opens_it_only_with_enough_calls(queue: Queue) -> None:
    states = await _reset(queue, "bt-ratio")
    b = Breaker("bt-ratio", ratio=0.5, min_calls=4, window=60)
    for outcome in ("s", "f", "f"):  # 2 of 3 failed, but 3 calls are under min_calls
        assert (await states.record(b, outcome, "", "x"))[0] == "closed"
    assert (await states.record(b, "f", "", "x"))[0] == "open"  # 3 of 4
    states2 = await _reset(queue, "bt-ratio")
    for outcome in ("s", "s", "s", "f"):  # 1 of 4: under the ratio
        assert (await states2.record(b, outcome, "", "x"))[0] == "closed"


async def test_only_the_downstreams_failures_count(queue: Queue, background: Background) -> None:
    states = await _reset(queue, "bt-http")
    bad = [await queue.submit(fetch, "bad-input") for _ in range(3)]
    background.start(worker_for(queue, TaskRegistry([fetch]), name="b2", concurrency=1))

    async def failed(ids: list[str]) -> bool:
        return all([(await queue.status(i)).state == State.FAILED for i in ids])

    await wait_for(lambda: failed([s.job_id for s in bad]))
    assert (await states.get("bt-http")).state == "closed"  # ValueError is not the downstream's
    down = [await queue.submit(fetch, "call") for _ in range(2)]
    await wait_for(lambda: failed([s.job_id for s in down]))

    async def opened() -> bool:
        return (await states.get("bt-http")).state == "open"

    await wait_for(opened)  # two HttpErrors (breaker_on), the threshold
    view = await states.get("bt-http")
    assert "502" in view.reason


async def test_the_successes_of_a_window_stay_bounded_without_failures(queue: Queue) -> None:
    """Steady successes and no failure: the set of successes holds only the window's, and a
    breaker without a ratio keeps none at all."""
    states = await _reset(queue, "bt-bounded", "bt-count")
    keys = queue.store.keys
    ratio = Breaker("bt-bounded", ratio=0.5, min_calls=4, window=0.2)
    oks = f"{keys.base(keys.home(ratio.name))}bok:{ratio.name}"
    burst = 30
    for _ in range(burst):
        await states.record(ratio, "s", "", "")
    assert await queue.store.redis.zcard(oks) == burst

    async def trimmed() -> bool:  # successes keep coming; those older than the window go
        await states.record(ratio, "s", "", "")
        return int(await queue.store.redis.zcard(oks)) < burst

    await wait_for(trimmed)
    counting = Breaker("bt-count", failures=3, window=60)
    for _ in range(5):
        await states.record(counting, "s", "", "")
    assert not await queue.store.redis.exists(f"{keys.base(keys.home(counting.name))}bok:bt-count")


LONG = Breaker("bt-long", failures=1, open_for=0.05, probes=1)
probe_may_end = asyncio.Event()


@task(breaker=LONG, retries=3, backoff_base=0.05, backoff_cap=0.1)
async def long_call(ctx: JobContext, payload: Any) -> str:
    await probe_may_end.wait()
    return "answered"


async def test_a_probe_longer_than_the_lease_keeps_its_place(
    settings: Settings, background: Background
) -> None:
    global probe_may_end
    probe_may_end = asyncio.Event()
    queue = await Queue.connect(settings.replace(lease_seconds=1.0), catalog=False)
    try:
        states = await _reset(queue, LONG.name)
        await states.record(LONG, "f", "", "down")
        probes = f"{queue.keys.base(queue.keys.home(LONG.name))}bprobe:{LONG.name}"
        background.start(Scheduler(queue.store))
        background.start(worker_for(queue, TaskRegistry([long_call])))
        job = await queue.submit(long_call, None)

        async def probing() -> bool:  # the job runs as the breaker's one probe
            return int(await queue.redis.zcard(probes)) == 1

        await wait_for(probing)
        scores = await queue.redis.zrange(probes, 0, 0, withscores=True)
        first_deadline = int(scores[0][1])

        async def past_the_first_lease() -> bool:
            seconds, micros = await queue.redis.time()
            return int(seconds) * 1000 + int(micros) // 1000 > first_deadline + 100

        await wait_for(past_the_first_lease)
        # the probe still runs: its place is kept, no second probe gets through
        assert (await states.admit(LONG, "w2", 5000)).verdict == WAIT
        probe_may_end.set()

        async def done() -> bool:
            return (await queue.status(job.job_id)).state is State.SUCCEEDED

        await wait_for(done)
        assert (await states.get(LONG.name)).state == "closed"
    finally:
        await background.stop()
        await queue.close()
