"""Recurring schedules (tenant-scoped): create, list, get, pause, resume, delete.

Postgres holds the definitions; Redis holds the copy the scheduler fires from. Writes go to
Postgres first on create (the durable record exists before anything can fire) and to Redis
first on delete (nothing fires once Postgres no longer lists it). The scheduler reconciles
the two, so a write that reached only one of them is repaired.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from jobtier.api import spec as oa
from jobtier.api.auth import tenant_of
from jobtier.api.http import decode_body, encoded, invalid, path_id, read_json_body
from jobtier.api.params import limit_param, matching, parse_query
from jobtier.api.problems import Problem, not_found
from jobtier.config import Settings
from jobtier.core.errors import InvalidRequest
from jobtier.core.names import QUEUE_NAME_RE, SCHEDULE_NAME_RE, TASK_NAME_RE, ULID_RE
from jobtier.core.schedule import (
    CRON_FIELDS,
    MAX_ATTEMPTS,
    MAX_INTERVAL,
    Schedule,
    ScheduleSpec,
    cron_problem,
    validate,
)
from jobtier.engine.cron import CronMirror, mirror_def, new_schedule_id, now_ms, to_datetime
from jobtier.persist.schedule_store import DuplicateName, ScheduleStore

_spec_decoder = msgspec.json.Decoder(ScheduleSpec)


class ScheduleList(msgspec.Struct):
    schedules: list[Schedule]
    next_after: str | None


def _store(request: Request) -> ScheduleStore:
    store: ScheduleStore = request.state.schedule_store
    return store


def _mirror(request: Request) -> CronMirror:
    mirror: CronMirror = request.state.cron
    return mirror


async def _with_redis_times(request: Request, schedules: list[Schedule]) -> list[Schedule]:
    """Next and last firing as the scheduler keeps them (fresher than Postgres's copy)."""
    times = await _mirror(request).times([s.id for s in schedules])
    out = []
    for s in schedules:
        if s.id in times:
            nxt, last, _ = times[s.id]
            last_fired = to_datetime(last) or s.last_fired_at
            s = msgspec.structs.replace(s, next_fire_at=to_datetime(nxt), last_fired_at=last_fired)
        out.append(s)
    return out


LIST_PARAMS = [
    matching("after", "the next_after of the previous page", SCHEDULE_NAME_RE, 100),
    limit_param("most schedules per page (default 100)", 1000),
]


async def create(request: Request) -> Response:
    tenant = tenant_of(request)
    settings: Settings = request.state.settings
    spec: ScheduleSpec = decode_body(_spec_decoder, await read_json_body(request))
    try:
        payload = validate(spec, settings.min_schedule_interval, settings.max_payload_bytes)
        # its jobs' queue and attempts: the spec's, else the task's (as its workers advertise)
        queue, max_attempts = await request.state.queue.produce.task_defaults(
            spec.type, spec.queue, spec.max_attempts, spec.payload
        )
    except InvalidRequest as exc:
        raise invalid(exc) from None
    created = now_ms()
    at = to_datetime(created) or datetime.now(UTC)
    given = msgspec.structs.asdict(spec) | {"queue": queue, "max_attempts": max_attempts}
    given |= {"next_fire_at": None, "last_fired_at": None, "created_at": at, "updated_at": at}
    schedule = Schedule(**given, id=new_schedule_id(), tenant=tenant)
    definition = mirror_def(schedule, settings.default_max_attempts)
    next_ms = None if spec.paused else definition.timing().next_after(created)
    schedule = msgspec.structs.replace(schedule, next_fire_at=to_datetime(next_ms))
    store = _store(request)
    try:
        schedule = await store.insert(schedule, payload)
    except DuplicateName:
        detail = f"a schedule named {spec.name!r} exists already"
        raise Problem(409, "conflict", detail, field="name") from None
    try:
        await _mirror(request).put(schedule.id, definition, payload, next_ms, spec.paused)
    except Exception:
        await store.delete(schedule.id, tenant)  # nothing half-made stays behind
        raise
    return encoded(schedule, 201)


async def list_schedules(request: Request) -> Response:
    tenant = tenant_of(request)
    query = parse_query(request, LIST_PARAMS)
    after: str = query.get("after", "")
    limit: int = query.get("limit", 100)
    schedules = await _with_redis_times(
        request, await _store(request).for_tenant(tenant, after, limit)
    )
    next_after = schedules[-1].name if len(schedules) == limit else None
    return encoded(ScheduleList(schedules, next_after))


async def _found(request: Request) -> tuple[str, Schedule]:
    """The tenant and the path's schedule: a 404 for another tenant's, or a malformed id."""
    tenant = tenant_of(request)
    schedule_id = path_id(request, "schedule_id", ULID_RE, "schedule")
    found = await _store(request).get(schedule_id, tenant)
    if found is None:
        raise not_found(f"schedule {schedule_id}")
    return tenant, found


async def _one(request: Request, schedule: Schedule) -> Response:
    return encoded((await _with_redis_times(request, [schedule]))[0])


async def get(request: Request) -> Response:
    _, found = await _found(request)
    return await _one(request, found)


async def _set_paused(request: Request, paused: bool) -> Response:
    tenant, found = await _found(request)
    settings: Settings = request.state.settings
    definition = mirror_def(found, settings.default_max_attempts)
    if not paused and found.cron is not None and (problem := cron_problem(found.cron)):
        # made before such a cron was refused (paused: its first slot was never asked for)
        raise Problem(422, "validation", f"cannot resume: {problem}", field="cron")
    # a resumed schedule starts from its next slot: the paused time is not caught up
    next_ms = None if paused else definition.timing().next_after(now_ms())
    updated = await _store(request).set_paused(found.id, tenant, paused, to_datetime(next_ms))
    if updated is None:
        raise not_found(f"schedule {found.id}")
    payload = msgspec.json.encode(found.payload)
    await _mirror(request).put(found.id, definition, payload, next_ms, paused)
    return await _one(request, updated)


async def pause(request: Request) -> Response:
    return await _set_paused(request, True)


async def resume(request: Request) -> Response:
    return await _set_paused(request, False)


async def delete(request: Request) -> Response:
    tenant, found = await _found(request)
    await _mirror(request).remove(found.id)  # first: it must not fire again
    await _store(request).delete(found.id, tenant)
    return Response(status_code=204)


def operations(settings: Settings) -> oa.Paths:
    """The schedule routes of the OpenAPI document."""
    s = settings
    paths = oa.Paths(s)
    unknown = oa.unknown("schedule")
    paths.add(
        "POST /v1/schedules",
        create,
        "Create a recurring schedule (cron in a time zone, or a fixed interval)",
        oa.returns(201, "Schedule", "created"),
        oa.refuses(409, "the tenant has a schedule of this name"),
        (413, oa.too_large(s, oa.payload_too_large(s))),
        body="ScheduleSpec",
    )
    paths.add(
        "GET /v1/schedules",
        list_schedules,
        "The tenant's schedules by name",
        oa.page("ScheduleList", "next_after"),
        params=LIST_PARAMS,
    )
    one = "/v1/schedules/{schedule_id}"
    paths.add(
        f"GET {one}", get, "One schedule", oa.returns(200, "Schedule", "the schedule"), unknown
    )
    paths.add(f"DELETE {one}", delete, "Delete a schedule: it fires no more", oa.DELETED, unknown)
    paused = oa.returns(200, "Schedule", "paused")
    paths.add(f"POST {one}/pause", pause, "Pause: no firing until resumed", paused, unknown)
    paths.add(
        f"POST {one}/resume",
        resume,
        "Resume from the next slot (the paused time is not caught up)",
        oa.returns(200, "Schedule", "resumed"),
        unknown,
    )
    return paths


def constrain(components: dict[str, Any], settings: Settings) -> None:
    """The rules ``validate`` checks that JSON Schema can state, on the generated schema."""
    c = components
    oa.constrain(c, "ScheduleSpec", "name", pattern=SCHEDULE_NAME_RE.pattern)
    oa.constrain(c, "ScheduleSpec", "type", pattern=TASK_NAME_RE.pattern)
    oa.constrain(c, "ScheduleSpec", "queue", pattern=QUEUE_NAME_RE.pattern)
    oa.constrain(c, "ScheduleSpec", "max_attempts", minimum=1, maximum=MAX_ATTEMPTS)
    oa.constrain(
        c, "ScheduleSpec", "interval", minimum=settings.min_schedule_interval, maximum=MAX_INTERVAL
    )
    c["ScheduleSpec"]["description"] = (
        "A schedule as a client defines it: exactly one of cron and interval "
        "(seconds, from JOBTIER_MIN_SCHEDULE_INTERVAL). cron: five fields, each values, "
        "ranges a-b and steps /n within the field's range — "
        + ", ".join(f"{name} {low}-{high}" for name, low, high, _ in CRON_FIELDS)
        + " (steps from 1 to the field's highest value; months and weekdays may be named); "
        "timezone an IANA name; payload at "
        f"most {settings.max_payload_bytes} bytes (JOBTIER_MAX_PAYLOAD_BYTES)."
    )


OPENAPI_TYPES: list[type] = [ScheduleSpec, Schedule, ScheduleList]
