"""The Redis users the tests run as (tests/fixtures/redis.py), on the session's server and
cluster alike: jobtier's own clients are its user of least privilege, the tests' own the
default user, who has a password there. So a jobtier client that lost its credentials on
the way is refused, rather than running as the all-powerful default user unnoticed."""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
from redis.exceptions import AuthenticationError, RedisClusterException

from jobtier.config import Settings
from jobtier.core.errors import ConfigError
from jobtier.dev.local_redis import SECRETS_CONF, LocalRedis, connect_to
from jobtier.engine.queue import Queue
from jobtier.store.redis import connect
from tests.fixtures.redis import JOBTIER_PASSWORD, JOBTIER_USER, admin, on_every_server

# what a client without credentials meets: NOAUTH, or (jobtier's clients speak RESP3) HELLO
# refused until the client is authenticated; a cluster client that cannot learn the slots
# for it says so in its own words, with Redis's
REFUSED = (AuthenticationError, RedisClusterException)
UNAUTHENTICATED = "(?i)NOAUTH|authentication required|with the client already authenticated"


def without_credentials(settings: Settings) -> Settings:
    url = settings.redis_url.replace(f"{JOBTIER_USER}:{JOBTIER_PASSWORD}@", "", 1)
    assert "@" not in url, url
    return settings.replace(redis_url=url)


@pytest.mark.contract
async def test_jobtier_runs_as_its_user_and_the_tests_as_the_default(
    settings: Settings, queue: Queue
) -> None:
    assert set(await on_every_server(queue.redis, "ACL", "WHOAMI")) == {JOBTIER_USER.encode()}
    async with admin(settings) as redis:
        assert set(await on_every_server(redis, "ACL", "WHOAMI")) == {b"default"}


@pytest.mark.contract
async def test_a_jobtier_client_without_credentials_is_refused(settings: Settings) -> None:
    """Not served as the default user: the default user has a password."""
    bare = without_credentials(settings)
    client = connect(bare)
    try:
        with pytest.raises(REFUSED, match=UNAUTHENTICATED):
            await client.ping()
    finally:
        await client.aclose()


async def test_through_the_sentinels_jobtier_is_its_user_and_needs_its_credentials(
    sentinel_settings: Settings,
) -> None:
    """The sentinels' servers have jobtier's user and the default user's password too."""
    client = connect(sentinel_settings)
    try:
        assert await client.execute_command("ACL", "WHOAMI") == JOBTIER_USER.encode()
    finally:
        await client.aclose()
    client = connect(without_credentials(sentinel_settings))
    try:
        with pytest.raises(REFUSED, match=UNAUTHENTICATED):
            await client.ping()
    finally:
        await client.aclose()


@pytest.mark.contract
@pytest.mark.parametrize("password", ["", "wrong"])
async def test_a_process_refused_its_credentials_stops_at_once_saying_so(
    settings: Settings, password: str
) -> None:
    """Refused credentials are not an unreachable Redis, waited for ``STARTUP_PATIENCE``
    seconds and then reported as one: the start stops at the refusal, and names it."""
    bare = without_credentials(settings)
    if password:
        bare = bare.replace(
            redis_url=bare.redis_url.replace("redis://", f"redis://{JOBTIER_USER}:{password}@", 1)
        )
    with pytest.raises(ConfigError, match="refused jobtier's credentials") as refused:
        await Queue.connect(bare, catalog=False)
    message = str(refused.value)
    assert "JOBTIER_REDIS_URL" in message
    if password:
        assert f":{password}@" not in message  # the URL it shows is masked


def test_a_local_servers_passwords_are_not_on_its_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LocalRedis (`jobtier run`, the tests' servers) gives redis-server its passwords in a
    file only its owner reads, not as arguments, which every user of the machine reads (ps)
    until redis-server sets its process title."""
    password = 'a pass"word\\with\nquotes'
    acl = ("someone", "on", f">{password}", "~*", "+@all")
    started: list[list[str]] = []
    popen = subprocess.Popen

    def recorded(args: list[str], *rest: Any, **kwargs: Any) -> Any:
        started.append([str(a) for a in args])
        return popen(args, *rest, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", recorded)  # (LocalRedis calls subprocess.Popen)
    options = {"requirepass": password, "user": acl}
    server = LocalRedis(tmp_path / "redis", options=options).start()
    try:
        (args,) = started
        assert not [a for a in args if password in a or a in ("--requirepass", "--user")], args
        secrets = tmp_path / "redis" / SECRETS_CONF
        assert stat.S_IMODE(secrets.stat().st_mode) == 0o600
        with server.client() as client:  # the password as it is, quotes, newline and all
            assert client.ping()
        with connect_to(server.port, username="someone", password=password) as client:
            assert client.ping()
        with connect_to(server.port) as client, pytest.raises(AuthenticationError):
            client.ping()
    finally:
        server.stop()
