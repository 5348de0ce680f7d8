"""Queue routes (admin key): every queue's state, pause and resume, flow limits (each change
audited: audit.py), and the task catalogue (what the workers run)."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import msgspec
import orjson
from starlette.requests import Request
from starlette.responses import Response

from jobtier.api import spec as oa
from jobtier.api.audit import audited
from jobtier.api.auth import require_admin
from jobtier.api.http import JSON, decode_body, encoded, invalid, read_json_body
from jobtier.api.problems import Problem
from jobtier.config import Settings
from jobtier.core.errors import InvalidRequest
from jobtier.core.model import QueueLimits
from jobtier.core.names import QUEUE_NAME_RE
from jobtier.engine.catalog import TaskCatalog
from jobtier.engine.queue import Queue
from jobtier.engine.queue_admin import no_counts
from jobtier.runtime.loop import FAULTS

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
                "held": q["held"],
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
    """``known``: whether the queue is one the listing has (jobs, workers or tasks name it):
    a mistyped name is paused all the same (a pause may come before the queue's first job),
    and the answer says so; null when the listing could not be read."""
    require_admin(request)
    name = queue_name(request)
    admin = request.state.queue.admin
    # read before the change (a paused queue is listed for its pause), and at best: a pause
    # during an incident must not fail for a shard that does not answer (known: null)
    known: bool | None = None
    with contextlib.suppress(*FAULTS):
        states = await queue_states(request.state.queue, request.state.catalog)
        known = any(q["name"] == name for q in states)
    async with audited(request, "queue.pause" if paused else "queue.resume", name):
        await (admin.pause if paused else admin.resume)(name)
    body = {"queue": name, "paused": paused, "known": known}
    return Response(orjson.dumps(body), media_type=JSON)


async def pause(request: Request) -> Response:
    return await _set_paused(request, True)


async def resume(request: Request) -> Response:
    return await _set_paused(request, False)


async def unblock(request: Request) -> Response:
    """Lift a block left by a ``RateLimited`` (or an HTTP worker's ``block_queue``) before
    its end; a pause stays (``resume`` lifts that, and only that)."""
    require_admin(request)
    name = queue_name(request)
    async with audited(request, "queue.unblock", name):
        until = await request.state.queue.admin.unblock(name)
    body = {"queue": name, "blocked_until": until / 1000 if until > time.time() * 1000 else None}
    return Response(orjson.dumps(body), media_type=JSON)


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


_LIMITS_422 = "the body does not fit its schema, or a per alone ({} lifts the limits)"


def operations(settings: Settings) -> oa.Paths:
    """The routes that change a queue, each with its description."""
    paths = oa.Paths(settings, auth="admin")
    add = paths.add
    add(
        "POST /v1/admin/queues/{name}/pause",
        pause,
        "Pause a queue: submits are accepted, nothing is claimed from it, running jobs finish",
        oa.returns(200, "QueuePaused", "paused"),
        oa.BAD_QUEUE_NAME,
    )
    add(
        "POST /v1/admin/queues/{name}/resume",
        resume,
        "Resume a paused queue (a RateLimited block stays: unblock lifts it)",
        oa.returns(200, "QueuePaused", "resumed"),
        oa.BAD_QUEUE_NAME,
    )
    add(
        "POST /v1/admin/queues/{name}/unblock",
        unblock,
        "Lift the block a task's RateLimited (or an HTTP worker's held attempt with block_queue) "
        "left on a queue, before its end: its jobs start again at once (a pause stays)",
        oa.returns(200, "QueueUnblocked", "the end of the block lifted, or null"),
        oa.BAD_QUEUE_NAME,
    )
    add(
        "PUT /v1/admin/queues/{name}/limits",
        set_limits,
        "Limit a queue across every worker (global concurrency, starts per period); {} lifts "
        "the limits",
        oa.returns(200, "QueueLimitsSet", "the limits now in force"),
        oa.refuses(422, _LIMITS_422),
        body="QueueLimits",
    )
    return paths
