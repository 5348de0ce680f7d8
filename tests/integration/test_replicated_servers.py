"""The replicated test servers, and jobtier's clients of them: the cluster's replicas take
over a killed master, the sentinels promote the replica of theirs, and a client made by
``connect`` follows the sentinels to the promoted master."""

from __future__ import annotations

import redis as syncredis
from redis.asyncio.sentinel import MasterNotFoundError

from jobtier.config import Settings
from jobtier.dev.local_replicas import LocalCluster, LocalSentinels
from jobtier.store.redis import connect, master_address
from tests.fixtures.engine import wait_for


def test_the_cluster_has_a_replica_per_master(redis_cluster: LocalCluster) -> None:
    masters = redis_cluster.masters()
    assert len(masters) == 3
    assert all(len(redis_cluster.replicas_of(m)) == 1 for m in masters)


def test_a_killed_master_is_replaced_by_its_replica(failover_cluster: LocalCluster) -> None:
    victim = failover_cluster.masters()[0]
    (replica,) = failover_cluster.replicas_of(victim)
    failover_cluster.kill(victim)
    assert failover_cluster.wait_promoted(victim) is replica
    failover_cluster.revive(victim)
    assert failover_cluster.replicas_of(replica) == [victim]


async def test_a_sentinel_client_follows_the_promoted_master(
    sentinels: LocalSentinels, sentinel_settings: Settings
) -> None:
    redis = connect(sentinel_settings)
    try:
        first = sentinels.master()
        assert await master_address(redis) == ("127.0.0.1", first.port)
        await redis.set("jt:before", "1")  # jobtier's user has its keys only
        # the write reached the replica before the kill: WAIT says so
        assert await redis.execute_command("WAIT", 1, 5000) == 1
        sentinels.kill(first)
        promoted = sentinels.wait_promoted(first)
        assert promoted is not first

        async def names_the_promoted() -> bool:  # each sentinel learns of it in its turn
            try:
                return await master_address(redis) == ("127.0.0.1", promoted.port)
            except MasterNotFoundError:
                return False

        await wait_for(names_the_promoted, timeout=30)
        # the pool's connections to the dead master are retried against the promoted one
        for _ in range(50):
            try:
                await redis.set("jt:after", "2")
                break
            except (syncredis.ConnectionError, syncredis.TimeoutError):
                continue
        assert await redis.get("jt:before") == b"1"
        assert await redis.get("jt:after") == b"2"
    finally:
        await redis.aclose()
