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
    """Ready while Redis answers: submits, status reads and workers' claims need nothing else.
    Postgres (reachable, its migrations applied), when configured, is reported, not required:
    while it is away only listings, history and search answer 503, and a load balancer that
    took every API process out of service for it would stop all of those too. Its problem
    makes the status ``degraded``."""
    checks: dict[str, Any] = {}
    status = "ok"
    try:
        await request.state.queue.redis.ping()
        checks["redis"] = "ok"
    except Exception as exc:
        status = "unavailable"
        checks["redis"] = f"error: {exc}"
    probe = request.state.postgres_ready
    if probe is not None:
        problem = await probe()
        checks["postgres"] = problem or "ok"
        if problem is not None and status == "ok":
            status = "degraded"
    body = orjson.dumps({"status": status, "checks": checks})
    return Response(body, 503 if status == "unavailable" else 200, media_type=JSON)
