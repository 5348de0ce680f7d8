"""One route per path: every method of a path answered by the same ``Resource``.

Starlette takes a route whose path matches but whose method does not as a partial match only,
so a later route with a parameter would win (``GET /v1/jobs/batch`` answered as the job
"batch"), and a 405 would list only the first partial match's methods in ``Allow``. A
``Resource`` matches its path for every method and answers a method it lacks with a 405
problem whose ``Allow`` names all of the path's methods.
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.routing import Match, Route, request_response
from starlette.types import ASGIApp, Receive, Scope, Send

from jobtier.api.problems import Problem
from jobtier.api.spec import Endpoint


class Resource(Route):
    """All the methods of one path, each to its endpoint; ``methods`` lists them (HEAD with
    GET)."""

    def __init__(self, path: str, endpoints: Mapping[str, Endpoint]) -> None:
        super().__init__(path, next(iter(endpoints.values())), methods=list(endpoints))
        self.handlers: dict[str, ASGIApp] = {
            method: request_response(endpoint) for method, endpoint in endpoints.items()
        }
        if "GET" in self.handlers:  # and HEAD, as Route's methods have it
            self.handlers["HEAD"] = self.handlers["GET"]
        self.allow = ", ".join(sorted(self.handlers))

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        match, child = super().matches(scope)
        if match is Match.NONE:
            return match, child
        child["route"] = self.path  # the template, for the server span's name (server_spans.py)
        # the path is ours: another route must not answer it for a method we lack
        return Match.FULL, child

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.handlers.get(scope["method"])
        if handler is None:
            detail = f"{scope['method'][:16]} is not allowed on {self.path}; allowed: {self.allow}"
            raise Problem(405, "method-not-allowed", detail, headers={"allow": self.allow})
        await handler(scope, receive, send)


def resources(endpoints: Mapping[str, Mapping[str, Endpoint]]) -> list[Resource]:
    """A ``Resource`` for each path of ``endpoints`` (path -> method -> endpoint), a path with
    fewer parameters first: a literal segment wins over a parameter (``/v1/jobs/batch`` is
    not the job "batch", ``/v1/admin/dead-letters/replay`` not the dead letter "replay")."""
    return [Resource(p, endpoints[p]) for p in sorted(endpoints, key=lambda p: p.count("{"))]
