"""Processes killed (SIGKILL) around a flow's resolution and a job's failure lose nothing:
every dependent resolves exactly once, every failure for good has exactly one compensation.
On the single Redis and the Redis Cluster (``contract``); the killed processes are real ones
(tests/flow_crash.py, ``jobtier worker``, ``jobtier scheduler``)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import cast

import msgspec
import pytest

from jobtier.config import Settings
from jobtier.core.model import FlowJob, JobSpec, JobStatus, State, decode_status
from jobtier.dev.local_redis import free_port
from jobtier.engine.queue import Queue
from jobtier.flows import chain, fan_in
from jobtier.scheduler import Scheduler
from tests.fixtures.engine import Background, wait_for, worker_for
from tests.fixtures.redis import logged
from tests.flows_helpers import statuses, transitions
from tests.tasks import registry

pytestmark = pytest.mark.contract


@pytest.fixture
def crash_settings(settings: Settings) -> Settings:
    # leases and hand-offs of the dead are taken over within a second or two
    return settings.replace(lease_seconds=1.5, resolver_claim_idle_seconds=0.5)


@pytest.fixture
async def cq(crash_settings: Settings) -> AsyncIterator[Queue]:
    q = await Queue.connect(crash_settings, registry)
    yield q
    await q.close()


class Processes:
    """Child processes of a test: every one is killed (if alive) and reaped at the end."""

    def __init__(self, settings: Settings) -> None:
        self.env = dict(os.environ)
        self.env.update(
            JOBTIER_REDIS_URL=settings.redis_url,
            JOBTIER_REDIS_CLUSTER="1" if settings.redis_cluster else "0",
            JOBTIER_SHARDS=str(settings.shards),
            JOBTIER_LEASE_SECONDS=str(settings.lease_seconds),
            JOBTIER_RESOLVER_CLAIM_IDLE_SECONDS=str(settings.resolver_claim_idle_seconds),
            # the scheduler's schedule reconciliation finds no Postgres: it logs and goes on
            JOBTIER_DATABASE_URL=f"postgresql://nobody@127.0.0.1:{free_port()}/none",
        )
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, *args: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, *args], env=self.env, stdout=subprocess.DEVNULL
        )  # stderr inherited: pytest captures the child's log with the test's
        self.procs.append(proc)
        return proc

    def crash(self, role: str) -> subprocess.Popen[bytes]:
        return self.start("-m", "tests.flow_crash", role)

    def cli(self, *args: str) -> subprocess.Popen[bytes]:
        return self.start("-m", "jobtier.cli.main", *args)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


@pytest.fixture
def processes(crash_settings: Settings) -> Iterator[Processes]:
    procs = Processes(crash_settings)
    yield procs
    procs.stop()


async def killed(proc: subprocess.Popen[bytes]) -> None:
    """Wait until the process died of SIGKILL (it kills itself at its chosen point)."""
    await wait_for(lambda: proc.poll() is not None, timeout=60)
    assert proc.returncode == -signal.SIGKILL


async def pending_handoffs(q: Queue) -> int:
    total = 0
    for shard in range(q.keys.shards):
        info = await q.redis.xpending(q.keys.flow(shard), q.keys.resolver_group())
        total += int(info["pending"])
    return total


async def handoffs(q: Queue) -> int:
    return sum([await q.redis.xlen(q.keys.flow(s)) for s in range(q.keys.shards)])


async def once_each(q: Queue, ids: list[str]) -> None:
    """Each dependent left ``waiting`` for ``queued`` exactly once."""
    for job_id in ids:
        assert (await transitions(q, job_id)).count(("waiting", "queued")) == 1, job_id


async def test_a_resolver_killed_mid_resolution_loses_nothing(
    cq: Queue, processes: Processes, background: Background
) -> None:
    bases = [
        s.job_id for s in await cq.submit_many([JobSpec(type="echo", payload=i) for i in range(60)])
    ]
    dependents = [
        (
            await cq.submit(
                "collect", i, depends_on=[bases[i], bases[(i + 1) % 60], bases[(i + 7) % 60]]
            )
        ).job_id
        for i in range(60)
    ]
    flow = await cq.submit_flow(
        fan_in(FlowJob(type="collect"), [FlowJob(type="echo", payload=i) for i in range(300)])
    )
    parent = flow.ids[-1]
    await worker_for(cq, registry, burst=True).run()  # every dependency done; nobody resolved
    made = await handoffs(cq)
    assert made == 360

    await killed(processes.crash("resolver"))
    # it told some dependents and acknowledged nothing
    waiting = await statuses(cq, [*dependents, parent])
    told = [s for s in waiting if s.dependencies is not None and s.dependencies.done > 0]
    assert 0 < len(told) < len(waiting)
    assert await pending_handoffs(cq) == made

    scheduler = Scheduler(cq.store)  # its resolver takes the dead one's hand-offs over
    background.start(scheduler)
    background.start(worker_for(cq, registry))

    async def all_done() -> bool:
        return {s.state for s in await statuses(cq, [*dependents, parent])} == {State.SUCCEEDED}

    await wait_for(all_done, timeout=60)
    assert scheduler.resolver is not None
    st = scheduler.resolver.stats
    assert st.claimed == made
    # 480 dependents' dependencies in all (3 for each of 60, 300 for the parent): what the
    # dead one had applied came again and changed nothing (its targets had moved on, or had
    # that dependency resolved)
    assert st.applied + st.repeated + st.moot == 480
    assert st.applied < 480 and st.repeated + st.moot == 480 - st.applied
    await once_each(cq, [*dependents, parent])
    for i, job_id in enumerate(dependents):
        out = (await cq.result(job_id))[1]
        wanted = [bases[i], bases[(i + 1) % 60], bases[(i + 7) % 60]]
        assert out["dependencies"] == {b: ["succeeded", bases.index(b), None] for b in wanted}
    parent_out = (await cq.result(parent))[1]
    assert [v[1] for v in parent_out["dependencies"].values()] == list(range(300))
    assert await handoffs(cq) == 0  # acknowledged and deleted


async def test_a_worker_killed_between_success_and_resolution_loses_nothing(
    cq: Queue, processes: Processes, background: Background
) -> None:
    flows = [
        await cq.submit_flow(
            fan_in(
                FlowJob(type="collect", payload=p),
                # attempts left for the jobs the killed worker was running
                [FlowJob(type="echo", payload=[p, c], max_attempts=3) for c in range(5)],
            )
        )
        for p in range(20)
    ]
    parents = [f.ids[-1] for f in flows]
    await killed(processes.crash("worker-complete"))
    # successes are in Redis with their hand-offs; nothing applied them
    children = [i for f in flows for i in f.ids[:-1]]
    done = [s for s in await statuses(cq, children) if s.state is State.SUCCEEDED]
    assert done and await handoffs(cq) == len(done)
    assert all(s.dependencies.done == 0 for s in await statuses(cq, parents) if s.dependencies)

    background.start(Scheduler(cq.store))  # requeues the dead worker's other jobs; resolves
    background.start(worker_for(cq, registry))

    async def all_done() -> bool:
        return {s.state for s in await statuses(cq, parents)} == {State.SUCCEEDED}

    await wait_for(all_done, timeout=60)
    await once_each(cq, parents)
    for p, job_id in enumerate(parents):
        out = (await cq.result(job_id))[1]
        assert [v[1] for v in out["dependencies"].values()] == [[p, c] for c in range(5)]


@pytest.mark.parametrize("role", ["worker-fail", "worker-fail-unsent"])
async def test_a_worker_killed_around_a_failure_leaves_one_compensation_each(
    cq: Queue, processes: Processes, background: Background, role: str
) -> None:
    """Killed just after Redis took a failure for good (the compensation came with it), or
    just before it could say so (the lease expires; reclaim.lua fails the job for good, and
    makes the compensation in the same script)."""
    subs = await cq.submit_many(
        [JobSpec(type="charge", payload={"n": i, "fail": True}, max_attempts=1) for i in range(12)]
    )
    ids = [s.job_id for s in subs]
    doomed = processes.crash(role)
    await killed(doomed)
    if role == "worker-fail":
        failed = [s.id for s in await statuses(cq, ids) if s.state is State.FAILED]
        assert failed
        for job_id in failed:  # in Redis before the worker died: no one else ran
            assert await cq.jobs.compensation_of(job_id) is not None
    background.start(Scheduler(cq.store))
    background.start(worker_for(cq, registry))

    def lost_by_the_dead(s: JobStatus) -> bool:
        """A compensation the killed worker had claimed in its last moment: `refund` has one
        attempt, so its lease running out fails it for good, as it would any such job."""
        return (
            s.state is State.FAILED
            and s.error is not None
            and s.error.type == "LeaseExpired"
            and f":{doomed.pid}:" in s.error.message
        )

    async def all_compensated() -> bool:
        states = {s.state for s in await statuses(cq, ids)}
        comps = [await cq.jobs.compensation_of(i) for i in ids]
        if states != {State.FAILED} or None in comps:
            return False
        return all(
            s.state is State.SUCCEEDED or lost_by_the_dead(s)
            for s in await statuses(cq, cast(list[str], comps))
        )

    await wait_for(all_compensated, timeout=60)
    made = await compensations(cq)
    assert made == Counter(ids)  # exactly one each
    if role == "worker-fail-unsent":
        errors = {
            (await cq.jobs.payload((await cq.jobs.compensation_of(i)) or ""))["error"]["type"]
            for i in ids
        }
        assert "LeaseExpired" in errors


async def compensations(q: Queue) -> Counter[str]:
    """How many compensation jobs each failed job got (from the submit log entries)."""
    made: Counter[str] = Counter()
    for shard in range(q.keys.shards):
        for fields in await logged(q.redis, q.keys.log(shard)):
            if fields[b"fr"] == b"" and decode_status(fields[b"d"]).type == "refund":
                made[msgspec.json.decode(fields[b"p"])["job_id"]] += 1
    return made


async def test_schedulers_and_workers_killed_under_load_lose_no_resolution(
    cq: Queue, processes: Processes
) -> None:
    """Real ``jobtier scheduler`` and ``jobtier worker`` processes, SIGKILLed one after the
    other while flows run and replaced; at the end every flow has finished, each dependent
    was queued exactly once, and every result is right."""
    rng = random.Random(7)
    fans = [
        await cq.submit_flow(
            fan_in(
                # attempts enough for every kill to catch a job running
                FlowJob(type="collect", payload=p, max_attempts=20),
                [FlowJob(type="echo", payload=[p, c], max_attempts=20) for c in range(25)],
            )
        )
        for p in range(40)
    ]
    chains = [
        await cq.submit_flow(
            chain(*[FlowJob(type="add", payload=1, max_attempts=20) for _ in range(8)])
        )
        for _ in range(40)
    ]
    worker_args = ("worker", "tests.tasks:registry", "--concurrency", "10")
    alive = {
        "scheduler": [processes.cli("scheduler"), processes.cli("scheduler")],
        "worker": [processes.cli(*worker_args), processes.cli(*worker_args)],
    }
    dependents = [f.ids[-1] for f in fans] + [i for c in chains for i in c.ids[1:]]

    async def finished() -> int:
        return sum(s.state is State.SUCCEEDED for s in await statuses(cq, dependents))

    kills = 0
    while kills < 10:  # whenever some progress was made: kill one, start its replacement
        before = await finished()
        if before == len(dependents):
            break

        async def progressed(before: int = before) -> bool:
            return await finished() > before

        await wait_for(progressed, timeout=60)
        role = rng.choice(["scheduler", "worker"])
        victim = alive[role].pop(rng.randrange(len(alive[role])))
        victim.kill()
        victim.wait(10)
        kills += 1
        alive[role].append(
            processes.cli("scheduler") if role == "scheduler" else processes.cli(*worker_args)
        )

    async def all_done() -> bool:
        return await finished() == len(dependents)

    await wait_for(all_done, timeout=120)
    await once_each(cq, dependents)
    for p, f in enumerate(fans):
        out = (await cq.result(f.ids[-1]))[1]
        assert [v[1] for v in out["dependencies"].values()] == [[p, c] for c in range(25)]
    for c in chains:
        assert [(await cq.result(i))[1] for i in c.ids] == list(range(1, 9))
