"""Limits the app enforces on every request, each answered with a problem document.

URL and header sizes: the HTTP servers refuse requests past limits of their own, without a
problem document; the app's limits are set below those, so every too-large request the
server lets through is refused here as a problem document (README, "HTTP API").

JSON nesting: a decoder recursing through a body nested a thousand deep raises
``RecursionError``; ``check_depth`` refuses such a body first, with the limit in the answer
(core/json_depth.py).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from jobtier.api.problems import Problem
from jobtier.core.json_depth import MAX_JSON_DEPTH, nests_deeper

MAX_URL_BYTES = 4096
"""Path plus query string, as sent (percent-encoded)."""
MAX_HEADER_BYTES = 8192
"""All header names and values together."""
MAX_HEADERS = 64


class RequestLimits:
    """ASGI middleware: a URL or headers over the app's limits get a 414 or 431 problem
    before the router runs. The status fast path (status/fastpath.py), ahead of the whole
    app, leaves a request over the limits to it."""

    __slots__ = ("app",)

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            problem = too_large(scope)
            if problem is not None:
                await problem.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def too_large(scope: Scope) -> Problem | None:
    """The 414/431 problem for a request over the app's limits, or None."""
    raw_path = scope.get("raw_path") or scope["path"].encode()
    url = len(raw_path) + len(scope["query_string"])
    if url > MAX_URL_BYTES:
        return Problem(414, "uri-too-long", f"the URL is {url} bytes; the limit is {MAX_URL_BYTES}")
    headers = scope["headers"]
    size = sum(len(name) + len(value) for name, value in headers)
    if len(headers) > MAX_HEADERS:
        detail = f"the request has {len(headers)} headers; the limit is {MAX_HEADERS}"
    elif size > MAX_HEADER_BYTES:
        detail = f"the headers are {size} bytes; the limit is {MAX_HEADER_BYTES}"
    else:
        return None
    return Problem(431, "headers-too-large", detail)


def check_depth(body: bytes) -> None:
    """A 422 problem if ``body`` nests arrays and objects deeper than ``MAX_JSON_DEPTH``."""
    if nests_deeper(body):
        raise too_deep()


def too_deep() -> Problem:
    """The 422 for a body nested deeper than ``MAX_JSON_DEPTH`` (also for one the decoder
    failed on for its depth: malformed, it escapes ``nests_deeper``'s count)."""
    detail = f"the body nests arrays and objects deeper than the limit of {MAX_JSON_DEPTH} levels"
    return Problem(422, "validation", detail, limit=MAX_JSON_DEPTH)
