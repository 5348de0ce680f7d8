"""An HTTP worker's claim whose reply was lost (api/worker_claims.py): the API sends it again
itself, with its token, so that the jobs its first send leased reach the worker instead of
waiting out their lease, an attempt lost; the client library does not send it again."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from pathlib import Path
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError

from jobtier.api.worker_claims import Claimed, WorkerClaims
from jobtier.config import Settings
from jobtier.core.model import JobSpec, State, Submitted
from jobtier.dev.local_redis import LocalRedis
from jobtier.engine.queue import Queue
from jobtier.store.redis import FastConnection


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
        queue = await Queue.connect(settings.replace(redis_url=server.url, lease_seconds=60.0))
        try:
            subs = await queue.submit_many([JobSpec(type="echo", payload=i) for i in range(20)])
            trips = _lose_a_claims_reply_then_refuse_writes(
                queue, server, nobody.getsockname()[1], monkeypatch
            )
            claims = WorkerClaims(queue.redis, queue.keys, queue.scripts)
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
            return await claim
    finally:
        admin.replicaof("no", "one")
        admin.close()
        claim.cancel()
        with contextlib.suppress(BaseException):  # (its failure is the assertion's)
            await claim


def _lose_a_claims_reply_then_refuse_writes(
    queue: Queue, server: LocalRedis, nobody: int, monkeypatch: pytest.MonkeyPatch
) -> list[str]:
    """The first claim pipeline's reply is lost with its connection, and the server is made
    a replica of ``nobody`` (writes refused: READONLY) as it goes. Returns the trips made:
    "lost", then each "readonly" a claim met."""
    claim = queue.scripts.by_name["claim"].command()[1].encode()
    admin = server.client()
    claiming: set[int] = set()  # connections whose last send held a claim
    lose: list[int] = []  # the connection whose claims' replies are to be lost
    trips: list[str] = []
    send, read = FastConnection.send_packed_command, FastConnection.read_response

    async def sending(self: FastConnection, command: Any, *args: Any, **kwargs: Any) -> None:
        data = command if isinstance(command, bytes | str) else b"".join(command)
        if claim in (data.encode() if isinstance(data, str) else data):
            claiming.add(id(self))
            if not trips:
                lose.append(id(self))
        else:
            claiming.discard(id(self))
        await send(self, command, *args, **kwargs)

    async def reading(self: FastConnection, *args: Any, **kwargs: Any) -> Any:
        try:
            reply = await read(self, *args, **kwargs)
        except ReadOnlyError:
            if id(self) in claiming:
                trips.append("readonly")
            raise
        if id(self) in lose:  # the claims ran; their replies go with the connection
            lose.clear()
            trips.append("lost")
            admin.replicaof("127.0.0.1", nobody)  # writes refused: READONLY
            admin.close()
            await self.disconnect()
            raise RedisConnectionError("Connection closed by server.")
        return reply

    monkeypatch.setattr(FastConnection, "send_packed_command", sending)
    monkeypatch.setattr(FastConnection, "read_response", reading)
    return trips
