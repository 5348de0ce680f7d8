"""What the audit records of an action that raised: the status the app answered it with
(problems.py ``status_answered``, checked here against the app's own handlers), not 500 for
every error that is not a backend outage."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest
from redis.exceptions import (
    BusyLoadingError,
    ClusterDownError,
    ReadOnlyError,
    RedisClusterException,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request

from jobtier.api.problems import HANDLERS, Problem, status_answered
from jobtier.core.sealing import KeysNotConfigured

RAISED = [
    Problem(409, "wrong-state", "finished"),
    Problem(503, "unavailable", "Postgres is unavailable; try again"),
    HTTPException(405),
    ClientDisconnect(),
    KeysNotConfigured("no JOBTIER_ENCRYPTION_KEYS"),
    RedisConnectionError("Connection refused"),
    BusyLoadingError("Redis is loading the dataset in memory"),
    asyncpg.CannotConnectNowError("the database system is starting up"),
    ClusterDownError("The cluster is down"),
    ReadOnlyError("You can't write against a read only replica."),
    ResponseError("LOADING Redis is loading the dataset in memory"),
    RedisClusterException("Redis Cluster cannot be connected. Please provide at least one"),
    RedisClusterException("Keys in request don't hash to the same slot"),
    RuntimeError("a defect"),
    ValueError("a defect"),
]


def handler_of(exc: BaseException) -> object:
    """The handler Starlette picks: the first of the exception's classes that has one."""
    return next(HANDLERS[k] for k in type(exc).__mro__ if k in HANDLERS)


@pytest.mark.parametrize("exc", RAISED, ids=lambda e: f"{type(e).__name__}:{str(e)[:24]}")
def test_the_status_recorded_is_the_status_answered(exc: BaseException) -> None:
    scope = {"type": "http", "method": "POST", "path": "/v1/admin/x", "headers": [],
             "query_string": b"", "app": Starlette()}  # fmt: skip
    response = asyncio.run(handler_of(exc)(Request(scope), exc))  # type: ignore[operator]
    assert status_answered(exc) == response.status_code


def test_the_cases_cover_every_answer() -> None:
    assert {status_answered(e) for e in RAISED} == {400, 405, 409, 500, 503}
