"""Checkpoints (ctx.checkpoint): saved under the lease, handed to the next attempt — after a
failure, and after the worker was SIGKILLed mid-job — shown in the status document, served
by GET /v1/jobs/{id}/checkpoint, and kept in Postgres with their transitions."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import msgspec
import pytest

from jobtier.api.records import PostgresExtension
from jobtier.client import AsyncClient, Client, NotFound
from jobtier.config import Settings
from jobtier.core.errors import Code
from jobtier.core.model import State
from jobtier.engine.checkpoint_reads import read_checkpoint
from jobtier.engine.queue import Queue
from jobtier.persist.db import Pool
from jobtier.persist.persister import Persister
from jobtier.scheduler import Scheduler
from jobtier.store.calls import heartbeat_call, parse_pairs
from jobtier.streams.entries import parse_entries
from tests.checkpoint_tasks import registry
from tests.fixtures.api import KEYS, StartApi
from tests.fixtures.engine import Background, wait_for, worker_for
from tests.fixtures.postgres import log_entries

pytestmark = pytest.mark.contract


def worker_process(settings: Settings) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.update(
        JOBTIER_REDIS_URL=settings.redis_url,
        JOBTIER_REDIS_CLUSTER="1" if settings.redis_cluster else "0",
        JOBTIER_SHARDS=str(settings.shards),
        JOBTIER_LEASE_SECONDS=str(settings.lease_seconds),
    )
    return subprocess.Popen(
        [sys.executable, "-m", "jobtier.cli.main", "worker", "tests.checkpoint_tasks:registry"],
        env=env,
        stdout=subprocess.DEVNULL,  # its log goes to stderr, which pytest captures
    )


async def saved_next(queue: Queue, job_id: str) -> int:
    """The chunk the job's last checkpoint says comes next (-1: none saved)."""
    found = await read_checkpoint(queue.store, job_id)
    if found is None:
        return -1
    return int(msgspec.json.decode(found[0])["next"])


async def test_a_sigkilled_worker_s_job_resumes_from_its_last_checkpoint(
    settings: Settings, background: Background
) -> None:
    settings = settings.replace(lease_seconds=1.5)
    queue = await Queue.connect(settings, registry)
    try:
        job = await queue.submit("chunked", {"chunks": 6, "hang_after": 3})
        proc = worker_process(settings)
        try:

            async def three_saved() -> bool:
                return await saved_next(queue, job.job_id) == 3

            await wait_for(three_saved, timeout=30)
            held = await queue.status(job.job_id)
            assert held.state is State.RUNNING and held.checkpoint is not None
            assert held.checkpoint.attempt == 1 and held.checkpoint.bytes > 0
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        background.start(Scheduler(queue.store))  # reclaims the expired lease
        background.start(worker_for(queue, registry))

        async def done() -> bool:
            return (await queue.status(job.job_id)).terminal

        await wait_for(done, timeout=30)
        status, result = await queue.result(job.job_id)
        assert status.state is State.SUCCEEDED
        # the second attempt ran chunks 3, 4, 5 only, from the state the first one saved
        assert result == {
            "attempt": 2, "resumed": True, "resumed_from": 3, "ran": [3, 4, 5], "sum": 15
        }  # fmt: skip
        assert status.checkpoint is not None and status.checkpoint.attempt == 2
        # the killed worker's late checkpoint is refused by its lease fence: nothing changes
        assert held.worker is not None
        call = heartbeat_call(
            queue.keys.shard_of(job.job_id),
            held.worker,
            60_000,
            [(job.job_id, held.version, b"")],
            checkpoints=[(0, b'{"next":0,"sum":0}')],
        )
        ((code, _),) = parse_pairs(await queue.scripts.call(*call))
        assert code is not Code.OK
        assert await saved_next(queue, job.job_id) == 6
    finally:
        await background.stop()
        await queue.close()


async def test_a_retried_attempt_resumes_and_postgres_keeps_each_checkpoint(
    pg_settings: Settings, pg_pool: Pool, background: Background
) -> None:
    queue = await Queue.connect(pg_settings, registry)
    try:
        job = await queue.submit("chunked", {"chunks": 4, "fail_after": 2})
        background.start(Scheduler(queue.store))  # promotes the retry when due
        worker = worker_for(queue, registry)
        background.start(worker)

        async def done() -> bool:
            return (await queue.status(job.job_id)).terminal

        await wait_for(done, timeout=30)
        _, result = await queue.result(job.job_id)
        assert result == {"attempt": 2, "resumed": True, "resumed_from": 2, "ran": [2, 3], "sum": 6}
        assert worker.state.stats.checkpoints == 4  # worker_checkpoints_total

        entries = [p for e in await log_entries(queue.redis, queue.keys) for p in parse_entries(*e)]
        saved = [e for e in entries if e.checkpoint is not None]
        assert len(saved) == 4  # 2 by each attempt, each logged (never a quiet change)
        persister = Persister(pg_settings, queue.redis, pg_pool, "p1")
        assert await persister.drain() == len(entries)
        rows = await pg_pool.fetch(
            "SELECT version, attempt, state::text AS state FROM job_checkpoints "
            "WHERE job_id = $1 ORDER BY version",
            job.job_id,
        )
        assert [(r["attempt"], r["state"]) for r in rows] == [
            (1, '{"next":1,"sum":0}'),
            (1, '{"next":2,"sum":1}'),
            (2, '{"next":3,"sum":3}'),
            (2, '{"next":4,"sum":6}'),
        ]
        # each keyed as the transition that saved it
        versions = await pg_pool.fetch(
            "SELECT version FROM job_transitions WHERE job_id = $1", job.job_id
        )
        assert {r["version"] for r in rows} <= {v["version"] for v in versions}
        # replayed (a persister crashed before acknowledging): nothing doubles
        again = Persister(pg_settings, queue.redis, pg_pool, "p2")
        await again.drain()
        count = await pg_pool.fetchval(
            "SELECT count(*) FROM job_checkpoints WHERE job_id = $1", job.job_id
        )
        assert count == 4
    finally:
        await background.stop()
        await queue.close()


async def test_an_oversized_checkpoint_fails_the_job_and_saves_nothing(
    settings: Settings, background: Background
) -> None:
    small = settings.replace(checkpoint_max_bytes=100)
    queue = await Queue.connect(small, registry)
    try:
        job = await queue.submit("oversized", 200)
        background.start(worker_for(queue, registry))

        async def done() -> bool:
            return (await queue.status(job.job_id)).terminal

        await wait_for(done, timeout=30)
        status = await queue.status(job.job_id)
        assert status.state is State.FAILED and status.attempt == 1  # no retry makes it fit
        assert status.error is not None and status.error.type == "CheckpointTooLarge"
        assert "202 bytes" in status.error.message
        assert "JOBTIER_CHECKPOINT_MAX_BYTES" in status.error.message
        assert status.checkpoint is None
        assert await read_checkpoint(queue.store, job.job_id) is None
    finally:
        await background.stop()
        await queue.close()


async def test_the_checkpoint_route_serves_the_state_to_its_tenant_only(
    pg_settings: Settings, pg_pool: Pool, start_api: StartApi, background: Background
) -> None:
    api = await start_api(PostgresExtension(pg_settings), database_url=pg_settings.database_url)
    queue = await Queue.connect(pg_settings, registry)
    try:
        job = await queue.submit("chunked", {"chunks": 3}, tenant="acme")
        fresh = await queue.submit("chunked", {"chunks": 0}, tenant="acme")
        async with api.client() as client:
            r = await client.get(f"/v1/jobs/{fresh.job_id}/checkpoint")
            assert r.status_code == 200 and r.json() == {"id": fresh.job_id, "state": None}
            background.start(worker_for(queue, registry))

            async def done() -> bool:
                return (await queue.status(job.job_id)).terminal

            await wait_for(done, timeout=30)
            r = await client.get(f"/v1/jobs/{job.job_id}/checkpoint")
            assert r.status_code == 200
            body = r.json()
            assert body["state"] == {"next": 3, "sum": 3} and body["attempt"] == 1
            assert body["bytes"] == len(b'{"next":3,"sum":3}')
            doc = (await client.get(f"/v1/jobs/{job.job_id}")).json()
            assert doc["checkpoint"] == {k: body[k] for k in ("at", "attempt", "bytes")}
        async with api.client("globex") as other:
            r = await other.get(f"/v1/jobs/{job.job_id}/checkpoint")
            assert r.status_code == 404
        # once Redis no longer holds the job, Postgres answers
        persister = Persister(pg_settings, queue.redis, pg_pool, "p1")
        await persister.drain()
        await queue.redis.delete(queue.keys.job_in(queue.keys.shard_of(job.job_id), job.job_id))
        async with api.client() as client:
            r = await client.get(f"/v1/jobs/{job.job_id}/checkpoint")
            assert r.status_code == 200
            assert r.json()["state"] == {"next": 3, "sum": 3} and r.json()["attempt"] == 1
        # the clients' method answers the same, and a job of another tenant is not found
        async with AsyncClient(api.url, KEYS["acme"]) as ours:
            saved = await ours.checkpoint(job.job_id)
            assert saved.state == {"next": 3, "sum": 3} and saved.attempt == 1, saved
            assert saved.bytes == len(b'{"next":3,"sum":3}') and saved.at == body["at"]
            assert (await ours.checkpoint(fresh.job_id)).state is None
        async with AsyncClient(api.url, KEYS["globex"]) as theirs:
            with pytest.raises(NotFound):
                await theirs.checkpoint(job.job_id)
        with Client(api.url, KEYS["acme"]) as sync_jobs:
            assert await asyncio.to_thread(sync_jobs.checkpoint, job.job_id) == saved
    finally:
        await background.stop()
        await queue.close()
