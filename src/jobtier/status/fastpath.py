"""Plain ``GET /v1/jobs/{id}`` answered in raw ASGI, ahead of all of Starlette
(``app.JobtierApp`` calls it first)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

from starlette.types import Receive, Scope, Send

from jobtier.core.errors import JobNotFound
from jobtier.status.answer import status_answer
from jobtier.status.reader import NOTHING, StatusReader

ErrorAnswer = Callable[[Scope, Receive, Send, Exception], Awaitable[None]]
"""Sends the app's answer to an error: ``JobNotFound`` is the 404 problem of a status read."""

_JOBS = "/v1/jobs/"
_JOBS_LEN = len(_JOBS)


def status_headers(
    headers: Iterable[tuple[bytes, bytes]],
) -> tuple[bytes | None, bytes | None, int]:
    """(Authorization, If-None-Match, size of all the headers) in one pass over the raw
    headers; the first of each wins, as in ``raw_header()``."""
    authorization = held = None
    size = 0
    for name, value in headers:
        size += len(name) + len(value)
        if name == b"authorization":
            if authorization is None:
                authorization = value
        elif name == b"if-none-match" and held is None:
            held = value
    return authorization, held, size


class StatusFastPath:
    """Answers the plain status read as the route does (``status_answer``), and declines
    (``None`` from :meth:`match`) everything else, which the app then serves: no or an
    unknown API key (401), a query string (long-poll), paths that are not a job id, other
    methods, a URL or headers over the app's limits. ``errors`` answers its errors as the
    app does (a 503 while Redis is down).

    A Response object and Starlette's middleware are a sizeable share of a read's CPU: a
    near-cache hit here runs no coroutine of its own and sends two raw ASGI messages.
    """

    __slots__ = ("errors", "max_header_bytes", "max_headers", "max_url_bytes", "tenant_of")

    def __init__(
        self,
        tenant_of: Callable[[bytes | None], str | None],
        errors: ErrorAnswer,
        *,
        max_url_bytes: int,
        max_headers: int,
        max_header_bytes: int,
    ) -> None:
        self.tenant_of = tenant_of  # of an Authorization header; None: the app's 401
        self.errors = errors
        self.max_url_bytes = max_url_bytes
        self.max_headers = max_headers
        self.max_header_bytes = max_header_bytes

    def match(self, scope: Scope) -> tuple[str, str, bytes | None] | None:
        """(job id, tenant, If-None-Match) of a status read this path answers, else None."""
        if (
            scope["type"] == "http"
            and scope["method"] == "GET"
            and not scope["query_string"]
            and not scope.get("root_path")
        ):
            path: str = scope["path"]
            job_id = path[_JOBS_LEN:]
            if path.startswith(_JOBS) and job_id and "/" not in job_id and job_id != "batch":
                headers = scope["headers"]
                # the limits cost one addition a header here, in the pass that finds ours
                authorization, held, size = status_headers(headers)
                tenant = self.tenant_of(authorization)
                if (
                    tenant is not None
                    and size <= self.max_header_bytes
                    and len(headers) <= self.max_headers
                    and len(scope.get("raw_path") or path) <= self.max_url_bytes
                ):
                    return job_id, tenant, held
        return None

    async def answer(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        job_id: str,
        tenant: str,
        held: bytes | None,
    ) -> None:
        """Send the answer to a request :meth:`match` accepted."""
        started = False
        try:
            reader: StatusReader = scope["state"]["reader"]
            entry = reader.near_hit(job_id)
            if entry is not None:
                doc = entry.doc
                start = status_answer(tenant, held, entry.tenant, doc, entry.version)
            else:
                owner, doc, version = await reader.load(job_id) or NOTHING
                start = status_answer(tenant, held, owner, doc, version)
            started = True
            if start is None:
                await self.errors(scope, receive, send, JobNotFound(job_id))
                return
            await send(start)
            await send(
                {"type": "http.response.body", "body": doc if start["status"] == 200 else b""}
            )
        except Exception as exc:
            if started:  # the answer is on its way (the client went away): the server's
                raise
            await self.errors(scope, receive, send, exc)
