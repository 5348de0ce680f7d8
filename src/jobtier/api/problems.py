"""Errors as JSON problem documents (RFC 9457): a stable ``type``, never a stack trace."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import asyncpg
import orjson
from redis.exceptions import (
    BusyLoadingError,
    RedisClusterException,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Match

from jobtier.core.sealing import KeysNotConfigured
from jobtier.store.faults import FAILOVER, failing_over

log = logging.getLogger("jobtier.api")

PROBLEM = "application/problem+json"

TITLES = {
    "bad-request": "Bad request",
    "invalid-json": "Malformed JSON",
    "validation": "Invalid request",
    "payload-too-large": "Request too large",
    "uri-too-long": "URL too long",
    "headers-too-large": "Request headers too large",
    "unauthorized": "Missing or unknown API key",
    "forbidden": "Not allowed",
    "not-found": "Not found",
    "method-not-allowed": "Method not allowed",
    "unsupported-media-type": "Unsupported media type",
    "conflict": "Conflict",
    "gone": "No longer kept",
    "idempotency-conflict": "Idempotency key reused with a different request",
    "wrong-state": "Not possible in the job's state",
    "unique-held": "Its unique key is held by another job",
    "not-relayed-yet": "The job is still in the outbox",
    "queue-limited": "The queue's limits are for Python workers",
    "rate-limited": "Too many requests",
    "throttled": "Throttled by its key",
    "tenant-limit": "Too many waiting jobs for this tenant",
    "overloaded": "Service overloaded",
    "shed": "Submits of this priority are shed under load",
    "unavailable": "Service unavailable",
    "failing-over": "A Redis node is failing over",
    "replicas-unconfirmed": "Not confirmed by enough Redis replicas in time",
    "internal": "Internal error",
    "encryption": "An encrypted value cannot be opened",
    "encryption-keys-missing": "This server lacks the encryption key configuration it needs",
}


class Problem(Exception):
    """Raise in a handler to answer with a problem document."""

    def __init__(
        self,
        status: int,
        slug: str,
        detail: str,
        *,
        headers: Mapping[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.slug = slug
        self.detail = detail
        self.headers = headers
        self.extra = extra

    def document(self) -> dict[str, Any]:
        return {
            "type": f"urn:jobtier:problem:{self.slug}",
            "title": TITLES.get(self.slug, self.slug),
            "status": self.status,
            "detail": self.detail,
            **self.extra,
        }

    def response(self) -> Response:
        return Response(
            orjson.dumps(self.document()), self.status, headers=self.headers, media_type=PROBLEM
        )


def not_found(what: str) -> Problem:
    return Problem(404, "not-found", f"{what} not found")


HTTP_SLUGS = {
    400: "bad-request",
    401: "unauthorized",
    403: "forbidden",
    404: "not-found",
    405: "method-not-allowed",
    413: "payload-too-large",
    415: "unsupported-media-type",
}


async def on_problem(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, Problem)
    return exc.response()


async def on_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    slug = HTTP_SLUGS.get(exc.status_code, "bad-request")
    detail = str(exc.detail)
    if exc.status_code == 404:
        path = request.url.path
        detail = f"no route {path}"
        if (bare := _without_slash(request)) is not None:
            if request.method in ("GET", "HEAD"):  # a page or a read: where it is, for a browser
                query = request.url.query
                return RedirectResponse(f"{bare}?{query}" if query else bare, 307)
            # a write is not sent again to another address behind the client's back: a 307
            # would be (by a client that follows it), or answered with an empty body
            detail += f"; did you mean {bare} (without the trailing slash)?"
    return Problem(exc.status_code, slug, detail, headers=exc.headers).response()


def _without_slash(request: Request) -> str | None:
    """The request's path without its trailing slash, when a route answers that one (as
    Starlette's ``redirect_slashes`` would redirect to, switched off: see ``create_app``)."""
    path = request.url.path
    if len(path) < 2 or not path.endswith("/"):
        return None
    scope = {**request.scope, "path": path.rstrip("/")}
    for route in request.app.router.routes:
        if route.matches(scope)[0] != Match.NONE:
            return str(scope["path"])
    return None


# a backing service is down or restarting: the client should retry, the server is fine
UNAVAILABLE: tuple[type[BaseException], ...] = (
    RedisConnectionError,  # BusyLoadingError (a restarted Redis loading its AOF) too
    RedisTimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError,
    OSError,
)
# what Postgres raises when it is down or restarting: routes that read it answer pg_unavailable
PG_DOWN: tuple[type[BaseException], ...] = (
    OSError,  # TimeoutError too
    asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError,
    asyncpg.InterfaceError,
)
RETRY_SOON = {"retry-after": "2"}
RETRY_FAILOVER = {"retry-after": "1"}


@contextlib.contextmanager
def postgres_or_503(logged: bool = False) -> Iterator[None]:
    """A 503 if Postgres is down within the block (``logged``: and a log line)."""
    try:
        yield
    except PG_DOWN as exc:
        if logged:
            log.warning("event=postgres_unavailable error=%r", exc)
        detail = "Postgres is unavailable; try again"
        raise Problem(503, "unavailable", detail, headers=RETRY_SOON) from None


def secret_missing(exc: Exception) -> Problem:
    """A callback given while the tenant has no webhook signing secret."""
    return Problem(409, "webhook-secret-missing", str(exc), field="callback")


async def on_unavailable(request: Request, exc: Exception) -> Response:
    """503 with Retry-After, logged in one line: an expected, passing condition."""
    path = request.url.path
    if failing_over(exc):
        return await on_failover(request, exc)
    log.warning("event=backend_unavailable method=%s path=%s error=%r", request.method, path, exc)
    detail = "a backing service is unavailable; try again"
    if isinstance(exc, BusyLoadingError):
        detail = "Redis is loading its data after a restart; try again"
    return Problem(503, "unavailable", detail, headers=RETRY_SOON).response()


async def on_failover(request: Request, exc: Exception) -> Response:
    """A Redis failover under way: 503 with Retry-After, logged in one line. On a cluster
    only the requests for the shards of the lost master get it, until its replica is
    promoted; with sentinels every request, until they name the new master."""
    path = request.url.path
    node = getattr(exc, "last_failed_node_name", None)
    log.warning(
        "event=redis_failing_over method=%s path=%s node=%s error=%r",
        request.method, path, node or "-", exc,
    )  # fmt: skip
    detail = "the Redis node serving this request's shard is failing over; try again"
    return Problem(503, "failing-over", detail, headers=RETRY_FAILOVER).response()


async def on_keys_not_configured(request: Request, exc: Exception) -> Response:
    """A job to encrypt and no JOBTIER_ENCRYPTION_KEYS here: the server's configuration is
    at fault, not the request (nothing was written)."""
    log.warning("event=encryption_keys_missing path=%s error=%s", request.url.path, exc)
    return Problem(503, "encryption-keys-missing", str(exc)).response()


async def on_client_gone(request: Request, exc: Exception) -> Response:
    """The client went away before its request's body arrived: nothing was done, nobody
    reads an answer; one line, not an internal error."""
    log.info("event=client_disconnected method=%s path=%s", request.method, request.url.path)
    return Problem(400, "bad-request", "the client disconnected before its body arrived").response()


async def on_error(request: Request, exc: Exception) -> Response:
    if isinstance(exc, UNAVAILABLE):
        return await on_unavailable(request, exc)
    if failing_over(exc):
        return await on_failover(request, exc)
    log.exception("event=internal_error method=%s path=%s", request.method, request.url.path)
    return Problem(500, "internal", "the server failed to handle this request").response()


def status_answered(exc: BaseException) -> int:
    """The status ``HANDLERS`` answer an exception raised out of a route with (what the audit
    records of an action that raised it: api/audit.py)."""
    if isinstance(exc, Problem):
        return exc.status
    if isinstance(exc, HTTPException):
        return exc.status_code
    if isinstance(exc, ClientDisconnect):
        return 400
    if isinstance(exc, (KeysNotConfigured, *UNAVAILABLE)) or failing_over(exc):
        return 503
    return 500


# The unavailable classes get a handler of their own: Starlette's `Exception` handler re-raises
# for the server to log, a full traceback for every request made while Redis restarts.
HANDLERS: dict[Any, Any] = {
    Problem: on_problem,
    HTTPException: on_http_exception,
    **dict.fromkeys(UNAVAILABLE, on_unavailable),
    **dict.fromkeys(FAILOVER, on_failover),
    RedisClusterException: on_error,  # a failover (CLUSTER_TOPOLOGY) or a defect
    # a connection closed under a call (connection_closed_under_it) is one of these: a
    # failover's 503, answered without Starlette re-raising it for the server to log
    # again; any other is a defect, logged once by on_error with its traceback
    RuntimeError: on_error,
    AttributeError: on_error,
    KeysNotConfigured: on_keys_not_configured,
    ClientDisconnect: on_client_gone,
    Exception: on_error,
}
