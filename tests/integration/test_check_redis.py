"""The start-up check of Redis (``check_redis``) against real servers: a Redis still loading
its AOF after a restart is waited for, not mistaken for one without AOF; a Redis without AOF
is refused with a message that says how to turn it on; a cluster not up yet is waited for,
and a client of the wrong kind (cluster or single server) is told which setting to change."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import redis as syncredis
from redis.asyncio import Redis, RedisCluster

from jobtier.config import Settings
from jobtier.core.errors import ConfigError
from jobtier.dev.local_redis import LOCAL_CONF, LocalRedis, free_port
from jobtier.dev.local_replicas import LocalCluster
from jobtier.store import fitness
from jobtier.store.context import Store
from jobtier.store.fitness import check_redis
from jobtier.store.redis import connect
from tests.e2e.jobtier_run import wait_until
from tests.fixtures.engine import wait_for

KEYS = 20_000


def big_aof(server: LocalRedis) -> None:
    """KEYS keys in the AOF's base file (loaded key by key at the next start). One key a
    command: a cluster node refuses a cross-slot MSET."""
    client = syncredis.Redis(port=server.port)
    pipe = client.pipeline(transaction=False)
    for i in range(KEYS):
        pipe.set(f"bulk:{i}", "x" * 40)
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


async def probe_and_close(store: Store) -> None:
    """The store writes and reads a key; then it is closed."""
    try:
        await store.redis.set("probe", 1)
        assert await store.redis.get("probe") == b"1"
    finally:
        await store.close()


def one_node_cluster(server: LocalRedis) -> None:
    """Every slot on ``server``, a cluster node, once its cluster says it is ok."""
    with syncredis.Redis(port=server.port) as admin:
        admin.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        wait_until(
            lambda: b"cluster_state:ok" in admin.execute_command("CLUSTER", "INFO"),
            "the one-node cluster",
        )


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


@pytest.mark.parametrize("role", ["persister", "dispatcher"])
def test_the_log_consumers_refuse_a_redis_without_aof_at_start(tmp_path: Path, role: str) -> None:
    """The persister and the webhook dispatcher make the start-up check every role makes: as
    deployed (the CLI, a process of its own), each stops at once with the refusal rather
    than following the logs of a Redis that can lose what it acknowledged."""
    server = LocalRedis(tmp_path / "redis").start()
    try:
        with syncredis.Redis(port=server.port) as admin:
            admin.config_set("appendonly", "no")
        env = {k: v for k, v in os.environ.items() if not k.startswith("JOBTIER_")}
        env["JOBTIER_REDIS_URL"] = server.url
        # never reached: the check comes first (min_size 0: the pool connects on first use)
        env["JOBTIER_DATABASE_URL"] = f"postgresql://127.0.0.1:{free_port()}/none"
        proc = subprocess.Popen(
            [sys.executable, "-m", "jobtier.cli.main", role, "--name", f"{role}-check"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        try:
            # the old code followed the logs until stopped: the bound is what fails it
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        assert proc.returncode == 2, err.decode()
        assert "configuration error" in err.decode() and "appendonly is off" in err.decode()
    finally:
        server.stop()


async def test_a_cluster_of_one_master_is_checked(tmp_path: Path) -> None:
    """One node serving every slot: redis-py answers INFO of the primaries with that node's
    fields, not keyed by node name; the check reads both shapes (it used to fail here, so no
    process started against such a cluster)."""
    server = LocalRedis(tmp_path / "node", cluster=True).start()
    client = None
    try:
        one_node_cluster(server)
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


async def _refusal(settings: Settings) -> str:
    """The ConfigError of a process starting with ``settings``, its traceback dropped."""
    try:
        store = await Store.connect(settings)
    except ConfigError as exc:
        return str(exc)
    await store.close()
    raise AssertionError("the process started")


def _unclosed_nodes(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "Unclosed" in str(w.message)]


async def test_a_cluster_client_of_a_single_server_stops_at_once_saying_so(
    tmp_path: Path,
) -> None:
    """JOBTIER_REDIS_CLUSTER=1 against a server that is no cluster node: a configuration error
    that names the setting, at once (it used to be redis-py's RedisClusterException, with a
    traceback, and the connection it opened left for the collector)."""
    server = LocalRedis(tmp_path / "redis").start()
    try:
        settings = Settings.from_env({}, redis_url=server.url, redis_cluster=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            message = await _refusal(settings)
            gc.collect()  # the client is unreferenced now: an open connection warns
        assert "did not answer CLUSTER SLOTS" in message, message
        assert "cluster support disabled" in message  # Redis's own reason
        assert "unset JOBTIER_REDIS_CLUSTER" in message
        assert _unclosed_nodes(caught) == []
    finally:
        server.stop()


async def test_a_cluster_node_talked_to_as_a_single_server_is_refused(tmp_path: Path) -> None:
    """A node of a cluster of several masters with JOBTIER_REDIS_CLUSTER unset: refused at
    start, naming the setting (it used to start, and fail at the first key another master
    serves with MOVED)."""
    cluster = LocalCluster(tmp_path / "cluster", masters=3).start()
    try:
        settings = Settings.from_env({}, redis_url=cluster.url)
        with pytest.raises(ConfigError) as refused:
            await Store.connect(settings)
        message = str(refused.value)
        assert "a Redis Cluster of 3 masters" in message, message
        assert "Set JOBTIER_REDIS_CLUSTER=1" in message
    finally:
        cluster.stop()


async def test_the_one_master_of_a_cluster_talked_to_as_a_single_server_is_warned_of(
    tmp_path: Path,
) -> None:
    """Every slot on one node, talked to as a single server: it works (every key is there),
    so a warning, not a refusal."""
    server = LocalRedis(tmp_path / "node", cluster=True).start()
    try:
        one_node_cluster(server)
        client = Redis.from_url(server.url)
        try:
            (warning,) = await check_redis(client, Settings.from_env({}, redis_url=server.url))
            assert "one master of a Redis Cluster" in warning
            assert "JOBTIER_REDIS_CLUSTER=1" in warning
        finally:
            await client.aclose()
    finally:
        server.stop()


async def test_a_process_starting_before_its_cluster_waits_for_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No node up as a process starts (the cluster restarting with it), then nodes that are
    not a cluster yet, then the cluster: start-up waits, one line per try, as it waits for a
    single server (it used to exit at once with RedisClusterUnreachableError)."""
    monkeypatch.setattr(fitness, "STARTUP_PATIENCE", 600.0)  # the waits below bound it
    cluster = LocalCluster(tmp_path / "cluster", masters=3)
    cluster.nodes[0].free_ports = False  # its URL is read before it starts: it must keep it
    settings = Settings.from_env({}, redis_url=cluster.url, redis_cluster=True)
    connecting = asyncio.create_task(Store.connect(settings))
    try:
        with caplog.at_level(logging.WARNING, logger="jobtier.redis"):
            await wait_for(lambda: "event=redis_unreachable" in caplog.text, timeout=60)
            assert not connecting.done()
            await asyncio.to_thread(cluster.start)
            store = await asyncio.wait_for(connecting, 120)
        await probe_and_close(store)
        # each try says why, in redis-py's words
        assert "Redis Cluster cannot be connected" in caplog.text
        assert not [r for r in caplog.records if r.exc_info]
    finally:
        connecting.cancel()
        await asyncio.gather(connecting, return_exceptions=True)
        cluster.stop()


async def test_a_cluster_a_master_says_is_not_ok_is_waited_for(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every node answers and the slots the client learns cover every one, but a master's
    CLUSTER INFO says the cluster is not ok (it gave up a slot; a master that lost sight of
    most others says so too): start-up waits, naming that master, until it is ok again."""
    monkeypatch.setattr(fitness, "STARTUP_PATIENCE", 600.0)  # the waits below bound it
    cluster = LocalCluster(tmp_path / "cluster", masters=3).start()
    other = cluster.nodes[1]  # not the node the client learns the slots from
    admin: Any = syncredis.Redis(port=other.port)  # (execute_command is untyped)
    connecting: asyncio.Task[Store] | None = None
    try:
        slots = admin.execute_command("CLUSTER", "SLOTS")
        slot = next(start for start, _, (_, port, *_), *_ in slots if port == other.port)
        admin.execute_command("CLUSTER", "DELSLOTS", slot)
        wait_until(
            lambda: b"cluster_state:fail" in admin.execute_command("CLUSTER", "INFO"),
            "the master to say the cluster is not ok",
        )
        settings = Settings.from_env({}, redis_url=cluster.url, redis_cluster=True)
        with caplog.at_level(logging.WARNING, logger="jobtier.redis"):
            connecting = asyncio.create_task(Store.connect(settings))
            await wait_for(lambda: "cluster_state is not ok on" in caplog.text, timeout=60)
            assert not connecting.done()
            assert f"127.0.0.1:{other.port}" in caplog.text  # the master that says so
            admin.execute_command("CLUSTER", "ADDSLOTS", slot)
            store = await asyncio.wait_for(connecting, 120)
        await probe_and_close(store)
    finally:
        if connecting is not None:
            connecting.cancel()
            await asyncio.gather(connecting, return_exceptions=True)
        admin.close()
        cluster.stop()


async def test_a_cluster_that_never_answers_is_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past the start-up patience, an unreachable cluster is said as an unreachable single
    server is: where it was looked for, and what to check."""
    monkeypatch.setattr(fitness, "STARTUP_PATIENCE", 0.3)
    settings = Settings.from_env(
        {}, redis_url=f"redis://127.0.0.1:{free_port()}/0", redis_cluster=True
    )
    with pytest.raises(ConfigError) as refused:
        await Store.connect(settings)
    assert str(refused.value).startswith(f"cannot reach Redis at {settings.redis_url}: ")
    assert "Is the server running" in str(refused.value)


async def test_a_cluster_node_loading_its_data_is_waited_for_past_the_patience(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cluster node loading its data refuses CLUSTER SLOTS (LOADING) until loaded: waited
    for as long as it loads, as a single server is, not given up after STARTUP_PATIENCE as
    a node that does not answer."""
    # past its load, the restarted node says cluster_state:fail for its rejoin delay (the
    # node time-out, here 1 s): the patience covers that, and not the load
    monkeypatch.setattr(fitness, "STARTUP_PATIENCE", 3.0)
    server = LocalRedis(
        tmp_path / "node", cluster=True, options={"cluster-node-timeout": 1000}
    ).start()
    try:
        one_node_cluster(server)
        big_aof(server)
        server.stop()
        (server.folder / LOCAL_CONF).write_text(
            "key-load-delay 400\nloading-process-events-interval-bytes 1024\n"
        )  # about 8 s of load here
        server.start(loaded=False)
        settings = Settings.from_env({}, redis_url=server.url, redis_cluster=True)
        with caplog.at_level(logging.WARNING, logger="jobtier.redis"):
            connecting = asyncio.create_task(Store.connect(settings))
            try:
                await wait_for(lambda: "event=redis_loading" in caplog.text, timeout=60)
                with syncredis.Redis(port=server.port, password=server.password) as admin:
                    assert admin.info("persistence")["loading"] == 1, "loaded already: load more"
                loading_since = time.monotonic()
                store = await asyncio.wait_for(connecting, 300)
                loaded_after = time.monotonic() - loading_since
            finally:
                connecting.cancel()
                await asyncio.gather(connecting, return_exceptions=True)
        try:
            # its data all there (with what jobtier keeps of its own as it starts)
            assert await store.redis.dbsize() >= KEYS
            assert await store.redis.get(f"bulk:{KEYS - 1}") == b"x" * 40
        finally:
            await store.close()
        # waited past the patience (were the load shorter, this test would show nothing)
        assert loaded_after > fitness.STARTUP_PATIENCE, "load more"
    finally:
        server.stop()


async def test_a_single_server_client_of_a_cluster_whose_size_it_may_not_read_is_refused(
    tmp_path: Path,
) -> None:
    """A node of a cluster of several masters, talked to as a single server by a user who
    may not run CLUSTER INFO: refused as a cluster node (it used to be taken for the one
    master of a cluster, warned of, then fail with MOVED)."""
    cluster = LocalCluster(tmp_path / "cluster", masters=3).start()
    try:
        for node in cluster.nodes:
            with syncredis.Redis(port=node.port, password=node.password) as admin:
                admin.execute_command(
                    "ACL", "SETUSER", "blind", "on", ">blind-pw", "~*", "&*", "+@all",
                    "-cluster|info",
                )  # fmt: skip
        url = f"redis://blind:blind-pw@127.0.0.1:{cluster.nodes[0].port}/0"
        message = await _refusal(Settings.from_env({}, redis_url=url))
        assert "is a node of a Redis Cluster" in message, message
        assert "its size could not be read" in message
        assert "Set JOBTIER_REDIS_CLUSTER=1" in message
    finally:
        cluster.stop()


async def test_a_cluster_url_that_is_no_redis_stops_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cluster client's node that answers, but not as Redis does (another service on that
    port): an error no wait mends, said at once, as for a single server (not after
    STARTUP_PATIENCE, here longer than the test waits)."""
    monkeypatch.setattr(fitness, "STARTUP_PATIENCE", 600.0)

    async def not_redis(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)
        writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(not_redis, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        settings = Settings.from_env(
            {}, redis_url=f"redis://127.0.0.1:{port}/0", redis_cluster=True
        )
        message = await asyncio.wait_for(_refusal(settings), 60)
        assert message.startswith(f"cannot reach Redis at {settings.redis_url}: "), message
    finally:
        server.close()
        await server.wait_closed()
