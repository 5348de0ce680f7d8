"""Resharding under read load: a slot holding jobs migrates to another node (the procedure of
``redis-cli --cluster reshard``: SETSLOT IMPORTING / MIGRATING, MIGRATE of its keys, SETSLOT
NODE on every node) while a StatusReader with its near cache reads those jobs without pause;
then a job of that slot changes on its new node.

The reader must never answer an older document than one it has already answered, and must
serve the change: its subscription, told SUNSUBSCRIBE by the slot's old node, subscribes on
the new node and empties the near cache (ShardSubscriber._run, StatusReader.on_reset). The
near cache's TTL is set far past the test's length, so only the events (and the resets) keep
it fresh: a reader that missed the move would serve the old document for good."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot

from jobtier.config import Settings
from jobtier.core.model import JobSpec
from jobtier.dev.local_redis import LocalRedis
from jobtier.dev.local_replicas import LocalCluster
from jobtier.engine.queue import Queue
from jobtier.status.reader import StatusReader
from jobtier.store.faults import failing_over
from jobtier.store.subscriber import ShardSubscriber
from tests.fixtures.engine import wait_for

TENANT = "acme"
JOBS = 64


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    """Three masters of our own (redis-cli makes no smaller cluster): the session cluster is shared, and its slots must stay put."""
    nodes = LocalCluster(tmp_path / "cluster", masters=3)
    nodes.start()
    try:
        yield nodes
    finally:
        nodes.stop()


@pytest.fixture
async def queue(cluster: LocalCluster) -> AsyncIterator[Queue]:
    settings = Settings.from_env(
        {}, redis_url=cluster.url, redis_cluster=True, shards=16, lease_seconds=5.0
    )
    q = await Queue.connect(settings, catalog=False)
    try:
        yield q
    finally:
        await q.close()


async def command(client: aioredis.Redis, *args: Any) -> Any:
    return await client.execute_command(*args)  # type: ignore[no-untyped-call]


async def node_id(node: LocalRedis) -> str:
    async with aioredis.Redis(port=node.port) as r:
        return str((await command(r, "CLUSTER", "MYID")).decode())


async def migrate_slot(
    cluster: LocalCluster,
    slot: int,
    target: LocalRedis,
    between: Callable[[], Awaitable[None]],
) -> int:
    """Move ``slot`` to ``target`` as ``redis-cli --cluster reshard`` does, two keys at a
    time, awaiting ``between()`` after each MIGRATE (reads then meet the slot half moved:
    ASK, TRYAGAIN); returns how many keys moved."""
    source = cluster.master_of_slot(slot)
    assert source is not target
    source_id, target_id = await node_id(source), await node_id(target)
    moved = 0
    async with aioredis.Redis(port=source.port) as src, aioredis.Redis(port=target.port) as dst:
        await command(dst, "CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
        await command(src, "CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        while keys := await command(src, "CLUSTER", "GETKEYSINSLOT", slot, 2):
            await command(src, "MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
            moved += len(keys)
            await between()
    # the new owner first, then the old one (which drops its shard-channel subscribers with
    # SUNSUBSCRIBE), then the others
    others = [n for n in cluster.masters() if n not in (source, target)]
    for node in (target, source, *others):
        async with aioredis.Redis(port=node.port) as r:
            await command(r, "CLUSTER", "SETSLOT", slot, "NODE", target_id)
    return moved


class Reads:
    """Reads every job without pause; remembers the newest version answered per job and every
    answer older than one answered before (a stale read)."""

    def __init__(self, reader: StatusReader, ids: list[str]) -> None:
        self.reader, self.ids = reader, ids
        self.newest: dict[str, int] = {}
        self.stale: list[tuple[str, int, int]] = []  # (id, answered, newest answered before)
        self.errors: list[BaseException] = []
        self.rounds = 0

    async def run(self) -> None:
        while True:
            found = await asyncio.gather(
                *(self.reader.get(i) for i in self.ids), return_exceptions=True
            )
            for job_id, status in zip(self.ids, found, strict=True):
                if isinstance(status, BaseException):
                    self.errors.append(status)
                    continue
                assert status is not None, f"job {job_id} not found"
                version = status[2]
                before = self.newest.get(job_id, 0)
                if version < before:
                    self.stale.append((job_id, version, before))
                self.newest[job_id] = max(before, version)
            self.rounds += 1
            await asyncio.sleep(0)  # let the subscription's messages in between rounds


async def reshard_under_reads(cluster: LocalCluster, queue: Queue) -> tuple[Reads, Reads]:
    """Jobs submitted, read without pause by a reader with its near cache and one without,
    their slot migrated, then the slot's jobs claimed on the new node; returns the reads of
    both once the near-cached reader serves the claim."""
    submitted = await queue.submit_many(
        [JobSpec(type="echo", payload=i) for i in range(JOBS)], tenant=TENANT
    )
    ids = [s.job_id for s in submitted if not isinstance(s, Exception)]
    assert len(ids) == JOBS
    keys = queue.keys
    shard = keys.shard_of(ids[0])
    in_shard = [i for i in ids if keys.shard_of(i) == shard]
    slot = key_slot(keys.job_in(shard, in_shard[0]).encode())
    source = cluster.master_of_slot(slot)
    target = next(n for n in cluster.masters() if n is not source)

    reader = StatusReader(queue.redis, keys, ttl=3600.0)  # only events keep it fresh
    subscriber: ShardSubscriber = reader.subscription("test-reshard")
    await subscriber.start()
    # beside it, a reader without a near cache: every read of its goes to Redis, across the
    # half-moved slot too
    uncached = StatusReader(queue.redis, keys, near_cache=False)
    cached_reads, direct_reads = Reads(reader, ids), Reads(uncached, ids)
    tasks = [asyncio.create_task(r.run()) for r in (cached_reads, direct_reads)]

    async def reads_go_on() -> None:
        rounds = (cached_reads.rounds, direct_reads.rounds)
        await wait_for(
            lambda: cached_reads.rounds > rounds[0] + 1 and direct_reads.rounds > rounds[1] + 1
        )

    try:
        await reads_go_on()
        assert reader.near_hits > 0  # the reads are served from the near cache
        before = dict(cached_reads.newest)

        moved = await migrate_slot(cluster, slot, target, reads_go_on)
        assert moved >= len(in_shard)  # the jobs' hashes, among the shard's other keys
        assert cluster.master_of_slot(slot) is target
        await reads_go_on()

        # a transition on the new node: the shard's queued jobs are claimed (queued ->
        # running), their new status published on the node that now serves the slot
        batch = await queue.scripts.claim(shard, "worker-t", JOBS, 60_000)
        claimed = {j.id for j in batch.jobs}
        assert claimed == set(in_shard)
        await wait_for(lambda: all(cached_reads.newest[i] > before[i] for i in claimed))
        # served from the near cache again, kept fresh by the new node's events
        hits = reader.near_hits
        await wait_for(lambda: reader.near_hits > hits + len(ids))
        assert all(cached_reads.newest[i] == before[i] for i in ids if i not in claimed)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await subscriber.stop()
    return cached_reads, direct_reads


async def test_a_migrated_slot_is_read_without_a_stale_document(
    cluster: LocalCluster, queue: Queue
) -> None:
    cached_reads, direct_reads = await reshard_under_reads(cluster, queue)
    assert cached_reads.stale == []
    assert direct_reads.stale == []
    # the near-cached reader read Redis only once the slot had moved (its cache emptied by
    # the lost subscription): no read of it failed
    assert cached_reads.errors == []


async def test_reads_of_a_half_migrated_slot_fail_only_as_a_503(
    cluster: LocalCluster, queue: Queue
) -> None:
    """While a slot's keys are split between two nodes, Redis refuses a script whose keys
    are on both (TRYAGAIN) and the client gives up after its redirects; the API answers such
    a read 503 with Retry-After (a passing condition, as a failover), never 500."""
    _, direct_reads = await reshard_under_reads(cluster, queue)
    assert all(failing_over(exc) for exc in direct_reads.errors), direct_reads.errors
