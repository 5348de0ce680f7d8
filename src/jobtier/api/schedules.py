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
from starlette.routing import Route

from jobtier.api import openapi as oa
from jobtier.api.auth import tenant_of
from jobtier.api.http import JSON, decode_body, read_json_body
from jobtier.api.problems import Problem, not_found
from jobtier.config import Settings
from jobtier.errors import InvalidRequest
from jobtier.persist.schedule_store import DuplicateName, ScheduleStore
from jobtier.schedules import (
    SCHEDULE_ID_RE,
    CronMirror,
    Schedule,
    ScheduleSpec,
    mirror_def,
    new_schedule_id,
    now_ms,
    to_datetime,
    validate,
)

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


def _encode(schedule: Schedule, status: int = 200) -> Response:
    return Response(msgspec.json.encode(schedule), status, media_type=JSON)


def _schedule_id(request: Request) -> str:
    schedule_id: str = request.path_params["schedule_id"]
    if not SCHEDULE_ID_RE.fullmatch(schedule_id):
        raise not_found(f"schedule {schedule_id[:40]}")
    return schedule_id


async def _with_redis_times(request: Request, schedules: list[Schedule]) -> list[Schedule]:
    """Next and last firing as the scheduler keeps them (fresher than Postgres's copy)."""
    times = await _mirror(request).times([s.id for s in schedules])
    out = []
    for s in schedules:
        if s.id in times:
            nxt, last, _ = times[s.id]
            s = msgspec.structs.replace(
                s, next_fire_at=to_datetime(nxt), last_fired_at=to_datetime(last) or s.last_fired_at
            )
        out.append(s)
    return out


async def create(request: Request) -> Response:
    tenant = tenant_of(request)
    settings: Settings = request.state.settings
    spec: ScheduleSpec = decode_body(
        _spec_decoder, await read_json_body(request, request.state.body_limit)
    )
    try:
        payload = validate(spec, settings.min_schedule_interval, settings.max_payload_bytes)
        # its jobs' queue and attempts: the spec's, else the task's (as its workers advertise)
        queue, max_attempts = await request.state.queue.task_defaults(
            spec.type, spec.queue, spec.max_attempts, spec.payload
        )
    except InvalidRequest as exc:
        raise Problem(422, "validation", str(exc), field=exc.field) from None
    created = now_ms()
    schedule = Schedule(
        id=new_schedule_id(), tenant=tenant, name=spec.name, type=spec.type, payload=spec.payload,
        priority=spec.priority, max_attempts=max_attempts, queue=queue, cron=spec.cron,
        timezone=spec.timezone, interval=spec.interval, misfire=spec.misfire, paused=spec.paused,
        next_fire_at=None, last_fired_at=None, created_at=to_datetime(created) or datetime.now(UTC),
        updated_at=to_datetime(created) or datetime.now(UTC),
    )  # fmt: skip
    definition = mirror_def(schedule, settings.default_max_attempts)
    next_ms = None if spec.paused else definition.timing().next_after(created)
    schedule = msgspec.structs.replace(schedule, next_fire_at=to_datetime(next_ms))
    store = _store(request)
    try:
        schedule = await store.insert(schedule, payload)
    except DuplicateName:
        raise Problem(
            409, "conflict", f"a schedule named {spec.name!r} exists already", field="name"
        ) from None
    try:
        await _mirror(request).put(schedule.id, definition, payload, next_ms, spec.paused)
    except Exception:
        await store.delete(schedule.id, tenant)  # nothing half-made stays behind
        raise
    return _encode(schedule, 201)


async def list_schedules(request: Request) -> Response:
    tenant = tenant_of(request)
    after = request.query_params.get("after", "")
    limit_raw = request.query_params.get("limit", "100")
    if not limit_raw.isdigit() or not 1 <= int(limit_raw) <= 1000:
        raise Problem(400, "bad-request", "limit must be between 1 and 1000", field="limit")
    limit = int(limit_raw)
    schedules = await _with_redis_times(
        request, await _store(request).for_tenant(tenant, after, limit)
    )
    next_after = schedules[-1].name if len(schedules) == limit else None
    return Response(msgspec.json.encode(ScheduleList(schedules, next_after)), media_type=JSON)


async def get(request: Request) -> Response:
    tenant = tenant_of(request)
    found = await _store(request).get(_schedule_id(request), tenant)
    if found is None:
        raise not_found(f"schedule {request.path_params['schedule_id']}")
    return _encode((await _with_redis_times(request, [found]))[0])


async def _set_paused(request: Request, paused: bool) -> Response:
    tenant = tenant_of(request)
    schedule_id = _schedule_id(request)
    store = _store(request)
    found = await store.get(schedule_id, tenant)
    if found is None:
        raise not_found(f"schedule {schedule_id}")
    settings: Settings = request.state.settings
    definition = mirror_def(found, settings.default_max_attempts)
    # a resumed schedule starts from its next slot: the paused time is not caught up
    next_ms = None if paused else definition.timing().next_after(now_ms())
    updated = await store.set_paused(schedule_id, tenant, paused, to_datetime(next_ms))
    if updated is None:
        raise not_found(f"schedule {schedule_id}")
    payload = msgspec.json.encode(found.payload)
    await _mirror(request).put(schedule_id, definition, payload, next_ms, paused)
    return _encode((await _with_redis_times(request, [updated]))[0])


async def pause(request: Request) -> Response:
    return await _set_paused(request, True)


async def resume(request: Request) -> Response:
    return await _set_paused(request, False)


async def delete(request: Request) -> Response:
    tenant = tenant_of(request)
    schedule_id = _schedule_id(request)
    store = _store(request)
    if await store.get(schedule_id, tenant) is None:
        raise not_found(f"schedule {schedule_id}")
    await _mirror(request).remove(schedule_id)  # first: it must not fire again
    await store.delete(schedule_id, tenant)
    return Response(status_code=204)


routes = [
    Route("/v1/schedules", create, methods=["POST"]),
    Route("/v1/schedules", list_schedules, methods=["GET"]),
    Route("/v1/schedules/{schedule_id}", get, methods=["GET"]),
    Route("/v1/schedules/{schedule_id}", delete, methods=["DELETE"]),
    Route("/v1/schedules/{schedule_id}/pause", pause, methods=["POST"]),
    Route("/v1/schedules/{schedule_id}/resume", resume, methods=["POST"]),
]

_SCHEDULE_ID = {
    "name": "schedule_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": SCHEDULE_ID_RE.pattern},
}
_ERRORS: dict[str, Any] = {
    "404": oa.problem("unknown schedule (or another tenant's)"),
    "503": oa.problem("Postgres unavailable"),
    **oa.AUTH_ERRORS,
}
OPENAPI_PATHS: dict[str, Any] = {
    "/v1/schedules": {
        "post": {
            "summary": "Create a recurring schedule (cron in a time zone, or a fixed interval)",
            "requestBody": {"required": True, "content": {"application/json": {"schema": oa.ref("ScheduleSpec")}}},
            "responses": {
                "201": oa.json_response("Schedule", "created"),
                "400": oa.problem("malformed JSON"),
                "409": oa.problem("the tenant has a schedule of this name"),
                "422": oa.problem("bad cron expression, time zone, interval, …"),
                **oa.AUTH_ERRORS,
            },
        },
        "get": {
            "summary": "The tenant's schedules by name",
            "parameters": [
                {"name": "after", "in": "query", "schema": {"type": "string"}},
                {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 1000}},
            ],
            "responses": {"200": oa.json_response("ScheduleList", "a page"), "400": oa.problem("bad limit"), **oa.AUTH_ERRORS},
        },
    },
    "/v1/schedules/{schedule_id}": {
        "get": {"summary": "One schedule", "parameters": [_SCHEDULE_ID], "responses": {"200": oa.json_response("Schedule", "the schedule"), **_ERRORS}},
        "delete": {"summary": "Delete a schedule: it fires no more", "parameters": [_SCHEDULE_ID], "responses": {"204": {"description": "deleted"}, **_ERRORS}},
    },
    "/v1/schedules/{schedule_id}/pause": {
        "post": {"summary": "Pause: no firing until resumed", "parameters": [_SCHEDULE_ID], "responses": {"200": oa.json_response("Schedule", "paused"), **_ERRORS}},
    },
    "/v1/schedules/{schedule_id}/resume": {
        "post": {"summary": "Resume from the next slot (the paused time is not caught up)", "parameters": [_SCHEDULE_ID], "responses": {"200": oa.json_response("Schedule", "resumed"), **_ERRORS}},
    },
}  # fmt: skip
OPENAPI_TYPES: list[type] = [ScheduleSpec, Schedule, ScheduleList]
