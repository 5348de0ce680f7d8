"""The hiredis command packer sends exactly what redis-py's own would."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from redis.exceptions import DataError

from jobtier.config import Settings
from jobtier.store.redis import FastConnection, connect

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


def test_clients_use_it() -> None:
    client = connect(Settings.from_env({}))
    assert isinstance(client, Redis)
    assert client.connection_pool.connection_class is FastConnection


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
