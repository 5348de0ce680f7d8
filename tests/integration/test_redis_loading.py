"""While a restarted Redis loads its AOF (it answers LOADING to every command), requests get a
clean 503 with Retry-After and the processes' loops log one line each — no traceback — and
everything carries on once the data is loaded. A process that starts while Redis loads, or
while it is down for a restart, waits for it instead of exiting."""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import BusyLoadingError
from redis.exceptions import ConnectionError as RedisConnectionError

from jobtier.config import Settings
from jobtier.dev.local_redis import LocalRedis, wait_port
from jobtier.engine.queue import Queue
from jobtier.persist.db import Pool
from jobtier.persist.persister import Persister
from jobtier.scheduler import Scheduler
from tests.fixtures.api import StartApi
from tests.fixtures.engine import Background, wait_for, worker_for
from tests.tasks import registry as test_registry

pytestmark = pytest.mark.slow

KEYS_TO_LOAD = 200_000
LOAD_DELAY_US = 100  # per AOF command at load: a minute of LOADING, cut short after the checks


class SlowLoadingRedis:
    """A redis-server that, restarted, takes seconds to load its AOF (``key-load-delay``, a
    setting Redis has for exactly this kind of test)."""

    def __init__(self, folder: Path) -> None:
        self.server = LocalRedis(folder)
        self.proc: subprocess.Popen[bytes] | None = None

    def restart_loading(self) -> None:
        self.server.stop(signal.SIGKILL)
        self.proc = subprocess.Popen(
            [
                shutil.which("redis-server") or "redis-server",
                "--port", str(self.server.port), "--bind", "127.0.0.1",
                "--dir", str(self.server.folder), "--appendonly", "yes",
                "--appendfsync", "everysec", "--save", "", "--maxmemory-policy", "noeviction",
                "--logfile", str(self.server.folder / "redis.log"),
                "--key-load-delay", str(LOAD_DELAY_US),
            ],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        wait_port(self.server.port, proc=self.proc)

    def restart_normally(self) -> None:
        """Stop the slow load and start at the usual speed."""
        self.stop()
        self.server.start()

    def stop(self) -> None:
        self.server.stop(signal.SIGKILL)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


@pytest.fixture
def slow_redis(tmp_path: Path) -> Iterator[SlowLoadingRedis]:
    server = SlowLoadingRedis(tmp_path / "redis")
    server.server.start()
    yield server
    server.stop()


@pytest.fixture
def settings(slow_redis: SlowLoadingRedis) -> Settings:
    """This module's tests restart their Redis: a server of their own, not the session's."""
    return Settings.from_env(
        {}, redis_url=slow_redis.server.url, shards=4, lease_seconds=5.0, api_port=0
    )


@pytest.fixture
async def redis(settings: Settings) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(settings.redis_url)
    yield client
    await client.aclose()


async def loading(redis: Any) -> bool:
    """Redis answers INFO while it loads (the first call after a restart may find the
    client's connection closed: one more try on a new one, whose set-up commands may be
    refused with LOADING)."""
    try:
        return bool((await redis.info("persistence"))["loading"])
    except BusyLoadingError:
        return True
    except RedisConnectionError:
        return await loading(redis)


async def test_while_redis_loads_requests_get_503_and_loops_log_one_line(
    settings: Settings,
    slow_redis: SlowLoadingRedis,
    redis: Any,
    pg_settings: Settings,
    pg_pool: Pool,
    start_api: StartApi,
    background: Background,
    caplog: Any,
) -> None:
    caplog.set_level(logging.INFO)
    pipe = redis.pipeline(transaction=False)
    for i in range(KEYS_TO_LOAD):  # data for the AOF to load slowly
        pipe.set(f"filler:{i}", i)
    await pipe.execute()
    api = await start_api()
    queue = await Queue.connect(settings, test_registry)
    try:
        background.start(worker_for(queue, test_registry, concurrency=4))
        background.start(Scheduler(queue.store))
        persister = Persister(pg_settings, queue.redis, pg_pool, "p1")
        background.start(persister)
        async with api.client() as client:
            first = await client.post("/v1/jobs", json={"type": "echo", "payload": {"n": 1}})
            assert first.status_code == 202, first.text
            # every part past its start-up (the worker's start-up is not what is tested here)
            await wait_for(lambda: _succeeded(queue, first.json()["id"]), timeout=60)
            await wait_for(lambda: _true(persister.stats.batches > 0), timeout=60)

            slow_redis.restart_loading()
            assert await loading(redis)
            caplog.clear()
            submit = await client.post("/v1/jobs", json={"type": "echo", "payload": {"n": 2}})
            status = await client.get(f"/v1/jobs/{first.json()['id']}")
            listing = await client.get(
                "/v1/admin/stats", headers={"authorization": "Bearer key-admin"}
            )
            assert await loading(redis), "Redis finished loading before the checks: load more"

            for reply in (submit, status, listing):
                assert reply.status_code == 503, reply.text
                assert reply.headers["retry-after"] == "2"
                assert reply.headers["content-type"] == "application/problem+json"
                assert reply.json()["type"] == "urn:jobtier:problem:unavailable"
            for reply in (submit, listing):  # (a status read may fail on its own timeout)
                assert reply.json()["detail"] == (
                    "Redis is loading its data after a restart; try again"
                )

            slow_redis.restart_normally()
            await wait_for(lambda: _loaded(redis), timeout=120, interval=0.2)
            again = await client.post("/v1/jobs", json={"type": "echo", "payload": {"n": 3}})
            assert again.status_code == 202, again.text
            job_id = again.json()["id"]
            await wait_for(lambda: _succeeded(queue, job_id), timeout=60)
    finally:
        await background.stop()
        await queue.close()

    records = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("BusyLoadingError" in r.getMessage() for r in records)
    with_traceback = [f"{r.name}: {r.getMessage()}" for r in records if r.exc_info]
    assert with_traceback == []


async def _loaded(redis: Any) -> bool:
    return not await loading(redis)


async def _true(value: bool) -> bool:
    return value


async def _succeeded(queue: Queue, job_id: str) -> bool:
    return (await queue.status(job_id)).state == "succeeded"


async def test_a_process_starting_while_redis_loads_waits_for_it(
    settings: Settings, slow_redis: SlowLoadingRedis, redis: Any, caplog: Any
) -> None:
    """Start-up (``Queue.connect``, which every process runs) waits for the data to load
    instead of exiting with "cannot reach Redis"."""
    pipe = redis.pipeline(transaction=False)
    for i in range(KEYS_TO_LOAD // 2):  # 10 s of loading at least: it ends by itself here
        pipe.set(f"filler:{i}", i)
    await pipe.execute()
    slow_redis.restart_loading()
    assert await loading(redis)
    # until the load ends, Redis says its AOF is off: start-up must not take that at its word
    assert (await redis.info("persistence"))["aof_enabled"] == 0
    connecting = asyncio.create_task(Queue.connect(settings, catalog=False))
    await wait_for(lambda: _true("event=redis_loading" in caplog.text), timeout=60)
    assert await loading(redis), "Redis finished loading before the check: load more"
    assert not connecting.done()
    queue = await asyncio.wait_for(connecting, 300)
    try:
        assert not await loading(redis)
        assert await queue.redis.get("filler:0") == b"0"
    finally:
        await queue.close()


async def test_a_process_starting_while_redis_restarts_waits_for_it(
    settings: Settings, slow_redis: SlowLoadingRedis, caplog: Any
) -> None:
    """Redis down as a process starts (a restart of both at once): start-up waits for it a
    while, one line per try, instead of exiting with "cannot reach Redis"."""
    slow_redis.stop()
    connecting = asyncio.create_task(Queue.connect(settings, catalog=False))
    await wait_for(lambda: _true("event=redis_unreachable" in caplog.text), timeout=60)
    assert not connecting.done()
    slow_redis.server.start()
    queue = await asyncio.wait_for(connecting, 60)
    await queue.close()
    assert not [r for r in caplog.records if r.exc_info]
