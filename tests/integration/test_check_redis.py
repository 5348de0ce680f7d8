"""The start-up check of Redis (``check_redis``) against real servers: a Redis still loading
its AOF after a restart is waited for, not mistaken for one without AOF; a Redis without AOF
is refused with a message that says how to turn it on."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import redis as syncredis
from redis.asyncio import Redis, RedisCluster

from jobtier.config import Settings
from jobtier.core.errors import ConfigError
from jobtier.dev.local_redis import LOCAL_CONF, LocalRedis
from jobtier.dev.local_replicas import LocalCluster
from jobtier.store.fitness import check_redis
from jobtier.store.redis import connect
from tests.e2e.jobtier_run import wait_until

KEYS = 20_000


def big_aof(server: LocalRedis) -> None:
    """KEYS keys in the AOF's base file (loaded key by key at the next start)."""
    client = syncredis.Redis(port=server.port)
    pipe = client.pipeline(transaction=False)
    for i in range(KEYS // 1000):
        pipe.mset({f"bulk:{i}:{j}": "x" * 40 for j in range(1000)})
    pipe.execute()
    client.bgrewriteaof()
    wait_until(
        lambda: (
            not any(
                int(client.info("persistence")[f])
                for f in ("aof_rewrite_in_progress", "aof_rewrite_scheduled")
            )
        ),
        "the AOF rewrite",
    )
    client.close()


async def test_a_loading_redis_is_waited_for(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = LocalRedis(tmp_path / "redis").start()
    try:
        big_aof(server)
        server.stop()
        # a delay per key loaded makes the load last, whatever the machine; the server
        # answers INFO during it every KB loaded
        (server.folder / LOCAL_CONF).write_text(
            "key-load-delay 50\nloading-process-events-interval-bytes 1024\n"
        )
        server.start(loaded=False)
        settings = Settings.from_env({}, redis_url=server.url)
        client = Redis.from_url(server.url)
        try:
            # what the old check saw at this point: AOF off, as Redis reports while loading
            assert (await client.info("persistence"))["aof_enabled"] == 0
            with caplog.at_level(logging.INFO, logger="jobtier.redis"):
                assert await check_redis(client, settings, log_every=0.5) == []
            assert "event=redis_loading" in caplog.text
            assert await client.dbsize() == KEYS  # loaded, and answering commands
        finally:
            await client.aclose()
    finally:
        server.stop()


async def test_a_redis_without_aof_is_refused_with_the_way_to_fix_it(tmp_path: Path) -> None:
    server = LocalRedis(tmp_path / "redis").start()
    client = Redis.from_url(server.url)
    try:
        await client.config_set("appendonly", "no")
        settings = Settings.from_env({}, redis_url=server.url)
        with pytest.raises(ConfigError) as refused:
            await check_redis(client, settings)
        message = str(refused.value)
        assert "appendonly is off" in message and "appendonly yes" in message
        # the way out that gives up durability comes last, for throwaway setups only
        fix, last_resort = message.split("Only for a throwaway setup")
        assert "JOBTIER_REDIS_REQUIRE_AOF" not in fix
        assert "JOBTIER_REDIS_REQUIRE_AOF=0" in last_resort
        # accepted, with a warning, when the operator has said so
        lax = settings.replace(redis_require_aof=False)
        (warning,) = await check_redis(client, lax)
        assert "appendonly is off" in warning
    finally:
        await client.aclose()
        server.stop()


async def test_a_cluster_of_one_master_is_checked(tmp_path: Path) -> None:
    """One node serving every slot: redis-py answers INFO of the primaries with that node's
    fields, not keyed by node name; the check reads both shapes (it used to fail here, so no
    process started against such a cluster)."""
    server = LocalRedis(tmp_path / "node", cluster=True).start()
    client = None
    try:
        with syncredis.Redis(port=server.port) as admin:
            admin.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
            wait_until(
                lambda: b"cluster_state:ok" in admin.execute_command("CLUSTER", "INFO"),
                "the one-node cluster",
            )
        settings = Settings.from_env({}, redis_url=server.url, redis_cluster=True)
        client = connect(settings)
        assert await check_redis(client, settings) == []
        with syncredis.Redis(port=server.port) as admin:
            admin.config_set("appendonly", "no")
        with pytest.raises(ConfigError, match="appendonly is off"):
            await check_redis(client, settings)
    finally:
        if client is not None:
            await client.aclose()
        server.stop()


async def test_a_cluster_requiring_full_coverage_is_warned_of(tmp_path: Path) -> None:
    """With cluster-require-full-coverage yes (Redis's default) a failover stops every node,
    not only the lost master's slots: the start-up check says so, and how to change it."""
    cluster = LocalCluster(tmp_path / "cluster", masters=3).start()
    client = RedisCluster.from_url(cluster.url)
    try:
        await client.initialize()
        settings = Settings.from_env({}, redis_url=cluster.url, redis_cluster=True)
        (warning,) = await check_redis(client, settings)
        assert "cluster-require-full-coverage is yes" in warning
        await client.config_set(
            "cluster-require-full-coverage", "no", target_nodes=RedisCluster.PRIMARIES
        )
        assert await check_redis(client, settings) == []
    finally:
        await client.aclose()
        cluster.stop()
