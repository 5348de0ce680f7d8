"""The hiredis command packer sends exactly what redis-py's own would; every client jobtier
makes uses jobtier's connections, of the kind its URL names."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.exceptions import DataError

from jobtier.config import Settings
from jobtier.store.redis import (
    Cluster,
    FastConnection,
    FastSSLConnection,
    FastUnixConnection,
    connect,
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


def test_an_unreachable_default_redis_points_at_the_setting_and_jobtier_run() -> None:
    from jobtier.cli.main import build_parser
    from jobtier.store.redis import RUN_REDIS_URL, unreachable_message

    said = unreachable_message(Settings.from_env({}), ConnectionError("refused"))
    assert "cannot reach Redis at redis://127.0.0.1:6379/0: refused." in said
    assert "JOBTIER_REDIS_URL" in said and f"JOBTIER_REDIS_URL={RUN_REDIS_URL}" in said
    # the URL named is the one `jobtier run` serves
    run = build_parser().parse_args(["run"])
    assert f"redis://127.0.0.1:{run.redis_port}/0" == RUN_REDIS_URL

    elsewhere = Settings.from_env({}, redis_url="redis://cache.internal:6380/0")
    said = unreachable_message(elsewhere, ConnectionError("refused"))
    assert "cache.internal:6380" in said and "16379" not in said
