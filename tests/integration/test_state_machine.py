"""Random operation sequences against a model of the state machine; Redis must agree.

Hypothesis drives submits, claims, completions (fresh and stale), failures, heartbeats with
progress, cancels, releases, lease expiries, promotions and replays. After every step each
job's status document, its place in the shard's structures and the waiting counts must be
what the model says. It runs on the single Redis and on the Redis Cluster (``contract``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck
from hypothesis import settings as run_settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from jobtier.config import Settings
from jobtier.core.errors import Code
from jobtier.core.keys import Keys
from jobtier.core.model import PRIORITIES, State, decode_status
from jobtier.engine.queue import Queue
from jobtier.status.docs import read_docs
from jobtier.store import format as job_format
from jobtier.store.calls import (
    complete_call,
    fail_call,
    heartbeat_call,
    parse_pairs,
    promote_call,
    reclaim_call,
    stopped_call,
)
from tests.fixtures.redis import admin, on_every_server

pytestmark = pytest.mark.contract

WAITING = {State.QUEUED, State.SCHEDULED}


@dataclass
class ModelJob:
    id: str
    state: State
    version: int = 1
    attempt: int = 0
    max_attempts: int = 1
    cancel: bool = False
    lease_version: int = 0
    worker: str = ""
    progress: str = ""


async def _flushall(settings: Settings) -> None:
    """Empty the backend (FLUSHALL is not for jobtier's own user: the test's client)."""
    async with admin(settings) as redis:
        await on_every_server(redis, "FLUSHALL")


def ready_lists(keys: Keys, shard: int) -> list[str]:
    """The shard's ready lists the machine's jobs can be in (one queue, one tenant)."""
    return [keys.ready(shard, "default", p.value, "default") for p in PRIORITIES]


class JobMachine(RuleBasedStateMachine):
    base: Settings  # the backend's, set by the test

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        # one shard: which shard a (random) job id lands on must not change between the
        # runs hypothesis replays
        s = self.base.replace(shards=1)
        self.queue = self.loop.run_until_complete(Queue.connect(s, catalog=False))
        self.run(_flushall(self.base))
        # a new Redis again: marked as connecting marks one (the next example's connect
        # would refuse an unmarked shard whose log had entries)
        self.run(job_format.adopt(self.queue.redis, self.queue.keys))
        self.jobs: list[ModelJob] = []

    def teardown(self) -> None:
        self.loop.run_until_complete(self.queue.close())
        self.loop.close()

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def shard(self, job: ModelJob) -> int:
        return self.queue.keys.shard_of(job.id)

    def bump(self, job: ModelJob, **changes: Any) -> None:
        for key, value in changes.items():
            setattr(job, key, value)
        job.version += 1

    # --- rules ------------------------------------------------------------------------------
    @rule(
        delayed=st.booleans(),
        max_attempts=st.integers(1, 3),
        priority=st.sampled_from(["high", "low"]),
    )
    def submit(self, delayed: bool, max_attempts: int, priority: str) -> None:
        sub = self.run(
            self.queue.submit(
                "t",
                None,
                delay=3600 if delayed else None,
                max_attempts=max_attempts,
                priority=priority,
            )
        )
        state = State.SCHEDULED if delayed else State.QUEUED
        self.jobs.append(ModelJob(sub.job_id, state, max_attempts=max_attempts))

    @rule(count=st.integers(1, 4))
    def claim(self, count: int) -> None:
        shard = 0
        batch = self.run(self.queue.scripts.claim(shard, "w1", count, 60_000))
        ready = [j for j in self.jobs if j.state is State.QUEUED and self.shard(j) == shard]
        assert len(batch.jobs) == min(count, len(ready))
        by_id = {j.id: j for j in ready}
        for claimed in batch.jobs:
            job = by_id[claimed.id]  # only queued jobs are claimed
            self.bump(job, state=State.RUNNING, attempt=job.attempt + 1, worker="w1")
            job.lease_version = job.version
            assert (claimed.attempt, claimed.lease_version) == (job.attempt, job.lease_version)

    def pick(self, data: st.DataObject) -> ModelJob:
        return data.draw(st.sampled_from(self.jobs))

    def expect_lease(self, job: ModelJob, lease_version: int, worker: str = "w1") -> Code:
        if job.state is not State.RUNNING:
            return Code.WRONG_STATE
        if lease_version != job.lease_version:
            return Code.VERSION_CONFLICT
        if worker != job.worker:
            return Code.NOT_OWNER
        return Code.OK

    @precondition(lambda self: self.jobs)
    @rule(
        data=st.data(),
        stale=st.sampled_from([0, 0, -1, 1]),
        worker=st.sampled_from(["w1", "w1", "w2"]),
    )
    def complete(self, data: st.DataObject, stale: int, worker: str) -> None:
        job = self.pick(data)
        lv = job.lease_version + stale
        expected = self.expect_lease(job, lv, worker)
        (code,) = self.run(
            self.queue.scripts.call(
                *complete_call(self.shard(job), worker, 60, [(job.id, lv, b"1")])
            )
        )
        assert Code(code) is expected
        if expected is Code.OK:
            self.bump(job, state=State.SUCCEEDED)

    @precondition(lambda self: self.jobs)
    @rule(data=st.data(), retryable=st.booleans())
    def fail(self, data: st.DataObject, retryable: bool) -> None:
        job = self.pick(data)
        expected = self.expect_lease(job, job.lease_version)
        reply = self.run(
            self.queue.scripts.call(
                *fail_call(
                    self.shard(job),
                    "w1",
                    60,
                    [
                        (
                            job.id,
                            job.lease_version,
                            b'{"type":"E","message":"m"}',
                            3_600_000 if retryable else -1,
                        )
                    ],
                )
            )
        )
        code, state = parse_pairs(reply)[0]
        assert code is expected
        if expected is Code.OK:
            if job.cancel:  # a pending cancel request wins: no retry, no dead letter
                new = State.CANCELLED
            elif retryable and job.attempt < job.max_attempts:
                new = State.SCHEDULED
            else:
                new = State.FAILED
            assert state.decode() == new.value
            self.bump(job, state=new)

    @precondition(lambda self: self.jobs)
    @rule(data=st.data(), progress=st.sampled_from(["", "0.5", "1"]))
    def heartbeat(self, data: st.DataObject, progress: str) -> None:
        job = self.pick(data)
        expected = self.expect_lease(job, job.lease_version)
        reply = self.run(
            self.queue.scripts.call(
                *heartbeat_call(
                    self.shard(job), "w1", 60_000, [(job.id, job.lease_version, progress.encode())]
                )
            )
        )
        code, cancel = parse_pairs(reply)[0]
        assert code is expected
        if code is Code.OK:
            assert bool(cancel) == job.cancel
            if progress and progress != job.progress:
                self.bump(job, progress=progress)

    @precondition(lambda self: self.jobs)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        job = self.pick(data)
        code, _ = self.run(self.queue.scripts.cancel(self.shard(job), "", job.id, 60))
        if job.state in WAITING:
            assert code is Code.OK
            self.bump(job, state=State.CANCELLED, cancel=True)
        elif job.state is State.RUNNING:
            assert code is Code.OK
            if not job.cancel:
                self.bump(job, cancel=True)
        else:
            assert code is Code.WRONG_STATE

    @precondition(lambda self: self.jobs)
    @rule(data=st.data())
    def stopped(self, data: st.DataObject) -> None:
        job = self.pick(data)
        expected = self.expect_lease(job, job.lease_version)
        reply = self.run(
            self.queue.scripts.call(
                *stopped_call(self.shard(job), "w1", 60, [(job.id, job.lease_version)])
            )
        )
        assert parse_pairs(reply)[0][0] is expected
        if expected is Code.OK:
            if job.cancel:
                self.bump(job, state=State.CANCELLED)
            else:
                self.bump(job, state=State.QUEUED, attempt=job.attempt - 1, worker="")

    @precondition(lambda self: self.jobs)
    @rule(data=st.data())
    def lease_expires(self, data: st.DataObject) -> None:
        job = self.pick(data)
        keys = self.queue.keys
        if job.state is State.RUNNING:
            self.run(self.queue.redis.zadd(keys.active(self.shard(job)), {job.id: 1}))
        s = self.queue.settings
        self.run(self.queue.scripts.call(*reclaim_call(self.shard(job), 100, 60, 60)))
        del s
        if job.state is State.RUNNING:
            if job.cancel:
                self.bump(job, state=State.CANCELLED, worker="")
            elif job.attempt < job.max_attempts:
                self.bump(job, state=State.QUEUED, worker="")
            else:
                self.bump(job, state=State.FAILED, worker="")

    @precondition(lambda self: self.jobs)
    @rule(data=st.data())
    def becomes_due(self, data: st.DataObject) -> None:
        job = self.pick(data)
        keys = self.queue.keys
        if job.state is State.SCHEDULED:
            self.run(self.queue.redis.zadd(keys.sched(self.shard(job)), {job.id: 1}))
        self.run(self.queue.scripts.call(*promote_call(self.shard(job), 100)))
        if job.state is State.SCHEDULED:
            self.bump(job, state=State.QUEUED)

    @precondition(lambda self: self.jobs)
    @rule(data=st.data())
    def replay(self, data: st.DataObject) -> None:
        job = self.pick(data)
        code, _ = self.run(self.queue.scripts.replay(self.shard(job), "", job.id))
        if job.state is State.FAILED:
            assert code is Code.OK
            self.bump(job, state=State.QUEUED, attempt=0, worker="")
        else:
            assert code is Code.WRONG_STATE

    # --- invariants -------------------------------------------------------------------------
    @invariant()
    def redis_agrees(self) -> None:
        keys = self.queue.keys
        # everything in one pipeline: this runs after every one of thousands of steps, and
        # round trips are most of its time
        pipe = self.queue.redis.pipeline(transaction=False)
        for s in range(keys.shards):
            for q in ready_lists(keys, s):
                pipe.lrange(q, 0, -1)
        for zset in (keys.sched, keys.active, keys.dead):
            for s in range(keys.shards):
                pipe.zrange(zset(s), 0, -1)
        docs = read_docs(self.queue.redis, keys, [job.id for job in self.jobs])
        replies = iter(self.run(pipe.execute()) + [doc for _, doc in self.run(docs)])
        queued: set[bytes] = set()
        for _ in range(sum(len(ready_lists(keys, s)) for s in range(keys.shards))):
            queued |= set(next(replies))
        sched, active, dead = (
            set().union(*(next(replies) for _ in range(keys.shards))) for _ in range(3)
        )
        for job in self.jobs:
            status = decode_status(next(replies))
            assert (status.state, status.version, status.attempt, status.cancel_requested) == (
                job.state,
                job.version,
                job.attempt,
                job.cancel,
            ), job
            bid = job.id.encode()
            assert (bid in queued) == (job.state is State.QUEUED)
            assert (bid in sched) == (job.state is State.SCHEDULED)
            assert (bid in active) == (job.state is State.RUNNING)
            assert (bid in dead) == (job.state is State.FAILED)
        waiting = sum(j.state in WAITING for j in self.jobs)
        assert sum(self.run(self.queue.admin.waiting_by_tenant()).values()) == waiting


def test_state_machine_agrees_with_the_model(settings: Settings) -> None:
    JobMachine.base = settings
    run_state_machine_as_test(
        JobMachine,
        settings=run_settings(
            max_examples=100,
            stateful_step_count=50,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
