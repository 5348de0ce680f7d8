"""A Redis master gone silent (host down, network cut: connected, answering nothing) fails a
pipeline with a timeout (JOBTIER_REDIS_SOCKET_TIMEOUT) instead of hanging it forever. The
server is frozen with SIGSTOP, which a killed process (its connections closed) is not."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from redis.exceptions import TimeoutError as RedisTimeoutError

from jobtier.config import Settings
from jobtier.core.errors import ConfigError
from jobtier.dev.local_redis import LocalRedis
from jobtier.store.redis import connect

SOCKET_TIMEOUT = 1.1  # the least JOBTIER_SUBMIT_REPLICAS_TIMEOUT_MS=100 allows


@pytest.mark.slow  # the client retries: five timeouts in a row
async def test_a_silent_master_fails_a_pipeline_instead_of_hanging_it(tmp_path: Path) -> None:
    server = LocalRedis(tmp_path / "redis").start()
    try:
        settings = Settings.from_env(
            {},
            redis_url=server.url,
            redis_socket_timeout=SOCKET_TIMEOUT,
            submit_replicas_timeout_ms=100,
        )
        redis = connect(settings)
        try:
            # the setting, not whatever default the client library version has
            kwargs = redis.connection_pool.connection_kwargs  # type: ignore[union-attr]
            assert kwargs.get("socket_timeout") == SOCKET_TIMEOUT
            assert await redis.ping()  # a pooled connection, open before the freeze
            assert server.proc is not None
            os.kill(server.proc.pid, signal.SIGSTOP)
            try:
                pipe = redis.pipeline(transaction=False)
                pipe.set("k", "v")
                pipe.get("k")
                # the outer guard only: each attempt (the client retries) ends at the timeout
                async with asyncio.timeout(10 * 5 * SOCKET_TIMEOUT):
                    with pytest.raises(RedisTimeoutError):
                        await pipe.execute()
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
        finally:
            await redis.aclose()
    finally:
        server.stop()


def test_the_socket_timeout_outlasts_a_durable_submits_wait() -> None:
    with pytest.raises(ConfigError, match="JOBTIER_REDIS_SOCKET_TIMEOUT"):
        Settings.from_env({}, redis_socket_timeout=1.0, submit_replicas_timeout_ms=500)
    Settings.from_env({}, redis_socket_timeout=1.5, submit_replicas_timeout_ms=500)
