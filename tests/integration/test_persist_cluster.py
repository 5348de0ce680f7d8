"""The persister on a Redis Cluster: shards spread over nodes, per-shard commands pipelined."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import cast

import pytest
from redis.asyncio import RedisCluster
from redis.asyncio.cluster import ClusterNode

from jobtier.config import Settings
from jobtier.core.keys import Keys
from jobtier.dev.local_replicas import LocalCluster
from jobtier.persist.db import Pool
from jobtier.persist.persister import Persister
from jobtier.store.redis import connect
from jobtier.streams.group import lag, oldest_waiting, shared_lag
from tests.fixtures.postgres import assert_pg_matches_redis, mixed_workload
from tests.fixtures.redis import as_jobtier, flushall

pytestmark = pytest.mark.slow


@pytest.fixture
async def cluster_client(redis_cluster: LocalCluster) -> AsyncIterator[RedisCluster]:
    """jobtier's client of the session's cluster (as its user), emptied first."""
    flushall(redis_cluster.nodes)
    settings = Settings.from_env(
        {}, redis_url=as_jobtier(redis_cluster.url), redis_cluster=True, shards=8
    )
    client = connect(settings)
    assert isinstance(client, RedisCluster)
    await client.initialize()  # learns the slots: get_node_from_key answers from them
    yield client
    await client.aclose()


async def test_persister_on_a_cluster(
    cluster_client: RedisCluster, pg_pool: Pool, pg_dsn: str, redis_cluster: LocalCluster
) -> None:
    keys = Keys("jt", 8)
    nodes = {
        cast(ClusterNode, cluster_client.get_node_from_key(keys.log(s))).port for s in range(8)
    }
    assert len(nodes) > 1  # the shards really are spread over nodes

    job_ids = await mixed_workload(cluster_client, keys, n=100)
    settings = Settings.from_env(
        {}, redis_url=as_jobtier(redis_cluster.url), redis_cluster=True, shards=8, database_url=pg_dsn,
        persist_batch_size=50,
    )  # fmt: skip
    persister = Persister(settings, cluster_client, pg_pool, "p1")
    assert await persister.drain() > 0
    await assert_pg_matches_redis(cluster_client, pg_pool, keys, job_ids)
    assert await lag(cluster_client, keys) == (0, 0.0)
    # the age alone, and the count the API processes share (a key of its own slot)
    assert await oldest_waiting(cluster_client, keys) == (False, 0.0)
    assert (await shared_lag(cluster_client, keys))[:2] == (0, 0.0)
    assert (await shared_lag(cluster_client, keys))[:2] == (0, 0.0)  # read, not counted
