"""Queue routes (admin key): every queue's state, pause and resume, flow limits (each change
audited: audit.py), and the task catalogue (what the workers run)."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import orjson
from starlette.requests import Request
from starlette.responses import Response

from jobtier.api.audit import audited
from jobtier.api.auth import require_admin
from jobtier.api.http import JSON, decode_body, encoded, invalid, read_json_body
from jobtier.api.problems import Problem
from jobtier.core.errors import InvalidRequest
from jobtier.core.model import QueueLimits
from jobtier.core.names import QUEUE_NAME_RE
from jobtier.engine.catalog import TaskCatalog
from jobtier.engine.queue import Queue
from jobtier.engine.queue_admin import no_counts

_limits_decoder = msgspec.json.Decoder(QueueLimits)
# a queue Redis has no counts for: known by its limits or a task's advert
_NO_COUNTS = no_counts()


def queue_name(request: Request) -> str:
    """The ``{name}`` of the path: a 422 problem unless it is a valid queue name."""
    name: str = request.path_params["name"]
    if not QUEUE_NAME_RE.fullmatch(name):
        raise invalid(
            InvalidRequest(f"queue name must match {QUEUE_NAME_RE.pattern}", field="name")
        )
    return name


async def queue_states(
    queue: Queue,
    catalog: TaskCatalog | None,
    *,
    stats: dict[str, Any] | None = None,
    ages: dict[tuple[str, str], float] | None = None,
    workers: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Every known queue: a queue with jobs, limits, or a task that names it. ``stats``,
    ``ages`` and ``workers`` are read from Redis unless given (the dashboard's frame reads
    them once for all its figures)."""
    stats = stats if stats is not None else await queue.admin.stats()
    limits = await queue.admin.limits()
    ages = ages if ages is not None else await queue.admin.oldest_queued()
    workers = workers if workers is not None else await queue.admin.live_workers()
    ads = catalog.ads() if catalog is not None else []
    out = []
    for name in sorted(set(stats["queues"]) | set(limits) | {ad.queue for ad in ads}):
        q = stats["queues"].get(name) or _NO_COUNTS
        blocked = q["blocked_until_ms"] / 1000
        oldest = max((age for (qn, _), age in ages.items() if qn == name), default=None)
        out.append(
            {
                "name": name,
                "queued": q["queued"],
                "queued_total": sum(q["queued"].values()),
                "parked": q["parked"],
                "waiting": q["waiting"],
                "running": q["running"],
                "paused": q["paused"],
                "limits": msgspec.to_builtins(limits[name]) if name in limits else None,
                "blocked_until": blocked if blocked > time.time() else None,
                "oldest_queued_age_seconds": oldest,
                "workers": sum(1 for w in workers if name in w.get("queues", ())),
                "tasks": sorted(ad.type for ad in ads if ad.queue == name),
            }
        )
    return out


async def list_queues(request: Request) -> Response:
    require_admin(request)
    states = await queue_states(request.state.queue, request.state.catalog)
    return Response(orjson.dumps({"queues": states}), media_type=JSON)


async def _set_paused(request: Request, paused: bool) -> Response:
    require_admin(request)
    name = queue_name(request)
    admin = request.state.queue.admin
    async with audited(request, "queue.pause" if paused else "queue.resume", name):
        await (admin.pause if paused else admin.resume)(name)
    return Response(orjson.dumps({"queue": name, "paused": paused}), media_type=JSON)


async def pause(request: Request) -> Response:
    return await _set_paused(request, True)


async def resume(request: Request) -> Response:
    return await _set_paused(request, False)


_LIFTED = QueueLimits()


async def set_limits(request: Request) -> Response:
    """PUT the queue's limits (``{}`` lifts them)."""
    require_admin(request)
    name = queue_name(request)
    limits: QueueLimits = decode_body(_limits_decoder, await read_json_body(request))
    if not limits.limited and limits.per != _LIFTED.per:
        # a period alone would lift every limit ({} does; clients that lift send the default
        # period): say what is missing instead
        detail = "per is the rate's period: give rate with it ({} lifts the limits)"
        raise Problem(422, "validation", detail, field="rate")
    async with audited(request, "queue.limits", name) as outcome:
        outcome.detail = msgspec.to_builtins(limits)
        try:
            await request.state.queue.admin.set_limits(name, limits)
        except InvalidRequest as exc:
            raise invalid(exc) from None
    body = {"queue": name, "limits": msgspec.to_builtins(limits) if limits.limited else None}
    return Response(orjson.dumps(body), media_type=JSON)


async def tasks(request: Request) -> Response:
    """The task catalogue: every task a live or recently seen worker runs, with its queue,
    policies and payload schema."""
    require_admin(request)
    catalog: TaskCatalog = request.state.catalog
    await catalog.load()
    return encoded({"tasks": catalog.ads()})
