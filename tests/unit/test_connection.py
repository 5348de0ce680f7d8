"""The hiredis command packer sends exactly what redis-py's own would; every client jobtier
makes uses jobtier's connections, of the kind its URL names."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError

from jobtier.config import Settings
from jobtier.core.errors import ConfigError
from jobtier.store.redis import (
    Cluster,
    FastConnection,
    FastSentinelConnection,
    FastSentinelSSLConnection,
    FastSSLConnection,
    FastUnixConnection,
    _Retry,
    connect,
    sent_once,
)

CASES: list[tuple[Any, ...]] = [
    ("EVALSHA", "a" * 40, 1, "jt:{3}:log", "jt:{3}:", "worker", 50, 30000),
    ("SET", "k", 0.1),
    ("ZADD", "k", 1.5, "m"),
    ("HSET", "k", "f", b"\x00\xff" * 10_000),
    ("SET", "k", "é"),
    (b"SET", b"k", memoryview(b"xyz")),
    ("CONFIG GET", "maxmemory-policy"),  # a name with a space: redis-py splits it
]


@pytest.mark.parametrize("args", CASES)
def test_same_bytes_as_redis_py(args: tuple[Any, ...]) -> None:
    assert b"".join(FastConnection().pack_command(*args)) == b"".join(
        Connection().pack_command(*args)
    )


def test_values_redis_py_refuses_are_still_refused() -> None:
    with pytest.raises(DataError):
        FastConnection().pack_command("SET", "k", None)


@pytest.mark.parametrize(
    ("url", "ours", "theirs"),
    [
        ("redis://127.0.0.1:6379/0", FastConnection, Connection),
        ("rediss://cache.internal:6380/0", FastSSLConnection, SSLConnection),
        ("unix:///run/redis.sock?db=0", FastUnixConnection, UnixDomainSocketConnection),
    ],
)
def test_clients_use_it_of_the_urls_kind(url: str, ours: type, theirs: type) -> None:
    settings = Settings.from_env({}, redis_url=url)
    client = connect(settings)
    assert isinstance(client, Redis)
    made = client.connection_pool.connection_class
    assert made is ours and issubclass(made, theirs)
    # the URL's parts and the options both reach the connections
    kwargs = client.connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] == settings.redis_socket_timeout
    assert kwargs.get("path", kwargs.get("host")) in {
        "127.0.0.1",
        "cache.internal",
        "/run/redis.sock",
    }


def test_the_urls_query_options_win_as_from_urls_do() -> None:
    client = connect(
        Settings.from_env({}, redis_url="redis://h:6379/2?max_connections=7&timeout=5")
    )
    assert isinstance(client, Redis)
    pool = client.connection_pool
    assert pool.max_connections == 7 and pool.timeout == 5  # type: ignore[attr-defined]
    assert pool.connection_kwargs["db"] == 2


@pytest.mark.parametrize(
    ("url", "ours"),
    [("redis://127.0.0.1:7000", FastConnection), ("rediss://127.0.0.1:7000", FastSSLConnection)],
)
def test_cluster_nodes_use_it(url: str, ours: type) -> None:
    """redis-py drops a cluster client's connection_class: the nodes get ours all the same."""
    client = connect(Settings.from_env({}, redis_url=url, redis_cluster=True))
    assert isinstance(client, Cluster)
    assert client.nodes_manager.connection_kwargs["connection_class"] is ours
    (node,) = client.nodes_manager.startup_nodes.values()
    assert node.connection_class is ours


@pytest.mark.parametrize("tls", [False, True])
def test_sentinel_clients_speak_tls_for_a_rediss_url(tls: bool) -> None:
    """The master's connections and the sentinels' both: TLS with the URL's ssl_* options
    for rediss://, plain for redis://; the URL's host is never used."""
    url = (
        "rediss://u:pw@ignored:1/3?ssl_ca_certs=/etc/ca.crt" if tls else "redis://u:pw@ignored:1/3"
    )
    settings = Settings.from_env({}, redis_url=url, redis_sentinels="10.0.0.1:26379,10.0.0.2:26379")
    client = connect(settings)
    assert isinstance(client, Redis)
    pool = client.connection_pool
    assert pool.connection_class is (FastSentinelSSLConnection if tls else FastSentinelConnection)
    kwargs = pool.connection_kwargs
    assert (kwargs["db"], kwargs["username"], kwargs["password"]) == (3, "u", "pw")
    assert "host" not in kwargs
    assert kwargs.get("ssl_ca_certs") == ("/etc/ca.crt" if tls else None)
    sentinels = pool.sentinel_manager.sentinels  # type: ignore[attr-defined]
    assert len(sentinels) == 2
    for sentinel in sentinels:
        made = sentinel.connection_pool.connection_class
        assert issubclass(made, SSLConnection) is tls
        assert sentinel.connection_pool.connection_kwargs.get("ssl_ca_certs") == (
            "/etc/ca.crt" if tls else None
        )


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("redis://h:6379/0", Connection),
        ("rediss://h:6380/0?ssl_ca_certs=/etc/ca.crt", SSLConnection),
        ("unix:///run/redis.sock?db=0", UnixDomainSocketConnection),
    ],
)
def test_the_status_subscription_connects_as_the_url_says(url: str, kind: type) -> None:
    """Its connections are its own, outside the client's pool: of the URL's kind all the same
    (they were plain TCP whatever the URL: tests/integration/test_redis_tls.py)."""
    from jobtier.store.subscriber import ShardSubscriber

    subscriber = ShardSubscriber(connect(Settings.from_env({}, redis_url=url)), ["c"], print)
    conn = subscriber._connection("10.0.0.7", 6380)
    assert type(conn) is kind
    if kind is UnixDomainSocketConnection:
        assert conn.path == "/run/redis.sock"  # type: ignore[attr-defined]
    else:
        assert (conn.host, conn.port) == ("10.0.0.7", 6380)  # type: ignore[attr-defined]
    if kind is SSLConnection:
        assert conn.ca_certs == "/etc/ca.crt"  # type: ignore[attr-defined]


@pytest.mark.parametrize("tls", [False, True])
def test_the_status_subscription_connects_to_cluster_nodes_as_the_url_says(tls: bool) -> None:
    from jobtier.store.subscriber import ShardSubscriber

    url = "rediss://127.0.0.1:7000?ssl_ca_certs=/etc/ca.crt" if tls else "redis://127.0.0.1:7000"
    client = connect(Settings.from_env({}, redis_url=url, redis_cluster=True))
    assert isinstance(client, Cluster)
    # the node it would use once the client knows the cluster (start() initialises it)
    (node,) = client.nodes_manager.startup_nodes.values()
    client.nodes_manager.default_node = node
    try:
        conn = ShardSubscriber(client, ["c"], print)._connection("10.0.0.7", 7001)
    finally:
        # unset again: from redis-py 8.2 a client with a default node that is collected
        # unclosed warns (ResourceWarning), which fails whichever test is running then
        client.nodes_manager.default_node = None  # type: ignore[assignment]
    assert type(conn) is (SSLConnection if tls else Connection)
    assert (conn.host, conn.port) == ("10.0.0.7", 7001)
    if tls:
        assert conn.ca_certs == "/etc/ca.crt"  # type: ignore[attr-defined]


@pytest.mark.parametrize("tls", [False, True])
def test_the_status_subscription_connects_to_the_sentinels_master_as_the_url_says(
    tls: bool,
) -> None:
    from jobtier.store.subscriber import ShardSubscriber

    url = "rediss://unused:1/0?ssl_ca_certs=/etc/ca.crt" if tls else "redis://unused:1/0"
    client = connect(Settings.from_env({}, redis_url=url, redis_sentinels="10.0.0.1:26379"))
    conn = ShardSubscriber(client, ["c"], print)._connection("10.0.0.7", 6380)
    assert type(conn) is (SSLConnection if tls else Connection)
    assert (conn.host, conn.port) == ("10.0.0.7", 6380)


def test_sentinels_refuse_a_unix_socket_url() -> None:
    with pytest.raises(ConfigError, match="rediss:// for TLS"):
        Settings.from_env({}, redis_url="unix:///run/redis.sock", redis_sentinels="10.0.0.1:26379")


def test_a_cluster_refuses_a_unix_socket_url() -> None:
    # (it used to be redis-py's RedisClusterException, raised from connect())
    with pytest.raises(ConfigError, match="JOBTIER_REDIS_CLUSTER=1, JOBTIER_REDIS_URL must be"):
        Settings.from_env({}, redis_url="unix:///run/redis.sock", redis_cluster=True)
    assert Settings.from_env({}, redis_url="rediss://h:6380/0", redis_cluster=True).redis_cluster


def test_an_unreachable_default_redis_points_at_the_setting_and_jobtier_run() -> None:
    from jobtier.cli.main import build_parser
    from jobtier.store.fitness import RUN_REDIS_URL, unreachable_message

    said = unreachable_message(Settings.from_env({}), ConnectionError("refused"))
    assert "cannot reach Redis at redis://127.0.0.1:6379/0: refused." in said
    assert "JOBTIER_REDIS_URL" in said and f"JOBTIER_REDIS_URL={RUN_REDIS_URL}" in said
    # the URL named is the one `jobtier run` serves
    run = build_parser().parse_args(["run"])
    assert f"redis://127.0.0.1:{run.redis_port}/0" == RUN_REDIS_URL

    elsewhere = Settings.from_env({}, redis_url="redis://cache.internal:6380/0")
    said = unreachable_message(elsewhere, ConnectionError("refused"))
    assert "cache.internal:6380" in said and "16379" not in said


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://jobtier:s3cret@cache:6379/0", "redis://jobtier:***@cache:6379/0"),
        (
            "rediss://:s3cret@cache:6380/0?ssl_ca_certs=/ca.crt",
            "rediss://:***@cache:6380/0?ssl_ca_certs=/ca.crt",
        ),
        ("redis://jobtier:p%40ss@[::1]:6379/2", "redis://jobtier:***@[::1]:6379/2"),
        ("redis://cache:6379/0", "redis://cache:6379/0"),
        ("redis://jobtier@cache:6379/0", "redis://jobtier@cache:6379/0"),
        ("unix:///run/redis.sock?db=0", "unix:///run/redis.sock?db=0"),
    ],
)
def test_a_redis_password_is_never_shown(url: str, shown: str) -> None:
    """`jobtier config`, the message for an unreachable Redis and the log while it loads
    name the URL without its password."""
    from jobtier.config import masked_url
    from jobtier.store.fitness import unreachable_message

    assert masked_url(url) == shown
    settings = Settings.from_env({}, redis_url=url)
    assert settings.public()["redis_url"] == shown
    said = unreachable_message(settings, ConnectionError("refused"))
    assert shown in said and ("s3cret" not in said and "p%40ss" not in said)


@pytest.mark.parametrize(
    ("url", "address"),
    [
        ("redis://10.0.0.7:6380/0", ("10.0.0.7", 6380)),
        ("unix:///run/redis.sock?db=0", ("/run/redis.sock", 0)),
    ],
)
async def test_the_servers_address_is_the_urls(url: str, address: tuple[str, int]) -> None:
    """What the status subscription names its one node by, and logs: a Unix socket's path
    (it read 127.0.0.1:6379, an address the client never used)."""
    from jobtier.store.redis import master_address

    client = connect(Settings.from_env({}, redis_url=url))
    try:
        assert await master_address(client) == address
    finally:
        await client.aclose()


async def test_a_call_inside_sent_once_is_made_once_and_copies_keep_their_retries() -> None:
    """Inside ``sent_once`` a failed call is not made again (its failure handler, which drops
    the connection, still runs); a copy of the retry object made there, as redis-py 5 makes
    one for each new connection, retries as configured outside it."""
    retry = _Retry(NoBackoff(), 3)
    attempts: list[int] = []
    handled: list[Exception] = []

    async def do() -> None:
        attempts.append(1)
        raise RedisConnectionError("Connection closed by server.")

    async def fail(error: Exception) -> None:
        handled.append(error)

    with sent_once():
        made_inside = copy.deepcopy(retry)
        with pytest.raises(RedisConnectionError):
            await retry.call_with_retry(do, fail)
    assert len(attempts) == 1 and len(handled) == 1
    for r in (retry, made_inside):
        attempts.clear()
        with pytest.raises(RedisConnectionError):
            await r.call_with_retry(do, fail)
        assert len(attempts) == 4  # once, then 3 retries


async def test_sent_once_gives_the_failure_handler_what_it_asks_for() -> None:
    """redis-py 6+ asks its handler for the failure count (``with_failure_count``); a handler
    that raises (a WATCH broken by the lost connection) raises through."""
    retry = _Retry(NoBackoff(), 3)
    counted: list[int] = []

    async def do() -> None:
        raise RedisConnectionError("Connection closed by server.")

    async def count(error: Exception, failures: int) -> None:
        counted.append(failures)

    async def broken(error: Exception) -> None:
        raise RuntimeError("watch broken") from error

    with sent_once():
        with pytest.raises(RedisConnectionError):
            await retry.call_with_retry(do, count, with_failure_count=True)
        with pytest.raises(RuntimeError, match="watch broken"):
            await retry.call_with_retry(do, broken)
    assert counted == [1]
