"""An HTTP worker's claim whose reply was lost (api/worker_claims.py): the API sends it again
itself, with its token, so that the jobs its first send leased reach the worker instead of
waiting out their lease, an attempt lost; the client library does not send it again. A claim
that answers without them (it has other jobs to answer) hands the lost send back: sent again
in the background, the jobs it leased go back to their queue."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from jobtier.api.worker_claims import Claimed, WorkerClaims
from jobtier.config import Settings
from jobtier.core.model import JobSpec, State, Submitted
from jobtier.dev.local_redis import LocalRedis
from jobtier.engine.queue import Queue
from jobtier.store.calls import Call, claim_call, parse_claim
from jobtier.store.scripts import Scripts
from tests.fixtures.lost_reply import lose_a_claims_reply_then_refuse_writes


async def _never_gone() -> bool:
    return False


async def test_an_http_claim_whose_reply_was_lost_answers_the_jobs_it_leased(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A single server's claim pipeline ran, its reply was lost with the connection, and the
    server answers READONLY meanwhile (a master demoted in a failover behind one address).
    Had the client library sent the claim again itself, its READONLY reply would say "not
    run": the claim would fail, and the jobs the first send leased would wait out their lease
    leased to a worker that never heard of them. Sent once, the API sees the lost connection
    and sends the same claims (their tokens) again until the server takes writes, and answers
    the jobs they leased."""
    server = LocalRedis(tmp_path / "redis").start()
    # the master the server is made a replica of: a port bound, not listening (refused)
    nobody = socket.socket()
    try:
        nobody.bind(("127.0.0.1", 0))
        queue = await Queue.connect(
            settings.replace(redis_url=server.url, lease_seconds=60.0), catalog=False
        )
        try:
            subs = await queue.submit_many([JobSpec(type="echo", payload=i) for i in range(20)])
            trips = lose_a_claims_reply_then_refuse_writes(
                queue, server, nobody.getsockname()[1], monkeypatch
            )
            claims = WorkerClaims(
                queue.redis, queue.keys, queue.scripts, queue.settings.retention_seconds
            )
            await claims.start()
            try:
                got = await _claim_through(claims, server, trips)
            finally:
                await claims.stop()
            assert trips[0] == "lost" and "readonly" in trips
            ids = {c.job.id for c in got}
            assert len(ids) == len(got) == 20  # each once
            for sub in subs:
                assert isinstance(sub, Submitted), sub
                status = await queue.status(sub.job_id)
                # leased to this worker, at its first attempt, and answered to it
                assert (status.state, status.attempt, status.worker) == (
                    State.RUNNING,
                    1,
                    "http-w",
                ), status
                assert sub.job_id in ids
        finally:
            await queue.close()
    finally:
        nobody.close()
        server.stop()


async def _claim_through(
    claims: WorkerClaims, server: LocalRedis, trips: list[str]
) -> list[Claimed]:
    """The claim of 20 jobs, the server made writable again once a claim sent again met it
    read-only."""
    admin = server.client()
    claim = asyncio.create_task(
        claims.claim("http-w", (), ["default"], 20, 60_000, 30.0, _never_gone)
    )
    try:
        async with asyncio.timeout(60):
            while "readonly" not in trips:
                await asyncio.wait({claim}, timeout=0.02)
                assert not claim.done(), claim  # (the claim failed: its result raises)
            admin.replicaof("no", "one")  # writes taken again
            return (await claim)[0]
    finally:
        admin.replicaof("no", "one")
        admin.close()
        claim.cancel()
        with contextlib.suppress(BaseException):  # (its failure is the assertion's)
            await claim


class LoseOneReply:
    """The scripts, but the reply of the first claim that leased jobs is lost: it ran, and its
    node went away before answering (once)."""

    def __init__(self, scripts: Scripts) -> None:
        self.scripts = scripts
        self.lost: list[Call] = []
        self.lost_reply: tuple[int, Any] = (0, None)  # (shard, the reply lost)

    async def call_many_each(self, calls: Sequence[Call]) -> list[Any]:
        replies = list(await self.scripts.call_many_each(calls))
        if not self.lost:
            for i, (call, reply) in enumerate(zip(calls, replies, strict=True)):
                if call[0] == "claim" and parse_claim(call[1], reply).jobs:
                    self.lost.append(call)
                    self.lost_reply = (call[1], reply)
                    replies[i] = RedisConnectionError("Connection closed by server.")
                    break
        return replies

    async def call_many(self, calls: Sequence[Call]) -> list[Any]:
        return await self.scripts.call_many(calls)


async def test_a_lost_replys_jobs_go_back_to_their_queue_when_the_claim_answers_others(
    queue: Queue,
) -> None:
    """One shard's claim ran and its reply was lost, the others answered: the claim answers
    their jobs at once, and hands the lost one back. Sent again in the background, it answers
    the jobs it leased (its token), which go back to their queue, their attempt not counted,
    instead of staying leased to a worker that never heard of them."""
    subs = await queue.submit_many([JobSpec(type="echo", payload=i) for i in range(16)])
    ids = []
    for sub in subs:
        assert isinstance(sub, Submitted), sub
        ids.append(sub.job_id)
    scripts = LoseOneReply(queue.scripts)
    claims = WorkerClaims(
        queue.redis, queue.keys, cast(Scripts, scripts), queue.settings.retention_seconds
    )
    try:
        got, _ = await claims.claim("http-w", (), ["default"], 16, 30_000, 0.0, _never_gone)
        assert scripts.lost and got  # a reply lost, the other shards' jobs answered
        answered = {c.job.id for c in got}
        async with asyncio.timeout(15):  # no scheduler: a job leased to nobody would stay so
            while True:
                states = [await queue.status(job) for job in ids if job not in answered]
                if not any(s.state is State.RUNNING for s in states):
                    break
                await asyncio.sleep(0.05)
        # the lost claim's jobs were leased, and given back: queued again, attempt 0; none
        # other was leased (its send again asked for none)
        given_back = [s for s in states if s.version > 1]
        assert len(given_back) == len(parse_claim(*scripts.lost_reply).jobs) > 0
        assert all((s.state, s.attempt) == (State.QUEUED, 0) for s in states), states
        for job in answered:
            status = await queue.status(job)
            assert (status.state, status.attempt, status.worker) == (State.RUNNING, 1, "http-w")
        # at the front of their queue, in the order they were claimed
        shard, reply = scripts.lost_reply
        lost = [job.id for job in parse_claim(shard, reply).jobs]
        (again,) = await queue.scripts.call_many(
            [claim_call(shard, "http-w2", len(lost), 30_000, [("default", -1)])]
        )
        assert [job.id for job in parse_claim(shard, again).jobs] == lost
    finally:
        await claims.stop()


async def test_a_send_handed_back_that_never_ran_leases_nothing(queue: Queue) -> None:
    """A send handed back whose first send never ran (refused before it reached Redis):
    sent again asking for no job, it leases none afresh, and changes nothing."""
    subs = await queue.submit_many([JobSpec(type="echo", payload=i) for i in range(8)])
    shard = queue.keys.shard_of(cast(Submitted, subs[0]).job_id)
    claims = WorkerClaims(queue.redis, queue.keys, queue.scripts, queue.settings.retention_seconds)
    call = claim_call(shard, "http-w", 8, 30_000, [("default", -1)])
    try:
        await claims._give_back("http-w", shard, call, time.monotonic() + 10)
    finally:
        await claims.stop()
    for sub in subs:
        status = await queue.status(cast(Submitted, sub).job_id)
        assert (status.state, status.version, status.attempt) == (State.QUEUED, 1, 0), status
