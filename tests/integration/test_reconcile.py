"""Reconcile after a failover that lost writes (persist/reconcile.py, store/lua/reconcile.lua).

A failover is simulated as it happens: Redis is snapshot (every key, DUMP), jobs move on and
the persister writes their transitions to Postgres, then Redis is put back to the snapshot
(the promoted replica lacked the last writes). Postgres is ahead of Redis for each job
moved meanwhile, in every way a job can be: absent (submitted after the snapshot) or older,
and queued, scheduled, running or finished in Postgres."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from jobtier.config import Settings
from jobtier.core.errors import IdempotencyConflict, JobNotFound
from jobtier.core.model import State, decode_status
from jobtier.engine.produce import DEFAULT_TENANT
from jobtier.engine.queue import Queue
from jobtier.metrics.prometheus import render
from jobtier.persist import reconcile as reconcile_module
from jobtier.persist.db import Pool, query
from jobtier.persist.persister import Persister
from jobtier.persist.reconcile import _CHANGED, Reconciler, Report, _batches, reconcile
from jobtier.status.reader import StatusReader
from jobtier.store import calls
from jobtier.store import format as job_format
from tests.fixtures.engine import running, wait_for, worker_for
from tests.fixtures.redis import admin
from tests.flows_helpers import run_flows
from tests.tasks import registry

pytestmark = pytest.mark.contract

LOST = "lost"  # the queue of the jobs claimed by hand (nothing else is claimed there)
WINDOW = 900.0


async def snapshot(q: Queue) -> list[tuple[bytes, int, bytes]]:
    """Every key of Redis (each node of a cluster): its name, TTL (ms, 0 none) and DUMP."""
    out = []
    async with admin(q.settings) as redis:
        async for key in redis.scan_iter(count=1000):
            ttl = await redis.pttl(key)
            dumped = await redis.dump(key)
            assert dumped is not None, key  # nothing else writes meanwhile
            out.append((key, max(int(ttl), 0), dumped))
    return out


async def restore(q: Queue, saved: list[tuple[bytes, int, bytes]]) -> None:
    """Redis as it was at ``snapshot``: what was written since is lost. (RESTORE is not for
    jobtier's own user: the test's client, as the default user.)"""
    async with admin(q.settings) as redis:
        async for key in redis.scan_iter(count=1000):
            await redis.delete(key)
        for key, ttl, value in saved:
            await redis.restore(key, ttl, value, replace=True)


@dataclass
class Lost:
    """The jobs of one simulated failover, by how Redis lost them."""

    kept: str = ""  # persisted before the snapshot, unchanged since: Redis is as Postgres
    queued: str = ""  # submitted after: absent, queued in Postgres
    scheduled: str = ""  # submitted after with a delay: absent, scheduled in Postgres
    running: str = ""  # submitted and claimed after: absent, running in Postgres
    claimed: str = ""  # submitted before, claimed after: queued v1 in Redis, running v2
    finished: str = ""  # submitted before, done after: queued v1 in Redis, succeeded v3
    done: str = ""  # submitted and done after: absent, succeeded in Postgres
    ahead: str = ""  # after the failover: persisted queued v1, running v2 in Redis only
    all: list[str] = field(default_factory=list)


async def claim(q: Queue, job_id: str) -> int:
    """Claim ``job_id`` (alone in the LOST queue of its shard); its lease version."""
    return await claim_from(q, job_id, LOST)


async def failover(q: Queue, pg_settings: Settings, pg_pool: Pool) -> Lost:
    """Jobs persisted, a snapshot, jobs moved on and persisted, Redis back to the snapshot,
    then a job moved on in Redis only."""
    p = Persister(pg_settings, q.redis, pg_pool, "p1")
    lost = Lost()
    lost.kept = (await q.submit("echo", "kept", queue=LOST + "-kept")).job_id
    lost.claimed = (await q.submit("echo", "claimed", queue=LOST)).job_id
    lost.finished = (await q.submit("echo", "finished", queue=LOST + "-f")).job_id
    await p.drain()
    saved = await snapshot(q)

    lost.queued = (await q.submit("echo", "queued", queue=LOST + "-q")).job_id
    lost.scheduled = (await q.submit("echo", "scheduled", delay=3600)).job_id
    lost.running = (await q.submit("echo", "running", queue=LOST + "-r")).job_id
    await claim_from(q, lost.running, LOST + "-r")
    await claim(q, lost.claimed)
    await finish_from(q, lost.finished, LOST + "-f", b'{"answer":42}')
    lost.done = (await q.submit("echo", "done", queue=LOST + "-d")).job_id
    await finish_from(q, lost.done, LOST + "-d", b'"fine"')
    await p.drain()
    await restore(q, saved)

    p = Persister(pg_settings, q.redis, pg_pool, "p2")
    lost.ahead = (await q.submit("echo", "ahead", queue=LOST + "-a")).job_id
    await p.drain()
    await claim_from(q, lost.ahead, LOST + "-a")
    lost.all = [
        lost.kept, lost.queued, lost.scheduled, lost.running, lost.claimed, lost.finished,
        lost.done, lost.ahead,
    ]  # fmt: skip
    return lost


async def claim_from(q: Queue, job_id: str, queue: str) -> int:
    batch = await q.scripts.claim(q.keys.shard_of(job_id), "w-lost", 10, 60_000, ((queue, -1),))
    assert [j.id for j in batch.jobs] == [job_id]
    return batch.jobs[0].lease_version


async def finish_from(q: Queue, job_id: str, queue: str, result: bytes) -> None:
    lease = await claim_from(q, job_id, queue)
    call = calls.complete_call(q.keys.shard_of(job_id), "w-lost", 86400, [(job_id, lease, result)])
    (codes,) = await q.scripts.call_many([call])
    assert codes == [0]


def since(seconds: float) -> datetime:
    return datetime.now(UTC) - timedelta(seconds=seconds)


async def redis_state(q: Queue, job_id: str) -> tuple[str, int] | None:
    try:
        s = await q.status(job_id)
    except JobNotFound:
        return None
    return s.state.value, s.version


async def pg_state(pool: Pool, job_id: str) -> tuple[str, int]:
    row = await pool.fetchrow("SELECT state, version FROM jobs WHERE id = $1", job_id)
    assert row is not None
    return row["state"], row["version"]


@pytest.fixture
async def q(pg_settings: Settings) -> AsyncIterator[Queue]:
    queue = await Queue.connect(pg_settings, registry)
    try:
        yield queue
    finally:
        await queue.close()


async def test_reconcile_restores_each_kind_and_a_worker_runs_them(
    q: Queue, pg_settings: Settings, pg_pool: Pool
) -> None:
    lost = await failover(q, pg_settings, pg_pool)
    # the failover as Redis now has it
    assert await redis_state(q, lost.queued) is None
    assert await redis_state(q, lost.scheduled) is None
    assert await redis_state(q, lost.running) is None
    assert await redis_state(q, lost.done) is None
    assert await redis_state(q, lost.claimed) == ("queued", 1)
    assert await redis_state(q, lost.finished) == ("queued", 1)
    assert await redis_state(q, lost.ahead) == ("running", 2)
    assert await pg_state(pg_pool, lost.ahead) == ("queued", 1)

    async with pg_pool.acquire() as conn:
        report = await reconcile(pg_settings, q.redis, conn, WINDOW)
    assert report.repaired == {"restored": 3, "advanced": 1, "requeued": 2}, report
    assert report.checked == len(lost.all) and report.skipped == 0 and report.expired == 0

    # each as Postgres has it; the running ones back in their queue, one version on
    for job_id in (lost.kept, lost.queued, lost.scheduled, lost.finished, lost.done):
        assert await redis_state(q, job_id) == await pg_state(pg_pool, job_id), job_id
    assert await redis_state(q, lost.running) == ("queued", 3)
    assert await redis_state(q, lost.claimed) == ("queued", 3)
    assert (await q.status(lost.claimed)).attempt == 1  # its attempt kept
    assert await redis_state(q, lost.ahead) == ("running", 2)  # Redis ahead: untouched
    status, result = await q.result(lost.finished)
    assert status.state is State.SUCCEEDED and result == {"answer": 42}
    assert (await q.result(lost.done))[1] == "fine"
    scheduled = await q.status(lost.scheduled)
    assert scheduled.state is State.SCHEDULED and scheduled.run_at is not None
    # the documents are byte for byte the ones Postgres keeps
    for job_id in (lost.queued, lost.scheduled, lost.finished, lost.done):
        pg_doc = await pg_pool.fetchval("SELECT doc FROM jobs WHERE id = $1", job_id)
        assert await q.jobs.status_doc(job_id) == bytes(pg_doc), job_id

    # a second pass finds nothing to do
    async with pg_pool.acquire() as conn:
        again = await reconcile(pg_settings, q.redis, conn, WINDOW)
    assert again.total == 0 and again.checked == len(lost.all)

    # a worker runs the requeued and restored ones; the persister writes it all, no
    # transition twice, and the history of each job is complete
    worker = worker_for(q, registry, burst=True, queues=[LOST, LOST + "-q", LOST + "-r"])
    await asyncio.wait_for(worker.run(), 30)
    for job_id in (lost.queued, lost.running, lost.claimed):
        assert (await q.status(job_id)).state is State.SUCCEEDED, job_id
    assert (await q.status(lost.claimed)).attempt == 2
    await Persister(pg_settings, q.redis, pg_pool, "p3").drain()
    ids = [i for i in lost.all if i != lost.ahead]
    for job_id in ids:
        assert await redis_state(q, job_id) == await pg_state(pg_pool, job_id), job_id
    twice = await pg_pool.fetch(
        "SELECT job_id, version FROM job_transitions WHERE job_id = ANY($1::text[]) "
        "GROUP BY job_id, version HAVING count(*) > 1",
        ids,
    )
    assert twice == []
    assert await pg_pool.fetch(query("history_gaps"), ids) == []


async def test_a_submit_retried_with_its_key_after_a_failover_answers_the_restored_job(
    q: Queue, pg_settings: Settings, pg_pool: Pool
) -> None:
    """Retrying a submit with its idempotency key is the remedy for a failover (docs): once
    reconcile has put back a job Redis lost whole, its key's record is back too, and the
    retry answers that job instead of making (and running) a second one. A different request
    under the key is still a conflict."""
    p = Persister(pg_settings, q.redis, pg_pool, "p1")
    await p.drain()
    saved = await snapshot(q)
    first = await q.submit("echo", {"order": 42}, idempotency_key="order-42", queue=LOST + "-i")
    await p.drain()
    await restore(q, saved)  # the job and its record lost with Redis's last writes
    assert await redis_state(q, first.job_id) is None
    async with pg_pool.acquire() as conn:
        report = await reconcile(pg_settings, q.redis, conn, WINDOW)
    assert report.repaired["restored"] == 1, report
    again = await q.submit("echo", {"order": 42}, idempotency_key="order-42", queue=LOST + "-i")
    assert again.job_id == first.job_id and not again.created
    with pytest.raises(IdempotencyConflict):
        await q.submit("echo", {"order": 43}, idempotency_key="order-42", queue=LOST + "-i")
    # as long as the submit's own record would have lived
    key = f"{q.keys.base(q.keys.shard_of(first.job_id))}idem:{DEFAULT_TENANT}:order-42"
    left = await q.redis.pttl(key)
    assert 0 < left <= pg_settings.idempotency_ttl_seconds * 1000


async def test_a_dry_run_changes_nothing(q: Queue, pg_settings: Settings, pg_pool: Pool) -> None:
    lost = await failover(q, pg_settings, pg_pool)
    before = {job_id: await redis_state(q, job_id) for job_id in lost.all}
    async with pg_pool.acquire() as conn:
        report = await reconcile(pg_settings, q.redis, conn, WINDOW, dry_run=True)
    assert report.repaired == {"restored": 3, "advanced": 1, "requeued": 2}, report
    assert {job_id: await redis_state(q, job_id) for job_id in lost.all} == before
    assert "would repair 6" in "\n".join(report.lines())


async def test_the_window_bounds_the_pass(q: Queue, pg_settings: Settings, pg_pool: Pool) -> None:
    """Only the jobs Postgres changed since the watermark are compared: none in the last
    millisecond."""
    await failover(q, pg_settings, pg_pool)
    async with pg_pool.acquire() as conn:
        report = await reconcile(pg_settings, q.redis, conn, 0.001)
    assert report.checked == 0 and report.total == 0


@dataclass
class Primaries:
    """The run ids the persister's reconcile loop sees (``run_ids``, patched): the test
    changes them; ``looks`` counts the loop's looks."""

    ids: frozenset[str] = frozenset({"old"})
    looks: int = 0

    async def run_ids(self, redis: Any) -> frozenset[str]:
        self.looks += 1
        return self.ids


@asynccontextmanager
async def watching(
    q: Queue, pg_settings: Settings, pg_pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[Primaries, Persister]]:
    """A persister running, looking at the primaries every 20 ms, whose run ids the test
    holds; stopped at the end."""
    primaries = Primaries()
    monkeypatch.setattr(reconcile_module, "run_ids", primaries.run_ids)
    settings = pg_settings.replace(reconcile_seconds=0.02, outbox_relay=False)
    persister = Persister(settings, q.redis, pg_pool, "p-watch")
    async with running(persister):
        yield primaries, persister


async def test_a_persister_reconciles_when_a_primary_is_new(
    q: Queue, pg_settings: Settings, pg_pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The persister's trigger: a run id it has not seen among the primaries (a promoted
    replica) starts a pass; its repairs are counted in jobtier_reconciled_total{kind}."""
    lost = await failover(q, pg_settings, pg_pool)
    async with watching(q, pg_settings, pg_pool, monkeypatch) as (primaries, persister):
        await wait_for(lambda: primaries.looks >= 3)
        assert await redis_state(q, lost.queued) is None  # the same primaries: no pass
        primaries.ids = frozenset({"new"})

        async def restored() -> bool:
            return await redis_state(q, lost.done) is not None

        await wait_for(restored)
        await wait_for(lambda: sum(persister.metrics().counters["reconciled_total"].values()) == 6)
        counters = persister.metrics().counters["reconciled_total"]
        assert counters == {"kind=restored": 3, "kind=advanced": 1, "kind=requeued": 2}
        snapshot_ = persister.metrics()
        snapshot_.process, snapshot_.role = "persister:h:1", "persister"
        text = render([snapshot_], {}).decode()
        assert 'jobtier_reconciled_total{kind="requeued",process="persister:h:1"' in text, text


async def test_a_redis_that_lost_its_data_gets_every_live_job_back_and_its_marks(
    q: Queue, pg_settings: Settings, pg_pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Restarted without its data, Redis lost jobs that last moved long before the window (a
    job delayed a day, queued since): they are put back, and its shards marked again, so a
    process started now reads them (it refused them as 'format 1' and stopped)."""
    p = Persister(pg_settings, q.redis, pg_pool, "p1")
    old = (await q.submit("echo", "old", delay=3600)).job_id
    await p.drain()
    async with pg_pool.acquire() as conn:  # its last move two hours ago: outside the window
        await conn.execute(
            "UPDATE job_transitions SET at = at - interval '2 hours' WHERE job_id = $1", old
        )
    await restore(q, [])  # every key gone: a restart without data
    async with watching(q, pg_settings, pg_pool, monkeypatch) as (primaries, _):
        await wait_for(lambda: primaries.looks >= 2)
        primaries.ids = frozenset({"new"})

        async def back() -> bool:
            return await redis_state(q, old) == ("scheduled", 1)

        await wait_for(back)
        # the running processes write on (a log entry: the shard held jobs), and a process
        # starting now reads them, marked again ('format 1' before, and it stopped)
        await q.submit("echo", "after")
        await (await Queue.connect(pg_settings, catalog=False)).close()


async def test_jobtier_reconcile_puts_back_the_live_jobs_of_the_shards_that_lost_their_data(
    q: Queue, pg_settings: Settings, pg_pool: Pool
) -> None:
    """By hand (no persister saw the restart): only the shards without their marks lost
    their data; a job of another shard missing from Redis and outside the window is none of
    this pass's business."""
    p = Persister(pg_settings, q.redis, pg_pool, "p1")
    submitted: list[str] = []
    while len({q.keys.shard_of(j) for j in submitted}) < 2:  # jobs on two shards at least
        submitted.append((await q.submit("echo", "old", delay=3600)).job_id)
    lost_shard = q.keys.shard_of(submitted[0])
    lost = [j for j in submitted if q.keys.shard_of(j) == lost_shard]
    elsewhere = [j for j in submitted if q.keys.shard_of(j) != lost_shard]
    await p.drain()
    async with pg_pool.acquire() as conn:  # every one last moved two hours ago
        await conn.execute(
            "UPDATE job_transitions SET at = at - interval '2 hours' WHERE job_id = ANY($1)",
            submitted,
        )
    await restore(q, [])
    marked = [s for s in range(q.keys.shards) if s != lost_shard]
    await job_format.mark(q.redis, q.keys, marked)
    # a pass that cannot read Postgres marks nothing (the shard's loss is not forgotten)
    away = pg_settings.replace(database_url="postgresql://nobody@127.0.0.1:1/none")
    with pytest.raises(OSError):
        await reconcile_module.reconcile_once(
            away, q.redis, WINDOW, live_shards=frozenset({lost_shard}), mark=True
        )
    assert await job_format.unmarked(q.redis, q.keys) == [lost_shard]
    report = await reconcile_module.reconcile_once(pg_settings, q.redis, WINDOW)
    assert report.repaired["restored"] == len(lost), report
    for job_id in lost:
        assert await redis_state(q, job_id) == ("scheduled", 1)
    for job_id in elsewhere:
        assert await redis_state(q, job_id) is None
    # by hand, the marks are left to `jobtier job-format --upgrade`, which the report names
    assert report.unmarked == (lost_shard,) and "job-format --upgrade" in report.lines()[-1]
    assert await job_format.unmarked(q.redis, q.keys) == [lost_shard]


async def test_the_cli(q: Queue, pg_settings: Settings, pg_pool: Pool) -> None:
    lost = await failover(q, pg_settings, pg_pool)
    env = {
        **os.environ,
        "JOBTIER_REDIS_URL": pg_settings.redis_url,
        "JOBTIER_REDIS_CLUSTER": "1" if pg_settings.redis_cluster else "0",
        "JOBTIER_SHARDS": str(pg_settings.shards),
        "JOBTIER_DATABASE_URL": pg_settings.database_url,
    }

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "jobtier.cli.main", "reconcile", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )

    r = await asyncio.to_thread(run, "--dry-run", "--since", "15m")
    assert r.returncode == 0, r.stderr
    assert "dry run: nothing changed" in r.stdout and "would repair 6" in r.stdout, r.stdout
    assert await redis_state(q, lost.done) is None
    r = await asyncio.to_thread(run)
    assert r.returncode == 0, r.stderr
    assert "repaired 6: restored 3, advanced 1, requeued 2" in r.stdout, r.stdout
    assert f"event=reconciled job={lost.done} kind=restored from=absent to=succeeded:3" in r.stderr
    assert await redis_state(q, lost.done) == ("succeeded", 3)
    r = await asyncio.to_thread(run)
    assert r.returncode == 0 and "repaired 0" in r.stdout, r.stdout


async def test_the_script_refuses_a_job_redis_holds_as_new(
    q: Queue, pg_settings: Settings, pg_pool: Pool
) -> None:
    """reconcile.lua checks the version itself: the same repairs sent twice (a live
    transition, or another pass, got there between the comparison and the script) change
    nothing the second time."""
    await failover(q, pg_settings, pg_pool)
    reconciler = Reconciler(pg_settings, q.redis)
    async with pg_pool.acquire() as conn:
        rows = [r async for b in _batches(conn, _CHANGED, 100, since(WINDOW)) for r in b]
        first = Report()
        behind = await reconciler._behind(rows, first)
        assert len(behind) == 6
        await reconciler._restore(conn, behind, first)
        assert first.total == 6
        before = {job.id: await q.jobs.status_doc(job.id) for job in behind}
        second = Report()
        await reconciler._restore(conn, behind, second)
    assert second.total == 0 and second.skipped == 6
    assert {job.id: await q.jobs.status_doc(job.id) for job in behind} == before


async def test_dependents_are_not_left_waiting(
    q: Queue, pg_settings: Settings, pg_pool: Pool
) -> None:
    """A dependent Redis lost while it waited is relinked by the resolver; a finished job
    Redis lost is restored with its dependents, whose hand-off is made again."""
    p = Persister(pg_settings, q.redis, pg_pool, "p1")
    first = (await q.submit("echo", 1)).job_id
    await p.drain()
    saved = await snapshot(q)
    waits = (await q.submit("echo", 2, depends_on=[first])).job_id  # lost while waiting
    gone = (await q.submit("echo", 3, queue=LOST + "-g")).job_id
    after_gone = (await q.submit("echo", 4, depends_on=[gone])).job_id
    await finish_from(q, gone, LOST + "-g", b'"g"')  # its hand-off not applied before it
    await p.drain()
    await restore(q, saved)
    assert await redis_state(q, waits) is None and await redis_state(q, after_gone) is None

    async with pg_pool.acquire() as conn:
        report = await reconcile(pg_settings, q.redis, conn, WINDOW)
    assert report.repaired == {"restored": 3, "advanced": 0, "requeued": 0}, report
    assert await redis_state(q, waits) == ("waiting", 1)
    assert await redis_state(q, gone) == ("succeeded", 3)
    assert await redis_state(q, after_gone) == ("waiting", 1)
    # both relinked by the resolver: gone's outcome handed to after_gone again
    await run_flows(q)
    for job_id in (first, waits, after_gone):
        assert (await q.status(job_id)).state is State.SUCCEEDED, job_id
    assert (await q.result(waits))[1] == 2


async def test_the_status_tier_hears_the_repairs(
    q: Queue, pg_settings: Settings, pg_pool: Pool
) -> None:
    """Each repair is published like a transition: a near cache holding a job's old
    document (its lifetime far from over) is advanced by the event, with no read of Redis."""
    lost = await failover(q, pg_settings, pg_pool)
    reader = StatusReader(q.redis, q.keys, ttl=3600.0, final_ttl=3600.0, clock=lambda: 1000.0)
    subscriber = reader.subscription("test-reconcile")
    await subscriber.start()
    try:
        watched = (lost.finished, lost.claimed)
        for job_id in watched:
            cached = await reader.get(job_id)
            assert cached is not None and cached[2] == 1
        loads = reader.redis_loads
        async with pg_pool.acquire() as conn:
            await reconcile(pg_settings, q.redis, conn, WINDOW)

        async def advanced() -> bool:
            versions = []
            for job_id in watched:
                found = await reader.get(job_id)
                versions.append(found[2] if found else None)
            return versions == [3, 3]

        await wait_for(advanced)
        assert reader.redis_loads == loads
        found = await reader.get(lost.finished)
        assert found is not None and decode_status(found[1]).state is State.SUCCEEDED
    finally:
        await subscriber.stop()


async def claimed_then_saved(
    q: Queue, p: Persister
) -> tuple[str, int, list[tuple[bytes, int, bytes]], int]:
    """A job claimed and in Postgres as running; Redis saved as it then was: (its id, its
    lease, the save, its shard)."""
    job_id = (await q.submit("echo", "x", queue=LOST)).job_id
    lease = await claim(q, job_id)
    await p.drain()
    return job_id, lease, await snapshot(q), q.keys.shard_of(job_id)


async def restored_and_reconciled(
    q: Queue,
    saved: list[tuple[bytes, int, bytes]],
    pg_settings: Settings,
    pg_pool: Pool,
    held: tuple[str, tuple[str, int]] | None = None,
) -> Any:
    """Redis put back to ``saved`` (the writes since lost, as with a master), then one
    reconcile pass: its report. ``held``: a job id and the (state, version) Redis must hold
    for it once restored."""
    await restore(q, saved)
    if held is not None:
        assert await redis_state(q, held[0]) == held[1]
    async with pg_pool.acquire() as conn:
        return await reconcile(pg_settings, q.redis, conn, WINDOW)


async def test_a_running_job_with_a_cancel_request_is_cancelled(
    q: Queue, pg_settings: Settings, pg_pool: Pool
) -> None:
    """Running in Postgres with a cancel requested: nobody runs it any more (as when its
    lease expires), so it ends cancelled rather than going back to its queue."""
    p = Persister(pg_settings, q.redis, pg_pool, "p1")
    job_id = (await q.submit("echo", "x", queue=LOST)).job_id
    await p.drain()
    saved = await snapshot(q)
    await claim(q, job_id)
    await q.cancel(job_id)
    await p.drain()
    assert await pg_state(pg_pool, job_id) == ("running", 3)
    report = await restored_and_reconciled(q, saved, pg_settings, pg_pool)
    assert report.repaired["requeued"] == 1
    status = await q.status(job_id)
    assert (status.state, status.version, status.cancel_requested) == (State.CANCELLED, 4, True)
    assert status.error is not None and status.error.type == "Cancelled"
    await Persister(pg_settings, q.redis, pg_pool, "p2").drain()
    assert await pg_state(pg_pool, job_id) == ("cancelled", 4)
    assert await pg_pool.fetch(query("history_gaps"), [job_id]) == []


async def test_a_running_job_whose_lease_redis_kept_is_advanced_in_place(
    q: Queue, pg_settings: Settings, pg_pool: Pool
) -> None:
    """Redis lost only a progress report: it holds the job running at an older version under
    the same lease (worker, attempt, claim) Postgres has. The worker still runs it, so the
    job is moved forward where it is, not put back in its queue: the worker's completion is
    accepted, one attempt runs, and the history has no gap and no version twice."""
    p = Persister(pg_settings, q.redis, pg_pool, "p1")
    job_id, lease, saved, shard = await claimed_then_saved(q, p)
    beat = calls.heartbeat_call(shard, "w-lost", 60_000, [(job_id, lease, b'{"done":1}')])
    (codes,) = await q.scripts.call_many([beat])
    assert calls.parse_pairs(codes)[0][0] == 0
    await p.drain()
    assert await pg_state(pg_pool, job_id) == ("running", 3)
    report = await restored_and_reconciled(
        q, saved, pg_settings, pg_pool, held=(job_id, ("running", 2))
    )
    assert report.repaired == {"restored": 0, "advanced": 1, "requeued": 0}, report
    status = await q.status(job_id)
    assert (status.state, status.version, status.attempt) == (State.RUNNING, 3, 1)
    assert status.progress == {"done": 1} and status.worker == "w-lost"

    finish = calls.complete_call(shard, "w-lost", 86400, [(job_id, lease, b'"ok"')])
    (codes,) = await q.scripts.call_many([finish])
    assert codes == [0]  # the lease still holds
    await Persister(pg_settings, q.redis, pg_pool, "p2").drain()
    status = await q.status(job_id)
    assert (status.state, status.version, status.attempt) == (State.SUCCEEDED, 4, 1)
    assert await pg_state(pg_pool, job_id) == ("succeeded", 4)
    twice = await pg_pool.fetch(
        "SELECT version FROM job_transitions WHERE job_id = $1 GROUP BY version "
        "HAVING count(*) > 1",
        job_id,
    )
    assert twice == []
    assert await pg_pool.fetch(query("history_gaps"), [job_id]) == []


async def test_a_running_job_claimed_again_after_the_kept_lease_is_requeued(
    q: Queue, pg_settings: Settings, pg_pool: Pool
) -> None:
    """Postgres ahead by a later claim of the same job (its worker gave it back, then took it
    again: the same worker and attempt, another lease): the lease Redis holds is not the one
    the worker runs under, so the job goes back to its queue as before."""
    p = Persister(pg_settings, q.redis, pg_pool, "p1")
    job_id, lease, saved, shard = await claimed_then_saved(q, p)
    await q.scripts.call_many([calls.stopped_call(shard, "w-lost", 86400, [(job_id, lease)])])
    assert await claim(q, job_id) != lease
    await p.drain()
    assert await pg_state(pg_pool, job_id) == ("running", 4)
    report = await restored_and_reconciled(
        q, saved, pg_settings, pg_pool, held=(job_id, ("running", 2))
    )
    assert report.repaired == {"restored": 0, "advanced": 0, "requeued": 1}, report
    assert await redis_state(q, job_id) == ("queued", 5)
    assert (await q.status(job_id)).attempt == 1
