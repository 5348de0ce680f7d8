"""StatusReader against a real Redis and a real Redis Cluster (``contract``): loads, batches,
events; and what only a cluster does (a batch split over its nodes)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis

from jobtier.config import Settings
from jobtier.core.keys import Keys
from jobtier.core.model import JobSpec, State, decode_status
from jobtier.dev.local_replicas import LocalCluster
from jobtier.engine.queue import Queue
from jobtier.status.docs import read_doc
from jobtier.status.reader import StatusReader, parse_version
from jobtier.store.redis import RedisClient
from jobtier.store.subscriber import ShardSubscriber
from tests.fixtures.engine import wait_for
from tests.fixtures.redis import as_jobtier, command_calls, config_set, flushall, reset_stats

pytestmark = pytest.mark.contract

TENANT = "acme"


def keys_of(settings: Settings) -> Keys:
    return Keys(settings.prefix, settings.shards)


async def hmget_calls(redis: RedisClient) -> int:
    """HMGET commands the server(s) executed since the last CONFIG RESETSTAT."""
    return await command_calls(redis, "hmget")


async def submit(queue: Queue, n: int = 1) -> list[str]:
    """Create ``n`` jobs with the real submit script (which also renders their documents)."""
    specs = [JobSpec(type="echo", payload={"i": i}) for i in range(n)]
    results = await queue.submit_many(specs, tenant=TENANT)
    ids = []
    for result in results:
        assert not isinstance(result, Exception)
        ids.append(result.job_id)
    return ids


@pytest.fixture
async def subscribed() -> AsyncIterator[list[ShardSubscriber]]:
    subscribers: list[ShardSubscriber] = []
    yield subscribers
    for subscriber in subscribers:
        await subscriber.stop()


async def test_concurrent_gets_of_one_id_send_one_hmget(
    queue: Queue, redis: RedisClient, redis_as_jobtier: RedisClient, settings: Settings
) -> None:
    (job_id,) = await submit(queue)
    reader = StatusReader(redis_as_jobtier, keys_of(settings), near_cache=True, coalesce=True)
    await reset_stats(redis)
    results = await asyncio.gather(*(reader.get(job_id) for _ in range(2_000)))
    assert await hmget_calls(redis) == 1
    assert reader.redis_loads == 1 and reader.batches == 1
    assert results[0] is not None and all(r == results[0] for r in results)
    tenant, doc, version = results[0]
    assert tenant == TENANT and version == 1 == decode_status(doc).version
    assert decode_status(doc).id == job_id
    # and from now on the near cache answers
    assert await reader.get(job_id) == results[0]
    assert await hmget_calls(redis) == 1
    assert reader.requests == 2_001 and reader.near_hits == 1


async def test_near_hit_then_load_is_get_in_two_steps(
    queue: Queue, redis: RedisClient, redis_as_jobtier: RedisClient, settings: Settings
) -> None:
    """The status fast path's split of ``get`` (api/jobs.py): ``near_hit`` answers only from
    the near cache and counts only what it answers; ``load`` reads Redis and counts the rest."""
    (job_id,) = await submit(queue)
    reader = StatusReader(redis_as_jobtier, keys_of(settings), near_cache=True, coalesce=True)
    assert reader.near_hit(job_id) is None
    assert reader.requests == 0 and reader.near is not None and reader.near.misses == 1
    loaded = await reader.load(job_id)
    assert loaded is not None and loaded[0] == TENANT and loaded[2] == 1
    assert reader.requests == 1 and reader.redis_loads == 1 and reader.near_hits == 0
    entry = reader.near_hit(job_id)
    assert entry is not None and (entry.tenant, entry.doc, entry.version) == loaded
    assert reader.requests == 2 and reader.near_hits == 1 and reader.redis_loads == 1
    assert await reader.load("not-an-id") is None and reader.redis_loads == 1
    # without a near cache every read is a load
    plain = StatusReader(redis_as_jobtier, keys_of(settings), near_cache=False, coalesce=True)
    assert plain.near_hit(job_id) is None and plain.requests == 0
    assert await plain.load(job_id) == loaded and plain.requests == 1


async def test_distinct_ids_of_one_tick_go_in_one_round_trip(
    queue: Queue, redis: RedisClient, redis_as_jobtier: RedisClient, settings: Settings
) -> None:
    keys = keys_of(settings)
    ids = await submit(queue, 60)
    assert len({keys.shard_of(i) for i in ids}) > 1  # the batch spans shards
    unknown = keys.new_id(0)
    reader = StatusReader(redis_as_jobtier, keys, near_cache=False, coalesce=True)
    await reset_stats(redis)
    results = await asyncio.gather(*(reader.get(i) for i in [*ids, unknown, "not-an-id"]))
    assert reader.batches == 1 and reader.redis_loads == 61  # the malformed id never went
    # one read_status.lua call (on a cluster one per shard, in one pipeline): its HMGETs
    # count below
    shards = {keys.shard_of(i) for i in [*ids, unknown]}
    assert reader.script_calls == (len(shards) if settings.redis_cluster else 1)
    assert await hmget_calls(redis) == 61
    assert results[-2:] == [None, None]
    for job_id, result in zip(ids, results, strict=False):
        assert result is not None
        tenant, doc, version = result
        assert tenant == TENANT and decode_status(doc).id == job_id and version == 1
    assert reader.coalescer is not None and reader.coalescer.batches == 1


async def test_a_batch_is_read_by_the_read_only_script(
    queue: Queue, redis: RedisClient, redis_as_jobtier: RedisClient, settings: Settings
) -> None:
    """On one server a batch spanning shards is one call of read_status.lua (on a cluster
    one call per shard, in one pipeline: a script's keys must share a slot); the script
    comes back after Redis forgot it, and reads go on while Redis refuses writes."""
    keys = keys_of(settings)
    ids = await submit(queue, 40)
    unknown = keys.new_id(3)
    shards = {keys.shard_of(i) for i in [*ids, unknown]}
    assert len(shards) > 1
    per_batch = len(shards) if settings.redis_cluster else 1
    reader = StatusReader(redis_as_jobtier, keys, near_cache=False, coalesce=True)
    await redis.script_flush()  # as after a restart: the first call meets NOSCRIPT
    results = await asyncio.gather(*(reader.get(i) for i in [*ids, unknown]))
    assert reader.batches == 1 and reader.script_calls == per_batch and reader.redis_loads == 41
    assert results[-1] is None
    assert [decode_status(r[1]).id for r in results[:-1] if r] == ids
    await config_set(redis, "maxmemory", 1)  # noeviction: every write is refused now
    try:
        with pytest.raises(aioredis.ResponseError, match="maxmemory"):
            await redis.set("jt:probe", 1)
        assert await asyncio.gather(*(reader.get(i) for i in ids)) == results[:-1]
        shards_of_ids = {keys.shard_of(i) for i in ids}
        assert reader.script_calls == per_batch + (
            len(shards_of_ids) if settings.redis_cluster else 1
        )
    finally:
        await config_set(redis, "maxmemory", 0)


async def test_baseline_sends_every_get_to_redis(
    queue: Queue, redis: RedisClient, redis_as_jobtier: RedisClient, settings: Settings
) -> None:
    (job_id,) = await submit(queue)
    reader = StatusReader(redis_as_jobtier, keys_of(settings), near_cache=False, coalesce=False)
    await reset_stats(redis)
    results = await asyncio.gather(*(reader.get(job_id) for _ in range(50)))
    assert all(r is not None and r[0] == TENANT for r in results)
    for _ in range(20):
        assert await reader.get(job_id) is not None
    assert reader.redis_loads == reader.batches == 70
    assert await hmget_calls(redis) == 70
    assert reader.near is None and reader.coalescer is None


async def test_near_cache_follows_a_real_transition(
    queue: Queue,
    redis: RedisClient,
    redis_as_jobtier: RedisClient,
    settings: Settings,
    subscribed: list[ShardSubscriber],
) -> None:
    keys = keys_of(settings)
    # a long TTL: only the event can make the cache serve the new version
    reader = StatusReader(redis_as_jobtier, keys, near_cache=True, coalesce=True, ttl=3600)
    subscriber = ShardSubscriber(
        redis_as_jobtier,
        [keys.events(s) for s in range(keys.shards)],
        reader.on_event,
        reader.on_reset,
        name="test-status",
    )
    subscribed.append(subscriber)
    await subscriber.start()
    (job_id,) = await submit(queue)
    first = await reader.get(job_id)
    assert first is not None and first[2] == 1 and reader.redis_loads == 1
    heard: list[tuple[int, str, bytes]] = []
    reader.add_listener(job_id, lambda v, t, d: heard.append((v, t, d)))

    cancelled = await queue.cancel(job_id)
    assert cancelled.state is State.CANCELLED and cancelled.version == 2

    async def serves_new_version() -> bool:
        status = await reader.get(job_id)
        return status is not None and status[2] == 2

    await wait_for(serves_new_version)
    status = await reader.get(job_id)
    assert status is not None
    assert decode_status(status[1]).state is State.CANCELLED
    assert reader.redis_loads == 1  # served from the near cache, advanced by the event
    assert reader.near is not None and reader.near.events_applied == 1
    assert heard == [(2, TENANT, status[1])]

    # a resubscription (on_reset) empties the cache: the next read goes to Redis
    reader.on_reset()
    assert await reader.get(job_id) == status
    assert reader.redis_loads == 2


async def test_event_during_a_load_is_not_rolled_back(
    queue: Queue,
    redis: RedisClient,
    redis_as_jobtier: RedisClient,
    settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The job is read (v1) while it changes (v2): its event, which finds no entry to
    advance, must not be lost to the load that stores v1 after it."""
    reader = StatusReader(
        redis_as_jobtier, keys_of(settings), near_cache=True, coalesce=True, ttl=3600
    )
    (job_id,) = await submit(queue)
    fetched, gate = asyncio.Event(), asyncio.Event()
    real_fetch = reader._fetch

    async def slow_fetch(ids: list[str]) -> list[Any]:
        replies = await real_fetch(ids)  # Redis answers v1 ...
        fetched.set()
        await gate.wait()  # ... and the answer is delivered late
        return replies

    monkeypatch.setattr(reader, "_fetch", slow_fetch)
    reading = asyncio.create_task(reader.get(job_id))
    # the change comes after Redis answered (not merely after the load began: a cluster
    # client's first command first learns the slots, and the cancel could overtake it)
    await asyncio.wait_for(fetched.wait(), 10)
    assert job_id in reader._loading
    cancelled = await queue.cancel(job_id)
    _, doc = await read_doc(redis_as_jobtier, keys_of(settings), job_id)
    assert cancelled.version == 2 and isinstance(doc, bytes)
    # what the subscription would deliver for the cancel
    reader.on_event(b"ev", b"%s 2 %s\n%s" % (job_id.encode(), TENANT.encode(), doc))
    gate.set()
    first = await reading
    assert first is not None and first[2] == 1  # this reader asked before the change
    status = await reader.get(job_id)
    assert status is not None and status[2] == 2 and parse_version(status[1]) == 2
    assert reader._loading == {}


async def test_fallback_for_ids_redis_no_longer_holds(
    queue: Queue, redis: RedisClient, redis_as_jobtier: RedisClient, settings: Settings
) -> None:
    keys = keys_of(settings)
    (in_redis,) = await submit(queue)
    gone, unknown = keys.new_id(1), keys.new_id(2)
    archived = b'{"id":"%s","type":"echo","state":"succeeded","version":7,"priority":"normal"}'
    asked: list[list[str]] = []

    async def fallback(ids: list[str]) -> dict[str, tuple[str, bytes]]:
        asked.append(sorted(ids))
        return {gone: (TENANT, archived % gone.encode())} if gone in ids else {}

    reader = StatusReader(redis_as_jobtier, keys, near_cache=True, coalesce=True, fallback=fallback)
    results = await asyncio.gather(*(reader.get(i) for i in [in_redis, gone, gone, unknown]))
    assert results[0] is not None and results[0][2] == 1
    assert results[1] == results[2] == (TENANT, archived % gone.encode(), 7)
    assert results[3] is None
    assert asked == [sorted([gone, unknown])]  # one fallback call for the tick's misses
    assert await reader.get(gone) == results[1]  # re-cached
    assert len(asked) == 1


async def test_ids_the_fallback_does_not_know_are_remembered_briefly(
    queue: Queue, redis: RedisClient, redis_as_jobtier: RedisClient, settings: Settings
) -> None:
    keys = keys_of(settings)
    unknown, later = keys.new_id(1), keys.new_id(2)
    asked: list[list[str]] = []
    now = [100.0]

    async def fallback(ids: list[str]) -> dict[str, tuple[str, bytes]]:
        asked.append(sorted(ids))
        return {}

    reader = StatusReader(
        redis_as_jobtier,
        keys,
        fallback=fallback,
        clock=lambda: now[0],
        absent_ttl=1.0,
        absent_size=2,
    )
    assert await reader.get(unknown) is None and await reader.get(later) is None
    for _ in range(50):  # polling an unknown id costs Postgres nothing more for a second
        assert await reader.get(unknown) is None
    assert asked == [[unknown], [later]] and reader.absent_hits == 50
    # a job that appears in Redis meanwhile is seen at once: Redis is asked first
    hmgets = await hmget_calls(redis)
    (real,) = await submit(queue)
    reader._absent[real] = now[0] + 1.0  # as if it had been unknown a moment ago
    found = await reader.get(real)
    assert found is not None and found[0] == TENANT
    assert await hmget_calls(redis) > hmgets
    now[0] += 1.5  # expired: asked again
    assert await reader.get(unknown) is None
    assert asked[-1] == [unknown]
    third = keys.new_id(3)  # bounded: the oldest entry makes room
    await reader.get(third)
    assert len(reader._absent) <= 2


async def test_fallback_failure_reaches_only_its_readers(
    queue: Queue, redis: RedisClient, redis_as_jobtier: RedisClient, settings: Settings
) -> None:
    keys = keys_of(settings)
    (in_redis,) = await submit(queue)
    gone = keys.new_id(1)

    async def fallback(ids: list[str]) -> dict[str, tuple[str, bytes]]:
        raise ConnectionError("postgres is down")

    reader = StatusReader(redis_as_jobtier, keys, fallback=fallback)
    found, failed = await asyncio.gather(
        reader.get(in_redis), reader.get(gone), return_exceptions=True
    )
    assert isinstance(found, tuple) and found[0] == TENANT
    assert isinstance(failed, ConnectionError)


# --- what only a cluster does -----------------------------------------------------------


async def test_cluster_batch_is_split_per_node(redis_cluster: LocalCluster) -> None:
    flushall(redis_cluster.nodes)
    keys = Keys("jt", 16)
    client = aioredis.RedisCluster.from_url(as_jobtier(redis_cluster.url))
    nodes = [aioredis.Redis(port=node.port, password=node.password) for node in redis_cluster.nodes]
    try:
        ids = [keys.new_id(shard) for shard in range(16) for _ in range(3)]
        # job hashes as submit.lua leaves them (core/keys.py, "Job hashes")
        c = " ".join(["t", "low", "3", "2026-01-01T00:00:00.000Z", "default", ""])
        t = " ".join(["queued", "4", "0", "1700000000000", "", "", "0", "0", "4", "0", ""])
        for job_id in ids:
            await client.hset(
                keys.job(job_id), mapping={"tenant": TENANT, "id": job_id, "c": c, "t": t}
            )
        for node in nodes:
            await node.config_resetstat()
        reader = StatusReader(client, keys, near_cache=True, coalesce=True)
        missing = keys.new_id(5)
        results = await asyncio.gather(*(reader.get(i) for i in [*ids, missing]))
        assert results[-1] is None
        assert all(r is not None and r[0] == TENANT and r[2] == 4 for r in results[:-1])
        assert [msgspec.json.decode(r[1])["id"] for r in results[:-1] if r] == ids
        assert reader.batches == 1 and reader.redis_loads == len(ids) + 1
        assert reader.script_calls == 16  # one read_status.lua call per shard: one hash tag
        per_node = [await hmget_calls(node) for node in nodes]
        assert sum(per_node) == len(ids) + 1
        assert sum(1 for n in per_node if n) > 1  # the one batch went to several nodes
    finally:
        await client.aclose()
        for node in nodes:
            await node.aclose()


async def test_events_and_listeners_without_redis(caplog: pytest.LogCaptureFixture) -> None:
    """on_event parsing, listener add/remove, and the faults the subscription must survive."""
    keys = Keys("jt", 4)
    reader = StatusReader(None, keys, ttl=3600)  # type: ignore[arg-type]  # no loads here
    job_id = keys.new_id(1)
    heard: list[tuple[int, str, bytes]] = []

    def listener(version: int, tenant: str, doc: bytes) -> None:
        heard.append((version, tenant, doc))

    def broken(version: int, tenant: str, doc: bytes) -> None:
        raise RuntimeError("listener bug")

    reader.add_listener(job_id, listener)
    reader.add_listener(job_id, broken)
    reader.on_event(b"ev", b'%s 3 two words\n{"version":3}' % job_id.encode())
    assert heard == [(3, "two words", b'{"version":3}')]  # the tenant is the rest of the line
    assert "status_listener_failed" in caplog.text
    reader.on_event(b"ev", b"garbage")  # logged and ignored
    reader.on_event(b"ev", b"\xff 1 t\n{}")
    assert "bad_status_event" in caplog.text
    assert reader.near is not None and job_id not in reader.near  # absent ids are not added
    reader.remove_listener(job_id, listener)
    reader.remove_listener(job_id, broken)
    reader.remove_listener(job_id, broken)  # twice: harmless
    assert reader._listeners == {}
    reader.on_event(b"ev", b"%s 4 t\n{}" % job_id.encode())
    assert len(heard) == 1
    stats = reader.stats()
    assert stats["listeners"] == 0 and stats["requests"] == 0 and stats["near_size"] == 0


async def test_a_job_reaching_redis_while_the_fallback_answers_is_then_read_as_redis_has_it(
    redis_as_jobtier: RedisClient, settings: Settings
) -> None:
    """A read that missed the job in Redis asks the fallback, and the job reaches Redis
    meanwhile (an outbox row relayed): its events then are kept. Before, the fallback's older
    document (submitted, version 0) was cached over them, and every read for the cache's TTL,
    a long poll's whole wait, saw the job as not yet started."""
    keys = keys_of(settings)
    job_id = keys.new_id(1)
    asking, answer = asyncio.Event(), asyncio.Event()

    def doc(state: str, version: int) -> bytes:
        return b'{"id":"%s","type":"echo","state":"%s","version":%d,"priority":"normal"}' % (
            job_id.encode(), state.encode(), version,
        )  # fmt: skip

    async def fallback(ids: list[str]) -> dict[str, tuple[str, bytes]]:
        asking.set()
        await answer.wait()
        return {job_id: (TENANT, doc("submitted", 0))}  # what the outbox row reads as

    reader = StatusReader(redis_as_jobtier, keys, near_cache=True, coalesce=True, fallback=fallback)
    reading = asyncio.create_task(reader.get(job_id))
    await asyncio.wait_for(asking.wait(), 10)
    # the relay's submit and the job's claim reach Redis: their events, while the fallback answers
    for state, version in (("queued", 1), ("running", 2)):
        event = b"%s %d %s\n%s" % (job_id.encode(), version, TENANT.encode(), doc(state, version))
        reader.on_event(b"jt:{0}:events", event)
    answer.set()
    first = await reading
    assert first is not None and first[2] == 0  # this read asked before the job was there
    assert await reader.get(job_id) == (TENANT, doc("running", 2), 2)
    assert reader._loading == {}
