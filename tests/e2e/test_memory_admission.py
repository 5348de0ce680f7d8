"""Submits are refused with a clear 503 while Redis's memory nears ``maxmemory``, before Redis
itself refuses writes under ``noeviction`` (which would stop accepted jobs from finishing)."""

from __future__ import annotations

import logging

import pytest

from jobtier.core.model import JobSpec, Submitted
from jobtier.engine.queue import Queue
from jobtier.store.memory import redis_memory
from jobtier.store.redis import RedisClient
from tests.fixtures.api import StartApi
from tests.fixtures.engine import wait_for
from tests.fixtures.redis import on_every_server

HEADROOM = 64 * 1024 * 1024
FILLER = "jobtier-test-memory-filler"


async def test_submits_are_refused_before_redis_is_full(
    start_api: StartApi, redis: RedisClient, queue: Queue, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="jobtier.api")
    infos = await on_every_server(redis, "INFO", "memory")
    limits = [int(i["used_memory"]) + HEADROOM for i in infos]
    try:
        await on_every_server(redis, "CONFIG", "SET", "maxmemory", str(max(limits)))
        api = await start_api(redis_memory_warn_ratio=0.5, redis_memory_refuse_ratio=0.8)
        async with api.client() as http:
            ok = await http.post("/v1/jobs", json={"type": "echo", "payload": 1})
            assert ok.status_code == 202, ok.text
            # fill Redis past the refuse ratio, short of maxmemory, 1 MB at a time without
            # sending the bytes (SETRANGE allocates the string in Redis)
            fillers: list[str] = []
            while (use := await redis_memory(redis)).ratio < 0.85 and len(fillers) < 200:
                fillers.append(f"{FILLER}:{len(fillers)}")
                await redis.setrange(fillers[-1], 1024 * 1024 - 1, b"x")
            assert 0.8 < use.ratio < 1.0, use

            async def refused() -> bool:
                r = await http.post("/v1/jobs", json={"type": "echo", "payload": 2})
                return r.status_code == 503

            await wait_for(refused)  # the admission's view is refreshed once a second
            r = await http.post("/v1/jobs", json={"type": "echo", "payload": 3})
            assert r.status_code == 503
            assert r.headers["retry-after"] == "5"
            problem = r.json()
            assert problem["status"] == 503
            assert "JOBTIER_REDIS_MEMORY_REFUSE_RATIO" in problem["detail"]
            assert "Redis memory is" in problem["detail"]
            # Redis itself still takes writes: the jobs already accepted can go on
            [outcome] = await queue.submit_many([JobSpec(type="echo", payload=4)], tenant="acme")
            assert isinstance(outcome, Submitted) and outcome.created
            assert any("event=redis_memory_high" in m for m in caplog.messages)

            await redis.delete(*fillers)

            async def accepted() -> bool:
                r = await http.post("/v1/jobs", json={"type": "echo", "payload": 5})
                return r.status_code == 202

            await wait_for(accepted)
    finally:
        for key in [k async for k in redis.scan_iter(f"{FILLER}:*")]:
            await redis.delete(key)
        await on_every_server(redis, "CONFIG", "SET", "maxmemory", "0")


def test_memory_ratio_settings_are_checked() -> None:
    from jobtier.config import Settings
    from jobtier.core.errors import ConfigError

    with pytest.raises(ConfigError, match="JOBTIER_REDIS_MEMORY_REFUSE_RATIO"):
        Settings(redis_memory_refuse_ratio=1.5).validate()
