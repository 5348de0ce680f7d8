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
    """Ready while Redis answers and Postgres, when configured, has this jobtier's migrations
    (its queries need them: a new image before ``jobtier migrate`` is not ready). Postgres
    away (unreachable, or no answer within a second) is reported, as status
    ``degraded``, not required: submits, status reads and workers' claims need only Redis,
    and a load balancer that took every API process out of service for an outage would stop
    those too."""
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
        problem = await probe()  # within a second (api/records.py)
        checks["postgres"] = problem or "ok"
        if problem is None:
            pass
        elif not problem.startswith("unreachable"):  # (records.py: migrations not applied)
            status = "unavailable"
        elif status == "ok":
            status = "degraded"
    body = orjson.dumps({"status": status, "checks": checks})
    return Response(body, 503 if status == "unavailable" else 200, media_type=JSON)
