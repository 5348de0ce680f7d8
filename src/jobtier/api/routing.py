"""One route per path: every method of a path answered by the same ``Resource``.

Starlette takes a route whose path matches but whose method does not as a partial match only,
so a later route with a parameter would win (``GET /v1/jobs/batch`` answered as the job
"batch"), and a 405 would list only the first partial match's methods in ``Allow``. A
``Resource`` matches its path for every method and answers a method it lacks with a 405
problem whose ``Allow`` names all of the path's methods, from every route list.
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.routing import BaseRoute, Match, Route, request_response
from starlette.types import ASGIApp, Receive, Scope, Send

from jobtier.api.problems import Problem


class Resource(Route):
    """All the methods of one path; ``methods`` lists them (HEAD with GET)."""

    def __init__(self, path: str, routes: Sequence[Route]) -> None:
        methods = [m for r in routes for m in r.methods or ()]
        super().__init__(path, routes[0].endpoint, methods=methods)
        self.handlers: dict[str, ASGIApp] = {}
        for route in routes:
            app = request_response(route.endpoint)
            for method in route.methods or ():
                self.handlers[method] = app
        self.allow = ", ".join(sorted(self.handlers))

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        match, child = super().matches(scope)
        # the path is ours: another route must not answer it for a method we lack
        return (Match.FULL if match is Match.PARTIAL else match), child

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.handlers.get(scope["method"])
        if handler is None:
            detail = f"{scope['method'][:16]} is not allowed on {self.path}; allowed: {self.allow}"
            raise Problem(405, "method-not-allowed", detail, headers={"allow": self.allow})
        await handler(scope, receive, send)


def resources(routes: Sequence[BaseRoute]) -> list[BaseRoute]:
    """``routes`` with those of one path merged into one ``Resource``, in the order each path
    first appears (a literal path such as ``/v1/jobs/batch`` stays ahead of
    ``/v1/jobs/{job_id}``)."""
    by_path: dict[str, list[Route]] = {}
    out: list[BaseRoute | str] = []
    for route in routes:
        if isinstance(route, Route):
            if route.path not in by_path:
                by_path[route.path] = []
                out.append(route.path)
            by_path[route.path].append(route)
        else:
            out.append(route)
    return [Resource(item, by_path[item]) if isinstance(item, str) else item for item in out]
