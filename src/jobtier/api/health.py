"""Liveness and readiness."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from jobtier.api.http import JSON


async def healthz(request: Request) -> Response:
    """The process is up and serving."""
    return Response(b'{"status":"ok"}', media_type=JSON)


async def readyz(request: Request) -> Response:
    """Redis answers (and Postgres with its migrations applied, when configured)."""
    checks: dict[str, Any] = {}
    ok = True
    try:
        await request.state.queue.redis.ping()
        checks["redis"] = "ok"
    except Exception as exc:
        ok = False
        checks["redis"] = f"error: {exc}"
    probe = request.state.postgres_ready
    if probe is not None:
        problem = await probe()
        checks["postgres"] = problem or "ok"
        ok = ok and problem is None
    body = orjson.dumps({"status": "ok" if ok else "unavailable", "checks": checks})
    return Response(body, 200 if ok else 503, media_type=JSON)
