"""What Redis raises while a master fails over is answered 503 with Retry-After, with the
``failing-over`` problem type, never a 500; any other Redis reply error stays a 500."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import orjson
import pytest
from redis.exceptions import (
    AskError,
    AuthenticationError,
    ClusterDownError,
    ClusterError,
    MasterDownError,
    MovedError,
    NoPermissionError,
    ReadOnlyError,
    RedisClusterException,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.sentinel import MasterNotFoundError
from starlette.requests import ClientDisconnect, Request

from jobtier.api.problems import HANDLERS, on_error
from jobtier.store import scripts
from jobtier.store.durable import Durable
from jobtier.store.faults import connection_closed_under_it, failing_over, fault_event
from jobtier.store.redis import _stream_keys


def request() -> Request:
    scope = {
        "type": "http",
        "method": "GET",
        "path": "/v1/jobs/x",
        "headers": [],
        "query_string": b"",
    }
    return Request(scope)


def node_down() -> RedisConnectionError:
    """A cluster node refusing connections (its master killed), as redis-py marks it."""
    exc = RedisConnectionError("Error 111 connecting to 127.0.0.1:7001. Connection refused.")
    exc.last_failed_node_name = "127.0.0.1:7001"  # type: ignore[attr-defined]
    return exc


FAILOVER = [
    ClusterDownError("The cluster is down"),
    MasterDownError("Link with MASTER is down and replica-serve-stale-data is set to 'no'."),
    SlotNotCoveredError('Slot "12" is not covered by the cluster.'),
    ClusterError("TTL exhausted."),
    TryAgainError("Multiple keys request during rehashing of slot"),
    MovedError("3999 127.0.0.1:6381"),
    AskError("3999 127.0.0.1:6381"),
    ReadOnlyError("You can't write against a read only replica."),
    MasterNotFoundError("No master found for 'jobtier'"),
    RedisClusterException("Redis Cluster cannot be connected."),
    RedisClusterException("All slots are not covered after query all startup_nodes."),
    RedisClusterException("No targets were found to execute ('GET', 'k') command on"),
    ResponseError("CLUSTERDOWN Hash slot not served"),
    node_down(),
]


def handler_for(exc: Exception):  # type: ignore[no-untyped-def]
    """The handler Starlette picks: the first class of the exception's MRO registered."""
    for cls in type(exc).__mro__:
        if cls in HANDLERS:
            return HANDLERS[cls]
    raise AssertionError(type(exc))


@pytest.mark.parametrize("exc", FAILOVER, ids=lambda e: type(e).__name__)
async def test_a_failover_error_is_a_503_with_retry_after(exc: Exception) -> None:
    for answer in (handler_for(exc), on_error):  # the router's handler, and the fast path's
        response = await answer(request(), exc)
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        problem = orjson.loads(bytes(response.body))
        assert problem["type"] == "urn:jobtier:problem:failing-over"
        assert "failing over" in problem["detail"]


async def test_another_reply_error_is_still_a_defect() -> None:
    response = await on_error(request(), ResponseError("ERR wrong number of arguments"))
    assert response.status_code == 500


@pytest.mark.parametrize(
    "exc",
    [
        RedisClusterException("EVALSHA - all keys must map to the same key slot"),
        RedisClusterException("Invalid args in command: ('GET',)"),
        RedisClusterException("No way to dispatch this command to Redis Cluster. Missing key."),
    ],
    ids=["cross-slot", "invalid-args", "missing-key"],
)
async def test_a_cluster_client_error_of_ours_is_a_500_not_a_failover(exc: Exception) -> None:
    """Only a topology that cannot be read, or has no node for the call, is a failover: a
    call redis-py cannot route is a defect, and says so (500, logged with its traceback)."""
    for answer in (handler_for(exc), on_error):
        response = await answer(request(), exc)
        assert response.status_code == 500


async def test_a_single_servers_lost_connection_is_the_plain_503() -> None:
    response = await on_error(request(), RedisConnectionError("Connection reset by peer"))
    assert response.status_code == 503
    assert orjson.loads(bytes(response.body))["type"] == "urn:jobtier:problem:unavailable"


@pytest.mark.parametrize("refusal", [TryAgainError, AskError, MovedError])
async def test_a_durable_submit_whose_slot_keeps_moving_is_a_503(
    monkeypatch: pytest.MonkeyPatch, refusal: type[Exception]
) -> None:
    """A durable call refused by its node (slot migrating or moved) on every attempt raises
    the node's last refusal, a failing-over 503 to retry, never a plain RedisError (500)."""
    sends: list[int] = []

    async def refused(
        redis: Any, commands: Sequence[Any], bases: Sequence[str], durable: Durable
    ) -> list[Any]:
        sends.append(len(commands))
        return [refusal("3999 127.0.0.1:6381") for _ in commands]

    monkeypatch.setattr(scripts, "_send_waiting", refused)
    monkeypatch.setattr(scripts, "DURABLE_PAUSE", 0.0)
    submit = scripts.Script("submit", scripts.library())
    call = (submit, (1, "jt:{0}:log", "jt:{0}", "x"))
    with pytest.raises(refusal) as caught:
        await scripts.run_durably(cast(Any, None), [call, call], Durable(1, 50))
    assert sends == [2] * scripts.DURABLE_ATTEMPTS
    response = await on_error(request(), caught.value)
    assert response.status_code == 503
    assert orjson.loads(bytes(response.body))["type"] == "urn:jobtier:problem:failing-over"


async def test_a_connection_closed_under_a_call_is_a_failover() -> None:
    """redis-py writing to a connection another task closed (a topology refresh after a node
    failed) raises AttributeError from its own code before 8.2, a ConnectionError from 8.2 on:
    a 503 to retry either way, not a 500; the same AttributeError from anywhere else stays a
    defect."""
    from redis.asyncio.connection import Connection

    closed = Connection()  # never connected, as one closed under its writer: no writer
    with pytest.raises((AttributeError, RedisConnectionError)) as raised:
        await closed._send_packed_command([b"PING"])
    if isinstance(raised.value, AttributeError):
        assert "writelines" in str(raised.value)
        assert failing_over(raised.value)
    scope = {"type": "http", "method": "GET", "path": "/v1/jobs/j", "headers": []}
    assert (await on_error(Request(scope), raised.value)).status_code == 503
    with pytest.raises(AttributeError) as ours:
        cast(Any, None).writelines([b"PING"])
    assert not failing_over(ours.value)


def test_only_the_client_librarys_closed_connection_errors_count() -> None:
    """uvloop's 'the handler is closed' (seen killing a worker's claim loop in the failover
    bench) counts only when raised from the client library's code."""
    with pytest.raises(RuntimeError) as ours:
        raise RuntimeError("unable to perform operation on <TCPTransport closed=True>")
    assert not connection_closed_under_it(ours.value)


async def test_a_client_gone_before_its_body_is_no_internal_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    handler = HANDLERS[ClientDisconnect]
    scope = {"type": "http", "method": "POST", "path": "/v1/jobs", "headers": []}
    with caplog.at_level("INFO", logger="jobtier.api"):
        response = await handler(Request(scope), ClientDisconnect())
    assert response.status_code == 400
    assert "event=client_disconnected" in caplog.text
    assert "internal_error" not in caplog.text


@pytest.mark.parametrize(
    ("name", "args", "keys"),
    [
        ("XREADGROUP", ("GROUP", "streams", "c1", "COUNT", 5, "STREAMS", "s1", ">"), ("s1",)),
        (
            "XREADGROUP",
            ("GROUP", "g", "c", "BLOCK", 100, "NOACK", "STREAMS", "a", "b", 0, 0),
            ("a", "b"),
        ),
        ("XREAD", (b"COUNT", 1, b"streams", b"k", b"0"), (b"k",)),
        ("XREAD", ("FOO", "STREAMS", "k", "0"), ()),  # not read so: redis-py asks a node
    ],
)
def test_stream_keys_are_found_without_asking_a_node(name: str, args: tuple, keys: tuple) -> None:  # type: ignore[type-arg]
    assert tuple(_stream_keys(name, args)) == keys


async def test_a_connection_closed_under_a_call_is_answered_without_a_server_traceback() -> None:
    """uvloop's 'handler is closed' (a RuntimeError) is a failover's 503; answered by the
    exception middleware, not the server-error one, which sends the 503 and then re-raises
    for the server to log a traceback per request. A RuntimeError of ours is still a 500."""
    import httpx
    from starlette.applications import Starlette
    from starlette.routing import Route

    from jobtier.api.problems import HANDLERS

    # raised where redis-py's would be (connection_closed_under_it looks at the frames)
    where: dict[str, Any] = {}
    code = (
        "def send():\n    raise RuntimeError('unable to perform operation on <TCPTransport "
        "closed=True reading=False 0x1>; the handler is closed')\n"
    )
    exec(compile(code, "/venv/site-packages/redis/asyncio/connection.py", "exec"), where)

    async def closed(request: Request) -> None:
        where["send"]()

    async def ours(request: Request) -> None:
        raise RuntimeError("a defect")

    app = Starlette(
        routes=[Route("/closed", closed), Route("/ours", ours)], exception_handlers=HANDLERS
    )
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=True)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        response = await client.get("/closed")  # raises if the server-error middleware ran
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        assert (await client.get("/ours")).status_code == 500


@pytest.mark.parametrize(
    ("exc", "event"),
    [
        (ResponseError("OOM command not allowed when used memory > 'maxmemory'."), "redis_refused"),
        (ResponseError("MISCONF Redis is configured to save RDB snapshots"), "redis_refused"),
        (
            ResponseError("WRONGTYPE Operation against a key holding the wrong kind"),
            "redis_refused",
        ),
        (ResponseError("NOGROUP No such key or consumer group"), "redis_unavailable"),
        (AuthenticationError("WRONGPASS invalid username-password pair"), "redis_refused"),
        (NoPermissionError("NOPERM this user has no permissions"), "redis_refused"),
        (ResponseError("LOADING Redis is loading the dataset in memory"), "redis_unavailable"),
        (ResponseError("CLUSTERDOWN The cluster is down"), "redis_unavailable"),
        (ClusterDownError("The cluster is down"), "redis_unavailable"),
        (ReadOnlyError("You can't write against a read only replica."), "redis_unavailable"),
        (TryAgainError("Multiple keys request during rehashing of slot"), "redis_unavailable"),
        (RedisConnectionError("Connection refused"), "redis_unavailable"),
        (ConnectionRefusedError(111, "refused"), "redis_unavailable"),
    ],
)
def test_a_loops_log_line_says_whether_redis_refused_or_was_away(
    exc: Exception, event: str
) -> None:
    """The persister's and the webhook dispatcher's lines: an error Redis answered for a
    cause of its own (memory, disk, a wrong key) is not logged as Redis being away."""
    assert fault_event(exc) == event
