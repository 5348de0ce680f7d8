"""jobtier over TLS (``rediss://``) and over a Unix socket (``unix://``), against real servers:
a job's whole path (submit, a worker's claim, its success) and the status subscription that
tells the API's readers of each change; on a Redis Cluster over TLS; then behind sentinels
over TLS, through a failover.

The subscription opens connections of its own, apart from the client's pool: it once opened
plain TCP ones whatever the URL, so it never came up over TLS or a socket."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as syncredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from jobtier.config import Settings
from jobtier.core.keys import Keys
from jobtier.core.model import State
from jobtier.dev.local_redis import LocalRedis, free_port
from jobtier.dev.local_replicas import LocalCluster, LocalSentinels, TlsFiles
from jobtier.engine.queue import Queue
from jobtier.status.reader import Listener, StatusReader
from jobtier.store.redis import RedisClient, connect, master_address
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import TaskRegistry, task
from tests.fixtures.cluster import settings_for
from tests.fixtures.engine import Background, wait_for, worker_for


@task(name="tls_echo")
async def echo(ctx: JobContext, payload: Any) -> Any:
    return payload


@pytest.fixture(scope="module")
def tls_redis(
    tmp_path_factory: pytest.TempPathFactory, tls_files: TlsFiles
) -> Iterator[LocalRedis]:
    """One server that serves TLS on a port of its own and a Unix socket (its plain port is
    for nothing but its start-up check)."""
    folder = tmp_path_factory.mktemp("tls-redis")
    server = LocalRedis(
        folder,
        options={
            **tls_files.server_options(free_port()),
            "unixsocket": folder / "redis.sock",
            "unixsocketperm": 700,
        },
        free_ports=True,
    )
    server.start()
    yield server
    server.stop()


def _settings(url: str) -> Settings:
    return Settings.from_env({}, redis_url=url, shards=4, lease_seconds=5.0)


@contextlib.asynccontextmanager
async def listening(settings: Settings) -> AsyncIterator[tuple[RedisClient, StatusReader]]:
    """A client of ``settings``' Redis and a status reader whose subscription is up."""
    redis = connect(settings)
    reader = StatusReader(redis, Keys(settings.prefix, settings.shards))
    subscriber = reader.subscription("test")
    try:
        await subscriber.start()
        assert subscriber.live()
        yield redis, reader
    finally:
        await subscriber.stop()
        await redis.aclose()


def _recorder(versions: list[int]) -> Listener:
    return lambda version, _tenant, _doc: versions.append(version)


async def a_job_runs_and_is_heard(settings: Settings, reader: StatusReader, jobs: int = 1) -> None:
    """``jobs`` jobs submitted, run and succeeded through ``settings``' Redis; ``reader`` hears
    each one's claim and success through its subscription, as they are made."""
    async with await Queue.connect(settings, catalog=False) as queue:
        background = Background()  # stopped before the queue's client closes: the worker uses it
        try:
            heard: dict[str, list[int]] = {}
            for n in range(jobs):
                job = (await queue.submit(echo, {"n": n})).job_id
                heard[job] = []
                reader.add_listener(job, _recorder(heard[job]))
            background.start(worker_for(queue, TaskRegistry([echo]), concurrency=4))

            async def succeeded() -> bool:
                states = [(await queue.status(job)).state for job in heard]
                return states == [State.SUCCEEDED] * jobs

            await wait_for(succeeded, timeout=30)

            # versions, not the RESYNC (-1) a resubscription tells listeners
            def versions(job: str) -> list[int]:
                return [v for v in heard[job] if v > 0]

            await wait_for(lambda: all(len(versions(job)) >= 2 for job in heard), timeout=10)
            for job in heard:
                assert versions(job) == sorted(versions(job)), heard[job]
                assert versions(job)[-1] >= 3, heard[job]
        finally:
            await background.stop()


async def test_over_tls(tls_redis: LocalRedis, tls_files: TlsFiles) -> None:
    port = int(tls_redis.options["tls-port"])
    # the port speaks TLS only: a plain client gets no answer there
    plain = syncredis.Redis(port=port, socket_timeout=2, socket_connect_timeout=2)
    with plain, pytest.raises(syncredis.ConnectionError):
        plain.ping()
    settings = _settings(tls_files.url(port))
    async with listening(settings) as (_, reader):
        await a_job_runs_and_is_heard(settings, reader)


async def test_a_certificate_nobody_trusts_is_refused(tls_redis: LocalRedis) -> None:
    port = int(tls_redis.options["tls-port"])
    redis = connect(_settings(f"rediss://127.0.0.1:{port}/0"))  # the system's CAs only
    try:
        with pytest.raises(syncredis.ConnectionError) as refused:
            await redis.ping()
        assert isinstance(refused.value.__context__, ssl.SSLCertVerificationError)
        assert "certificate verify failed" in str(refused.value)
    finally:
        await redis.aclose()


async def test_over_a_unix_socket(tls_redis: LocalRedis) -> None:
    socket = Path(tls_redis.options["unixsocket"])
    settings = _settings(f"unix://{socket}?db=0")
    async with listening(settings) as (_, reader):
        await a_job_runs_and_is_heard(settings, reader)


@pytest.fixture(scope="module")
def tls_cluster(
    tmp_path_factory: pytest.TempPathFactory, tls_files: TlsFiles
) -> Iterator[LocalCluster]:
    cluster = LocalCluster(Path(tmp_path_factory.mktemp("tls-cluster")), masters=3, tls=tls_files)
    cluster.start()
    yield cluster
    cluster.stop()


async def test_a_cluster_over_tls(tls_cluster: LocalCluster) -> None:
    """16 shards over 3 nodes, every one reached over TLS: the client finds the nodes' TLS
    ports through the first, and the subscription holds one TLS connection to each."""
    assert tls_cluster.url.startswith("rediss://")
    settings = Settings.from_env(
        {}, redis_url=tls_cluster.url, redis_cluster=True, shards=16, lease_seconds=5.0
    )
    async with listening(settings) as (redis, reader):
        assert isinstance(redis, RedisCluster)
        # the nodes the client was told of are the TLS ports, and its shards are on all three
        nodes = {node.port for node in redis.get_primaries()}
        assert nodes == set(tls_cluster.tls_ports), nodes
        keys = Keys(settings.prefix, settings.shards)
        served = {redis.get_node_from_key(keys.base(s)) for s in range(settings.shards)}
        assert {node.port for node in served if node is not None} == nodes, served
        await a_job_runs_and_is_heard(settings, reader, jobs=24)


@pytest.fixture(scope="module")
def tls_sentinels(
    tmp_path_factory: pytest.TempPathFactory, tls_files: TlsFiles
) -> Iterator[LocalSentinels]:
    group = LocalSentinels(Path(tmp_path_factory.mktemp("tls-sentinels")), tls=tls_files)
    group.start()
    yield group
    group.stop()


async def test_behind_sentinels_over_tls_through_a_failover(tls_sentinels: LocalSentinels) -> None:
    """One client and one subscription, kept across the failover: both follow the sentinels
    to the promoted replica, over TLS."""
    sentinels = tls_sentinels
    assert sentinels.url.startswith("rediss://")
    settings = settings_for(sentinels)
    first = sentinels.master()
    try:
        async with listening(settings) as (redis, reader):
            # the sentinels are asked on their TLS ports, and name the master's
            assert await master_address(redis) == ("127.0.0.1", sentinels.served[first.port])
            await a_job_runs_and_is_heard(settings, reader)

            sentinels.kill(first)
            await wait_for(lambda: not reader.events_live(), timeout=30)
            promoted = await asyncio.to_thread(sentinels.wait_promoted, first)
            want = ("127.0.0.1", sentinels.served[promoted.port])

            async def on_the_promoted() -> bool:
                try:
                    return await master_address(redis) == want
                except RedisError:
                    return False

            await wait_for(on_the_promoted, timeout=30, interval=0.1)
            await wait_for(reader.events_live, timeout=30, interval=0.1)
            await a_job_runs_and_is_heard(settings, reader)
    finally:
        for node in sentinels.nodes:
            if node.pid is None:
                sentinels.revive(node)
