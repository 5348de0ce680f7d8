"""What only a Redis Cluster has: shards spread over its nodes, shard channels subscribed per
slot on each node, and the API started on a cluster. The engine's behaviour on a cluster (every
transition, the worker, the state machine, the status reader) is the ``contract`` suite's,
which runs those modules on both backends."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import redis as syncredis
from redis.asyncio import RedisCluster
from redis.crc import key_slot

from jobtier.config import Settings
from jobtier.core.model import JobSpec
from jobtier.dev.local_replicas import LocalCluster
from jobtier.engine.queue import Queue
from jobtier.store.subscriber import ShardSubscriber, node_channels
from tests.fixtures.api import StartApi
from tests.fixtures.engine import wait_for
from tests.fixtures.redis import command_calls


def test_a_started_cluster_serves_keys_on_every_node_at_once(tmp_path: Path) -> None:
    # A node turns ok on its own, two seconds after it started: one started later still
    # answers CLUSTERDOWN when the first is ok (and a pipeline does not retry that).
    cluster = LocalCluster(tmp_path, masters=3).start()
    try:
        with syncredis.Redis(port=cluster.nodes[0].port) as first:
            # [[first slot, last slot, [host, port, id]], ...]
            slots = first.execute_command("CLUSTER", "SLOTS")
        served = {int(primary[1]): (int(lo), int(hi)) for lo, hi, primary, *_ in slots}
        answers = []
        for node in cluster.nodes:
            lo, hi = served[node.port]
            key = next(f"k{i}" for i in range(100_000) if lo <= key_slot(f"k{i}".encode()) <= hi)
            with syncredis.Redis(port=node.port) as client:  # that node alone: no retries
                answers.append(client.eval("return 1", 1, key))
        assert answers == [1, 1, 1]
    finally:
        cluster.stop()


async def test_shards_really_are_spread_over_nodes(cluster_settings: Settings) -> None:
    async with await Queue.connect(cluster_settings, catalog=False) as queue:
        nodes = {queue.redis.get_node_from_key(queue.keys.log(s)).port for s in range(16)}  # type: ignore[union-attr]
        assert len(nodes) == 3


async def test_events_of_every_shard_arrive_subscribed_per_slot(
    cluster_settings: Settings,
) -> None:
    async with await Queue.connect(cluster_settings, catalog=False) as queue:
        channels = [queue.keys.events(s) for s in range(16)]
        # each node serves several of the 16 slots: one SSUBSCRIBE per slot on its connection
        assert isinstance(queue.redis, RedisCluster)
        assert all(len(group) > 1 for group in node_channels(queue.redis, channels).values())
        got: list[bytes] = []
        sub = ShardSubscriber(queue.redis, channels, lambda c, d: got.append(c))
        await sub.start()
        try:
            jobs = [await queue.submit("echo", i) for i in range(32)]
            for job in jobs:
                await queue.cancel(job.job_id)
            await wait_for(lambda: len(got) == 64)  # a submit and a cancel each
        finally:
            await sub.stop()
        assert {c.decode() for c in got} == {
            queue.keys.events(queue.keys.shard_of(j.job_id)) for j in jobs
        }


async def test_api_on_a_cluster(cluster_settings: Settings, start_api: StartApi) -> None:
    api = await start_api(redis_url=cluster_settings.redis_url, redis_cluster=True, shards=16)
    async with api.client() as c:
        jobs = [
            (await c.post("/v1/jobs", json={"type": "echo", "payload": i})).json()
            for i in range(40)
        ]
        statuses = await asyncio.gather(*(c.get(f"/v1/jobs/{j['id']}") for j in jobs))
        assert [s.json()["id"] for s in statuses] == [j["id"] for j in jobs]
        job = jobs[0]
        poll = asyncio.create_task(
            c.get(f"/v1/jobs/{job['id']}?wait=10", headers={"if-none-match": '"1"'})
        )
        await wait_for(lambda: api.reader.stats()["listeners"] == 1)  # the poll waits
        assert (await c.post(f"/v1/jobs/{job['id']}/cancel")).status_code == 200
        assert (await poll).json()["state"] == "cancelled"


async def test_fcall_is_routed_by_its_keys_without_asking_a_node(
    cluster_settings: Settings,
) -> None:
    """redis-py asks a node for the keys of FCALL (COMMAND GETKEYS, every argument sent: a
    round trip before each call); connection.Cluster routes it by its KEYS as EVALSHA is. A
    batch submit over the 16 shards and a claim make no GETKEYS on any node, and each call
    lands on the node that holds its shard."""
    async with await Queue.connect(cluster_settings, catalog=False) as queue:
        redis: Any = queue.redis
        getkeys, fcalls = (
            await command_calls(redis, "command|getkeys"),
            await command_calls(redis, "fcall"),
        )
        subs = await queue.submit_many([JobSpec(type="echo", payload=i) for i in range(200)])
        shard = queue.keys.shard_of(subs[0].job_id)
        batch = await queue.scripts.claim(shard, "w", 5, 30_000)
        assert batch.jobs  # the claim reached the shard's node (a wrong node: MOVED, retried)
        assert await command_calls(redis, "command|getkeys") == getkeys
        assert await command_calls(redis, "fcall") >= fcalls + 1 + len(
            {queue.keys.shard_of(s.job_id) for s in subs}
        )
        slot = key_slot(queue.keys.log(shard).encode())
        assert await redis._determine_slot("FCALL", "f", 1, queue.keys.log(shard), "x") == slot
