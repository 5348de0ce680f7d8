"""Claims that fail half-way: a Python worker's claim round whose reply for one shard is lost
(worker/claimer.py sends that claim again, with its token), and an HTTP worker's claim whose
later round fails (api/worker_claims.py answers what the earlier rounds took). Either way the
jobs a claim leased reach a worker rather than waiting out their lease, an attempt lost."""

from __future__ import annotations

import asyncio
import socket
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from jobtier.api.worker_claims import WorkerClaims, _Waiter
from jobtier.config import Settings
from jobtier.core.model import JobSpec, QueueLimits, State, Submitted
from jobtier.dev.local_redis import LocalRedis
from jobtier.engine.queue import Queue
from jobtier.store.calls import Call, parse_claim
from jobtier.store.scripts import Scripts
from jobtier.worker.permits import Claims, LimitedClaimer, LimitedQueues
from jobtier.worker.runner import Worker
from tests.fixtures.engine import worker_for
from tests.fixtures.lost_reply import lose_a_claims_reply_then_refuse_writes
from tests.tasks import registry


class FailingSecondRound:
    """The scripts, but the second pipelined round of claims fails (Redis went away)."""

    def __init__(self, scripts: Scripts) -> None:
        self.scripts = scripts
        self.rounds = 0

    async def call_many_each(self, calls: Sequence[Call]) -> list[Any]:
        self.rounds += 1
        if self.rounds == 2:
            raise RedisConnectionError("Connection closed by server.")
        return await self.scripts.call_many_each(calls)


class OneShardDown:
    """The scripts, but the calls of one shard fail (its cluster node is failing over) while
    the others run: ``call_many_each`` answers that shard's calls with their error,
    ``call_many`` (like ``run_scripts``) raises it after the others ran."""

    def __init__(self, scripts: Scripts, down: int) -> None:
        self.scripts = scripts
        self.down = down

    async def call_many_each(self, calls: Sequence[Call]) -> list[Any]:
        up = [call for call in calls if call[1] != self.down]
        replies = iter(await self.scripts.call_many_each(up))
        error = RedisConnectionError("Connection closed by server.")
        return [error if call[1] == self.down else next(replies) for call in calls]

    async def call_many(self, calls: Sequence[Call]) -> list[Any]:
        replies = await self.call_many_each(calls)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies


class OneShardAtATime(WorkerClaims):
    """Rounds of one job of one shard each, so that a claim of 2 takes two rounds."""

    shard = 0

    def _plan(self, w: _Waiter, want: int) -> list[tuple[int, int]]:
        return [(self.shard, 1)]


async def test_jobs_an_earlier_round_leased_are_answered_when_a_later_round_fails(
    queue: Queue,
) -> None:
    subs = await queue.submit_many([JobSpec(type="echo", payload=i) for i in range(5)])
    # five jobs over four shards: one shard holds two
    shard, n = Counter(queue.keys.shard_of(s.job_id) for s in subs).most_common(1)[0]
    assert n >= 2
    scripts = FailingSecondRound(queue.scripts)
    claims = OneShardAtATime(
        queue.redis, queue.keys, cast(Scripts, scripts), queue.settings.retention_seconds
    )
    claims.shard = shard
    try:
        got, _ = await claims.claim("http-w", (), ["default"], 2, 30_000, 0.0, _never_gone)
    finally:
        await claims.stop()  # (its failed round, handed back, is not sent again)
    assert scripts.rounds == 2  # the second round was tried, and failed
    assert len(got) == 1
    status = await queue.status(got[0].job.id)
    assert status.state is State.RUNNING and status.worker == "http-w"


async def test_a_claim_answers_the_healthy_shards_jobs_when_one_shard_fails(
    queue: Queue,
) -> None:
    """One node failing over fails its shards' claims; the jobs the others leased in the same
    round are the worker's, not thrown away to wait out their lease."""
    subs = await queue.submit_many([JobSpec(type="echo", payload=i) for i in range(12)])
    shard_of = {s.job_id: queue.keys.shard_of(s.job_id) for s in subs}
    down = shard_of[subs[0].job_id]
    healthy = {job for job, shard in shard_of.items() if shard != down}
    assert healthy
    scripts = OneShardDown(queue.scripts, down)
    claims = WorkerClaims(
        queue.redis, queue.keys, cast(Scripts, scripts), queue.settings.retention_seconds
    )
    try:
        got, _ = await claims.claim("http-w", (), ["default"], len(subs), 30_000, 0.0, _never_gone)
    finally:
        await claims.stop()  # (the failed shard's claim, handed back, is not sent again)
    assert {c.job.id for c in got} == healthy
    for c in got:
        status = await queue.status(c.job.id)
        assert status.state is State.RUNNING and status.worker == "http-w"
    for job in set(shard_of) - healthy:  # the failed shard's jobs were not leased
        assert (await queue.status(job)).state is State.QUEUED


async def _never_gone() -> bool:
    return False


async def test_a_worker_sends_again_the_claim_of_a_shard_whose_reply_was_lost(
    queue: Queue,
) -> None:
    """A round's claims ran, one shard's reply was lost (its node went away): the worker
    starts the others' jobs and, at a later round, sends that shard's claim again as it was
    (its token), which answers the jobs it leased."""
    subs = await queue.submit_many([JobSpec(type="echo", payload=i) for i in range(20)])
    worker = worker_for(queue, registry, burst=True, concurrency=50)
    scripts = worker.state.scripts
    call_many_each = scripts.call_many_each
    rounds: list[list[Call]] = []
    lost: list[Call] = []

    async def lose_one_reply(calls: Sequence[Call]) -> list[Any]:
        rounds.append(list(calls))
        replies: list[Any] = await call_many_each(calls)
        if not lost:
            for i, (call, reply) in enumerate(zip(calls, replies, strict=True)):
                if parse_claim(call[1], reply).jobs:  # it leased jobs: its reply is lost
                    lost.append(call)
                    replies[i] = RedisConnectionError("Connection closed by server.")
                    break
        return replies

    scripts.call_many_each = lose_one_reply  # type: ignore[method-assign]
    stats = await worker.run()  # no scheduler: a job leased to nobody would never end
    assert stats.succeeded == 20 and lost
    assert any(lost[0] in calls for calls in rounds[1:])  # the same call, token and all
    await succeeded_at_first_attempt(queue, subs)


async def test_an_acquire_sent_again_answers_the_permits_it_granted_not_more(
    queue: Queue,
) -> None:
    """limit.lua answers an acquire's token it already served with the permits it granted
    then, those still held, rather than granting more (the client library resends a call
    whose connection died before its reply)."""
    await queue.admin.set_limits("default", QueueLimits(concurrency=3))
    home = queue.keys.home("default")

    async def acquire(wanted: int, token: str) -> list[bytes]:
        args = ("acquire", "default", "w", wanted, 60_000, token)
        reply = await queue.scripts.call("limit", home, args)
        assert int(reply[0]) == len(reply) - 2
        return list(reply[2:])

    first = await acquire(2, "t1")
    assert len(first) == 2
    assert await acquire(2, "t1") == first  # the same permits, none more
    assert await queue.admin.running_permits("default") == 2
    assert len(await acquire(3, "t2")) == 1  # the limit's last one
    await queue.scripts.call("limit", home, ("release", "default", "1", first[0]))
    assert await acquire(2, "t1") == first[1:]  # only those still held
    assert await queue.admin.running_permits("default") == 2


async def test_a_worker_sends_again_an_acquire_whose_reply_was_lost(queue: Queue) -> None:
    """A limited queue's acquire ran, its reply was lost: the worker's next round sends it
    again with its token and uses the permits it granted, which otherwise would hold the
    queue's capacity, unused, until their lease ran out."""
    await queue.admin.set_limits("default", QueueLimits(concurrency=2))
    subs = await queue.submit_many([JobSpec(type="echo", payload=i) for i in range(10)])
    worker = worker_for(queue, registry, burst=True, concurrency=4)
    scripts = worker.state.scripts
    call = scripts.call
    acquires: list[tuple[tuple[Any, ...], list[bytes]]] = []
    lost: list[bytes] = []

    async def lose_a_granting_reply(script: Any, shard: int, args: Sequence[Any]) -> Any:
        reply = await call(script, shard, args)
        if script == "limit" and args[0] == "acquire":
            acquires.append((tuple(args), list(reply[2:])))
            if not lost and int(reply[0]) > 0:
                lost.extend(reply[2:])
                raise RedisConnectionError("Connection closed by server.")
        return reply

    scripts.call = lose_a_granting_reply  # type: ignore[method-assign]
    stats = await worker.run()
    assert stats.succeeded == 10 and lost
    at = next(i for i, (_, granted) in enumerate(acquires) if granted == lost)
    (sent, _), (resent, granted) = acquires[at], acquires[at + 1]
    assert resent[5] == sent[5]  # the same token
    assert set(granted) <= set(lost) and granted  # the permits of the lost reply, used
    assert await queue.admin.running_permits("default") == 0  # every permit came back
    await succeeded_at_first_attempt(queue, subs)


async def test_an_acquire_whose_permits_all_lapsed_is_answered_afresh(queue: Queue) -> None:
    """Sent again once every permit it granted has lapsed (its worker never had them), an
    acquire is answered as a new one, not with nothing."""
    await queue.admin.set_limits("default", QueueLimits(concurrency=3))
    home = queue.keys.home("default")
    args = ("acquire", "default", "w", 2, 60_000, "t1")
    first = await queue.scripts.call("limit", home, args)
    lapsed = dict.fromkeys(first[2:], 1)  # their lease ended long ago
    await queue.redis.zadd(queue.keys.permits("default"), lapsed)
    again = await queue.scripts.call("limit", home, args)
    assert int(again[0]) == 2 and set(again[2:]).isdisjoint(first[2:])
    assert await queue.admin.running_permits("default") == 2
    assert await queue.scripts.call("limit", home, args) == again  # kept under the token


async def test_a_resent_acquire_answers_its_round_when_its_extra_permits_cannot_go_back(
    queue: Queue, caplog: pytest.LogCaptureFixture
) -> None:
    """A resent acquire answers more permits than its round wants (fewer jobs are ready by
    then); if giving back the extra ones fails too, the round still gets the ones it wants,
    and the rest lapse with their lease."""
    await queue.admin.set_limits("default", QueueLimits(concurrency=4))
    worker = worker_for(queue, registry)
    call = queue.scripts.call
    sent: list[Sequence[Any]] = []

    class Flaky:
        async def call(self, script: Any, shard: int, args: Sequence[Any]) -> Any:
            sent.append(args)
            if args[0] == "release":
                raise RedisConnectionError("Connection closed by server.")
            reply = await call(script, shard, args)
            if len(sent) == 1:  # the first acquire ran, its reply is lost
                raise RedisConnectionError("Connection closed by server.")
            return reply

    worker.state.scripts = cast(Scripts, Flaky())
    limits = LimitedQueues(worker.state)
    claimer = LimitedClaimer(limits, cast(Claims, None), "default")
    with pytest.raises(RedisConnectionError):
        await claimer._acquire(3)
    got = await claimer._acquire(1)
    assert [args[0] for args in sent] == ["acquire", "acquire", "release"]
    assert sent[0][5] == sent[1][5]  # the same token
    assert len(got.ids) == 1 and claimer._unanswered is None
    assert await queue.admin.running_permits("default") == 3  # the other two lapse later
    assert "event=permits_not_released" in caplog.text


class ClaimReplyLost:
    """The scripts, but one shard's claim replies are lost in the pipelined round (its node
    went away after running them); a call of its own, sent again, is answered. ``down``:
    its node was down before the round, which none of its calls reached."""

    def __init__(self, scripts: Scripts, shard: int, down: bool) -> None:
        self.scripts = scripts
        self.shard = shard
        self.down = down
        self.resent: list[Call] = []

    async def call_many_each(self, calls: Sequence[Call]) -> list[Any]:
        run = [call for call in calls if not (self.down and call[1] == self.shard)]
        sent = await self.scripts.call_many_each(run)
        replies = dict(zip(map(id, run), sent, strict=True))
        error = RedisConnectionError("Connection closed by server.")
        return [error if call[1] == self.shard else replies[id(call)] for call in calls]

    async def call(self, script: str, shard: int, args: Sequence[Any]) -> Any:
        if script == "claim":
            self.resent.append((script, shard, args))
            if self.down:
                raise RedisConnectionError("Connection refused.")
        return await self.scripts.call(script, shard, args)


@pytest.mark.parametrize("down", [False, True], ids=["reply-lost", "node-down"])
async def test_a_limited_claim_takes_each_shards_reply_on_its_own(queue: Queue, down: bool) -> None:
    """A limited queue's claim round over several shards, one of whose replies is lost: the
    others' jobs start, and that shard's claim is sent again as it was (its token), which
    answers the jobs it leased; if its node stays down, its jobs are not leased and its
    permits go unused. (The round used to fail whole, the jobs the others leased waiting
    out their lease, an attempt lost.)"""
    await queue.admin.set_limits("default", QueueLimits(concurrency=20))
    subs = await queue.submit_many([JobSpec(type="echo", payload=i) for i in range(12)])
    by_shard = Counter(queue.keys.shard_of(s.job_id) for s in subs)
    assert len(by_shard) >= 2
    lost = next(iter(by_shard))
    worker = worker_for(queue, registry)
    claimer = worker.claimer
    scripts = ClaimReplyLost(queue.scripts, lost, down)
    claimer._scripts = cast(Scripts, scripts)
    started: list[str] = []
    claimer._start = lambda job, shard, now_ms, permit=None: started.append(job.id)
    home = queue.keys.home("default")
    acquired = await queue.scripts.call(
        "limit", home, ("acquire", "default", worker.id, 12, 30_000)
    )
    permits = [p.decode() for p in acquired[2:]]
    used, failed = await claimer.claim_limited("default", sorted(by_shard.items()), permits)
    assert [call[1] for call in scripts.resent] == [lost]
    healthy = {s.job_id for s in subs if queue.keys.shard_of(s.job_id) != lost}
    expected = healthy if down else {s.job_id for s in subs}
    assert set(started) == expected and len(used) == len(expected)
    assert [permit for permit, _ in used] == permits[: len(expected)]
    # a claim that failed twice is the loop's to send again (permits.py)
    assert [(c.shard, c.cap, c.call) for c in failed] == (
        [(lost, by_shard[lost], scripts.resent[0])] if down else []
    )
    for sub in subs:
        state = (await queue.status(sub.job_id)).state
        assert state is (State.RUNNING if sub.job_id in expected else State.QUEUED)


async def test_a_limited_claim_whose_reply_is_lost_twice_is_sent_again_at_the_next_round(
    queue: Queue,
) -> None:
    """A limited queue's claim ran and leased jobs, but its reply was lost, and so was the
    reply of the same call sent again at once: the loop keeps as many permits as it asked
    for, and its next round sends it again as it was (its token), which answers the jobs it
    leased. (They used to wait out their lease, an attempt lost, while its permits went
    back.)"""
    await queue.admin.set_limits("default", QueueLimits(concurrency=4))
    subs = await queue.submit_many([JobSpec(type="echo", payload=i) for i in range(10)])
    worker = worker_for(queue, registry, burst=True, concurrency=4)
    scripts = worker.state.scripts
    call_many_each, call = scripts.call_many_each, scripts.call
    rounds: list[list[Call]] = []
    lost: list[Call] = []
    error = RedisConnectionError("Connection closed by server.")

    async def lose_a_claims_replies(calls: Sequence[Call]) -> list[Any]:
        claims = [c for c in calls if c[0] == "claim" and "default" in c[2]]  # the limited's
        if claims:
            rounds.append(claims)
        replies: list[Any] = await call_many_each(calls)
        if not lost:
            for i, (c, reply) in enumerate(zip(calls, replies, strict=True)):
                if c in claims and parse_claim(c[1], reply).jobs:  # it leased jobs
                    lost.append(c)
                    replies[i] = error
                    break
        return replies

    granted: list[bytes] = []  # by the first acquire that granted permits
    settled: list[Sequence[Any]] = []  # settle and release arguments

    async def lose_the_resend_too(script: Any, shard: int, args: Sequence[Any]) -> Any:
        reply = await call(script, shard, args)
        if lost and (script, shard, args) == lost[0] and len(rounds) == 1:
            raise error
        if script == "limit" and args[0] == "acquire" and not granted:
            granted.extend(reply[2:])
        if script == "limit" and args[0] in ("settle", "release"):
            settled.append(args)
        return reply

    scripts.call_many_each = lose_a_claims_replies  # type: ignore[method-assign]
    scripts.call = lose_the_resend_too  # type: ignore[method-assign]
    async with asyncio.timeout(60):  # no scheduler: a job leased to nobody would never end
        stats = await worker.run()
    assert stats.succeeded == 10 and lost
    assert sum(lost[0] in r for r in rounds) == 2  # a later round sent it, token and all
    # the lost claim's permits were kept for it, not given back and taken again: every one
    # the first acquire granted started a job
    used = {a[3 + 2 * i] for a in settled if a[0] == "settle" for i in range(int(a[2]))}
    assert granted and {p.decode() for p in granted} <= used
    assert await queue.admin.running_permits("default") == 0  # every permit came back
    await succeeded_at_first_attempt(queue, subs)


async def test_a_shard_refusing_a_limited_queues_claims_does_not_take_every_permit(
    queue: Queue,
) -> None:
    """A shard that answers reads but refuses writes (out of memory, a failing disk) and
    holds the most jobs: the loop plans it after the others for a while, and their jobs run.
    (With one permit, the fullest shard took it at every round, and nothing ran.)"""
    await queue.admin.set_limits("default", QueueLimits(concurrency=1))
    subs = await queue.submit_many([JobSpec(type="echo", payload=i) for i in range(12)])
    by_shard = Counter(queue.keys.shard_of(s.job_id) for s in subs)
    assert len(by_shard) >= 2
    # the fullest, the first of them in shard order (the loop's plan sorts stably)
    refusing = max(sorted(by_shard), key=lambda shard: by_shard[shard])
    worker = worker_for(queue, registry, concurrency=2)
    refused = refuse_claims(worker, lambda c: c[1] == refusing)
    healthy = [s.job_id for s in subs if queue.keys.shard_of(s.job_id) != refusing]
    await run_until_succeeded(worker, queue, healthy)
    assert refused  # the refusing shard was asked, and refused
    for sub in subs:
        if sub.job_id not in healthy:
            assert (await queue.status(sub.job_id)).state is State.QUEUED
    assert await queue.admin.running_permits("default") == 0


async def test_the_main_loops_failed_claims_leave_the_slots_to_a_limited_queue(
    queue: Queue,
) -> None:
    """A worker serving a limited queue and another one, whose claims Redis keeps refusing:
    the main loop backs off, and the limited queue's jobs run meanwhile. (The main loop held
    every free slot through its back-off, and a limited loop that found none slept until a
    job ended: with none running, for good.)"""
    await queue.admin.set_limits("default", QueueLimits(concurrency=2))
    subs = await queue.submit_many([JobSpec(type="echo", payload=i) for i in range(8)])
    worker = worker_for(queue, registry, queues=["default", "images"], concurrency=2)
    refused = refuse_claims(worker, lambda c: "images" in c[2])  # the unlimited queue's
    await run_until_succeeded(worker, queue, [sub.job_id for sub in subs])
    assert refused  # the main loop's claims were refused
    assert await queue.admin.running_permits("default") == 0


async def test_a_claim_whose_reply_was_lost_is_not_sent_again_by_the_client_library(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A single server's claim pipeline ran, its reply was lost with the connection, and the
    server answers READONLY meanwhile (a master demoted in a failover behind one address).
    Had the client library sent the claim again itself, its READONLY reply would say "not
    run" and the jobs the first send leased would wait out their lease; sent once, the worker
    sees the lost connection, keeps the claim and sends it again (its token) at its next
    rounds, which answer those jobs once the server takes writes again."""
    server = LocalRedis(tmp_path / "redis").start()
    # the master the server is made a replica of: a port bound, not listening (refused)
    nobody = socket.socket()
    try:
        nobody.bind(("127.0.0.1", 0))
        # a lease long enough that the kept claim outlives the READONLY spell however slow
        # the machine (it is kept for half a lease)
        s = settings.replace(redis_url=server.url, lease_seconds=60.0)
        queue = await Queue.connect(s, catalog=False)
        try:
            await _lose_a_claims_reply_then_refuse_writes(
                queue, server, nobody.getsockname()[1], monkeypatch
            )
        finally:
            await queue.close()
    finally:
        nobody.close()
        server.stop()


async def _lose_a_claims_reply_then_refuse_writes(
    queue: Queue, server: LocalRedis, nobody: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    subs = await queue.submit_many([JobSpec(type="echo", payload=i) for i in range(20)])
    trips = lose_a_claims_reply_then_refuse_writes(queue, server, nobody, monkeypatch)
    admin = server.client()
    worker = worker_for(queue, registry, concurrency=50)
    running = asyncio.create_task(worker.run())
    try:
        async with asyncio.timeout(60):  # no scheduler: a job leased to nobody never ends
            while "readonly" not in trips:  # a claim sent again met the demoted server
                await asyncio.wait({running}, timeout=0.02)
                assert not running.done(), running
            admin.replicaof("no", "one")  # writes taken again
            for sub in subs:
                assert isinstance(sub, Submitted), sub
                while (await queue.status(sub.job_id)).state is not State.SUCCEEDED:
                    await asyncio.wait({running}, timeout=0.05)
                    assert not running.done(), running
    finally:
        admin.replicaof("no", "one")
        admin.close()
        worker.stop()
        await running
    assert trips[0] == "lost"
    await succeeded_at_first_attempt(queue, subs)


async def succeeded_at_first_attempt(queue: Queue, subs: Sequence[Submitted | Exception]) -> None:
    for sub in subs:
        assert isinstance(sub, Submitted), sub
        status = await queue.status(sub.job_id)
        assert (status.state, status.attempt) == (State.SUCCEEDED, 1), status


def refuse_claims(worker: Worker, which: Callable[[Call], bool]) -> list[Call]:
    """The worker's scripts answer its claims that ``which`` picks with an error reply, as a
    Redis out of memory does (not run), in a pipeline or alone; returns those refused, as
    they come."""
    scripts = worker.state.scripts
    call_many_each, call = scripts.call_many_each, scripts.call
    refused: list[Call] = []
    oom = ResponseError("OOM command not allowed when used memory > 'maxmemory'.")

    def refusing(c: Call) -> bool:
        return c[0] == "claim" and which(c)

    async def refuse(calls: Sequence[Call]) -> list[Any]:
        replies = iter(await call_many_each([c for c in calls if not refusing(c)]))
        refused.extend(c for c in calls if refusing(c))
        return [oom if refusing(c) else next(replies) for c in calls]

    async def refuse_one(script: Any, shard: int, args: Sequence[Any]) -> Any:
        if refusing((script, shard, args)):
            refused.append((script, shard, args))
            raise oom
        return await call(script, shard, args)

    scripts.call_many_each = refuse  # type: ignore[method-assign]
    scripts.call = refuse_one  # type: ignore[method-assign]
    return refused


async def run_until_succeeded(worker: Worker, queue: Queue, jobs: Sequence[str]) -> None:
    """Run the worker until every one of ``jobs`` succeeded (60 s at most), then stop it."""
    running = asyncio.create_task(worker.run())
    try:
        async with asyncio.timeout(60):
            for job in jobs:
                while (await queue.status(job)).state is not State.SUCCEEDED:
                    await asyncio.wait({running}, timeout=0.05)
                    assert not running.done(), running
    finally:
        worker.stop()
        await running
