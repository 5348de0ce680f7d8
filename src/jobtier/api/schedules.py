"""Recurring schedules (tenant-scoped): create, list, get, change, pause, resume, run now,
delete.

Postgres holds the definitions; Redis holds the copy the scheduler fires from. Writes go to
Postgres first on create (the durable record exists before anything can fire) and to Redis
first on delete (nothing fires once Postgres no longer lists it). A change (pause and resume
too) holds Postgres's row locked until Redis's copy is written, and is rolled back if Redis
refuses it. The scheduler restores a schedule Redis lost from Postgres.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from jobtier.api import spec as oa
from jobtier.api.audit import audited, tenant_actor
from jobtier.api.auth import raw_header, tenant_of
from jobtier.api.http import decode_body, encoded, invalid, path_id, read_json_body
from jobtier.api.jobs import submit_one
from jobtier.api.params import limit_param, matching, parse_query
from jobtier.api.problems import Problem, not_found
from jobtier.config import Settings
from jobtier.core.errors import InvalidRequest
from jobtier.core.model import JobSpec
from jobtier.core.names import (
    QUEUE_NAME_RE,
    SCHEDULE_NAME_RE,
    TASK_NAME_RE,
    ULID_RE,
)
from jobtier.core.schedule import (
    CRON_FIELDS,
    DATES_RANGE,
    MAX_ATTEMPTS,
    MAX_INTERVAL,
    Schedule,
    ScheduleChange,
    ScheduleSpec,
    cron_problem,
    validate,
)
from jobtier.engine.cron import CronMirror, mirror_def, new_schedule_id, now_ms, to_datetime
from jobtier.persist.schedule_store import Busy, DuplicateName, Locked, ScheduleStore, revision

_spec_decoder = msgspec.json.Decoder(ScheduleSpec)
_change_decoder = msgspec.json.Decoder(ScheduleChange)


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


def _audited(request: Request, action: str, tenant: str, schedule_id: str) -> Any:
    """A tenant's change to a schedule, in the audit as an admin action is (api/audit.py)."""
    return audited(request, action, schedule_id, tenant_actor(request, tenant))


async def create(request: Request) -> Response:
    tenant = tenant_of(request)
    schedule_id = new_schedule_id()
    async with _audited(request, "schedule.create", tenant, schedule_id) as outcome:
        made = await _create(request, tenant, schedule_id)
        outcome.status, outcome.detail = 201, {"name": made.name}
    return encoded(made, 201)


async def _create(request: Request, tenant: str, schedule_id: str) -> Schedule:
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
    schedule = Schedule(**given, id=schedule_id, tenant=tenant)
    definition = mirror_def(schedule, settings.default_max_attempts)
    first = definition.timing().next_after(created)
    store = _store(request)
    if first is None:  # (a change may end a schedule so: it is a create's mistake)
        if await store.named(tenant, spec.name):  # the name's conflict first (upsert_schedule)
            raise _duplicate(spec.name)
        detail = "the schedule would never fire: no slot between now (or start_at) and end_at"
        raise Problem(422, "validation", detail, field="end_at")
    next_ms = None if spec.paused else first
    schedule = msgspec.structs.replace(schedule, next_fire_at=to_datetime(next_ms))
    try:
        schedule = await store.insert(schedule, payload)
    except DuplicateName:
        raise _duplicate(spec.name) from None
    try:
        rev = revision(schedule)
        await _mirror(request).put(schedule.id, definition, payload, next_ms, spec.paused, rev)
    except Exception:
        await store.delete(schedule.id, tenant)  # nothing half-made stays behind
        raise
    return schedule


def _duplicate(name: str) -> Problem:
    return Problem(409, "conflict", f"a schedule named {name!r} exists already", field="name")


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


Made = tuple[Schedule, bytes, bool]  # a change: the schedule, its payload JSON, slots anew


@asynccontextmanager
async def _locked(request: Request, tenant: str) -> AsyncIterator[Locked]:
    """The path's schedule, its row locked until the block ends (``ScheduleStore.locked``):
    a 404 for another tenant's or none, a 503 while another change holds it too long."""
    schedule_id = path_id(request, "schedule_id", ULID_RE, "schedule")
    try:
        async with _store(request).locked(schedule_id, tenant) as locked:
            if locked is None:
                raise not_found(f"schedule {schedule_id}")
            yield locked
    except Busy:
        detail = f"schedule {schedule_id} is being changed by another request; send it again"
        raise Problem(503, "unavailable", detail, headers={"retry-after": "1"}) from None


async def _change(request: Request, make: Callable[[Schedule], Awaitable[Made]]) -> Schedule:
    """Change the path's schedule as ``make`` says (from the schedule as it is): the schedule,
    its payload's JSON and whether its slots start again from now (else its next firing is
    left as Redis has it). Postgres's row is locked until Redis's copy is written too, so
    that two changes land in the same order in both; Redis refusing the copy (written in one
    step: cron_put.lua) rolls the row back, and a copy whose row's commit then failed has
    another revision than the row, which the scheduler's reconcile writes again."""
    settings: Settings = request.state.settings
    mirror = _mirror(request)
    async with _locked(request, tenant_of(request)) as locked:
        schedule, payload, anew = await make(locked.schedule)
        definition = mirror_def(schedule, settings.default_max_attempts)
        next_ms, keep = None, False
        if not schedule.paused:
            kept = None if anew else (await mirror.times([schedule.id])).get(schedule.id)
            end = definition.end_ms
            if kept and kept[0] is not None and not kept[2] and (end is None or kept[0] <= end):
                next_ms, keep = kept[0], True  # (a firing may advance it meanwhile)
            else:
                next_ms = definition.timing().next_after(now_ms())
        try:
            saved = await locked.save(schedule, payload, to_datetime(next_ms))
        except DuplicateName:
            detail = f"a schedule named {schedule.name!r} exists already"
            raise Problem(409, "conflict", detail, field="name") from None
        rev = revision(saved)
        await mirror.put(saved.id, definition, payload, next_ms, saved.paused, rev, keep_next=keep)
    return saved


async def _set_paused(request: Request, paused: bool) -> Response:
    async def make(found: Schedule) -> Made:
        if not paused and found.cron is not None and (problem := cron_problem(found.cron)):
            # made before such a cron was refused (paused: its first slot was never asked for)
            raise Problem(422, "validation", f"cannot resume: {problem}", field="cron")
        # a resumed schedule starts from its next slot: the paused time is not caught up
        changed = msgspec.structs.replace(found, paused=paused)
        return changed, msgspec.json.encode(found.payload), not paused

    tenant, schedule_id = _path(request)
    async with _audited(
        request, "schedule.pause" if paused else "schedule.resume", tenant, schedule_id
    ) as outcome:
        saved = await _change(request, make)
        response = await _one(request, saved)
        outcome.detail = {"name": saved.name}
    return response


async def update(request: Request) -> Response:
    settings: Settings = request.state.settings
    change = ScheduleChange()  # (decoded in the audited block: a bad body is recorded too)

    async def make(found: Schedule) -> Made:
        sent = change.given()
        try:
            spec = change.applied(found)
            payload = validate(spec, settings.min_schedule_interval, settings.max_payload_bytes)
            queue, max_attempts = await request.state.queue.produce.task_defaults(
                spec.type, spec.queue, spec.max_attempts, spec.payload
            )
        except InvalidRequest as exc:
            if exc.field == "end_at" and "end_at" not in sent and "start_at" in sent:
                # the rule names what the request sent: its start, after the schedule's end
                end = found.end_at.isoformat() if found.end_at else ""
                exc = InvalidRequest(f"start_at must be before end_at ({end})", field="start_at")
            raise invalid(exc) from None
        given = msgspec.structs.asdict(spec) | {"queue": queue, "max_attempts": max_attempts}
        changed = msgspec.structs.replace(found, **given)
        moved = change.moves_timing(found, spec)
        if moved and "end_at" not in sent:  # checked as a create is; an end_at may end it
            timing = mirror_def(changed, settings.default_max_attempts).timing()
            if timing.next_after(now_ms()) is None:
                timed = ("start_at", "cron", "interval", "timezone")
                field = next((f for f in timed if f in sent), "end_at")
                detail = f"with this {field} the schedule has no slot between now and its end_at"
                raise Problem(422, "validation", detail, field=field)
        # slots anew when they move, or when it is resumed (the paused time not caught up)
        return changed, payload, moved or (found.paused and not spec.paused)

    tenant, schedule_id = _path(request)
    async with _audited(request, "schedule.change", tenant, schedule_id) as outcome:
        change = decode_body(_change_decoder, await read_json_body(request))
        saved = await _change(request, make)
        response = await _one(request, saved)  # what is answered is what is recorded
        outcome.detail = {"name": saved.name, "fields": sorted(change.given())}
    return response


async def run_now(request: Request) -> Response:
    """One job from the schedule now, as its slots' are made (type, payload, priority, queue,
    attempts), whether it is paused or not; its slots do not change. The answer is a
    submit's."""
    tenant, schedule_id = _path(request)
    async with _audited(request, "schedule.run", tenant, schedule_id) as outcome:
        name, response = await _run(request)
        job = response.headers.get("location", "").rpartition("/")[2]
        outcome.status = response.status_code
        outcome.detail = {"name": name, "job_id": job, "created": response.status_code == 202}
    return response


async def _run(request: Request) -> tuple[str, Response]:
    tenant, found = await _found(request)
    if (await read_json_body(request)).strip() not in (b"", b"{}"):
        detail = "a run takes no body: its job is the schedule's (change the schedule first)"
        raise Problem(400, "bad-request", detail)
    header = raw_header(request, b"idempotency-key")
    key = None
    if header is not None:
        key = header.decode("latin-1")
        if not RUN_KEY_RE.fullmatch(key):
            detail = f"Idempotency-Key must match {RUN_KEY_RE.pattern}"
            raise Problem(400, "bad-request", detail, field="idempotency_key")
        key = f"{RUN_KEY_PREFIX}{found.id}:{key}"  # the schedule's own: not a submit's key
    spec = JobSpec(
        type=found.type,
        payload=found.payload,
        priority=found.priority,
        max_attempts=found.max_attempts,
        queue=found.queue,
        idempotency_key=key,
    )
    return found.name, await submit_one(request, tenant, spec)


async def pause(request: Request) -> Response:
    return await _set_paused(request, True)


async def resume(request: Request) -> Response:
    return await _set_paused(request, False)


async def delete(request: Request) -> Response:
    tenant, schedule_id = _path(request)
    async with _audited(request, "schedule.delete", tenant, schedule_id) as outcome:
        # locked as a change is: a change under way is waited for, not undone by its Redis
        # write
        async with _locked(request, tenant) as locked:
            await _mirror(request).remove(locked.schedule.id)  # first: it must not fire again
            await locked.delete()
        outcome.status, outcome.detail = 204, {"name": locked.schedule.name}
    return Response(status_code=204)


def _path(request: Request) -> tuple[str, str]:
    """The request's tenant and the path's schedule id (a 404 for a malformed one, before the
    audit's block: not recorded, as for the admin routes)."""
    return tenant_of(request), path_id(request, "schedule_id", ULID_RE, "schedule")


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
    paths.add(
        f"PATCH {one}",
        update,
        "Change a schedule: the fields given (its slots start anew from now when its cron, "
        "interval or time zone change, or it is resumed; else its next firing is kept)",
        oa.returns(200, "Schedule", "changed"),
        unknown,
        oa.refuses(409, "the tenant has another schedule of this name"),
        (413, oa.too_large(s, oa.payload_too_large(s))),
        body="ScheduleChange",
    )
    paths.add(
        f"POST {one}/run",
        run_now,
        "Run the schedule now: one job as its slots make (paused or not; its slots do not "
        "change). The answer is a submit's",
        oa.returns(202, "JobStatus", "created", _LOCATION),
        oa.returns(200, "JobStatus", "a repeat of an earlier run with its Idempotency-Key"),
        unknown,
        oa.refuses(400, "a body (a run takes none), or a malformed Idempotency-Key"),
        oa.refuses(
            409,
            "the Idempotency-Key was used for a run of this schedule as it was before a change "
            "(job_id)",
        ),
        oa.refuses(410, "the Idempotency-Key names a job that is no longer kept (job_id)"),
        oa.refuses(422, "the schedule's payload no longer fits its task's payload type"),
        oa.refuses(429, "the tenant's rate limit or waiting-jobs cap", oa.RETRY_AFTER),
        headers=[RUN_KEY],
    )
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


_LOCATION = {"Location": oa.header("the job's URL", required=True)}
# a run's Idempotency-Key is its schedule's: the job's key is the prefix, the schedule's id,
# a colon and it, within IDEMPOTENCY_KEY_RE's 200 characters
RUN_KEY_PREFIX = "schedule:"
RUN_KEY_CHARS = 200 - len(RUN_KEY_PREFIX) - 26 - 1
RUN_KEY_RE = re.compile(rf"^[\x21-\x7e]{{1,{RUN_KEY_CHARS}}}$")
RUN_KEY = {
    "name": "Idempotency-Key",
    "in": "header",
    "description": "a run of this schedule sent again with the same key makes no second job "
    "(the key is the schedule's own: the same key on another schedule or a submit is another "
    "request)",
    "schema": {"type": "string", "pattern": RUN_KEY_RE.pattern},
}


def constrain(components: dict[str, Any], settings: Settings) -> None:
    """The rules ``validate`` checks that JSON Schema can state, on the generated schema."""
    c = components
    for name in ("ScheduleSpec", "ScheduleChange"):
        oa.constrain(c, name, "name", pattern=SCHEDULE_NAME_RE.pattern)
        oa.constrain(c, name, "type", pattern=TASK_NAME_RE.pattern)
        oa.constrain(c, name, "queue", pattern=QUEUE_NAME_RE.pattern)
        oa.constrain(c, name, "max_attempts", minimum=1, maximum=MAX_ATTEMPTS)
        interval = settings.min_schedule_interval
        oa.constrain(c, name, "interval", minimum=interval, maximum=MAX_INTERVAL)
        for date in ("start_at", "end_at"):
            oa.constrain(c, name, date, format="date-time")
        c[name]["properties"]["start_at"]["description"] = (
            "no slot before it (an interval's slots are counted from it); with a time zone, "
            f"{DATES_RANGE}"
        )
        c[name]["properties"]["end_at"]["description"] = (
            f"no slot after it; after start_at, with a time zone, {DATES_RANGE} (a create, or a "
            "change of the slots, that leaves no slot from now on is refused; a change of "
            "end_at may end a schedule)"
        )
    c["ScheduleChange"]["minProperties"] = 1
    c["ScheduleSpec"]["description"] = (
        "A schedule as a client defines it: exactly one of cron and interval "
        "(seconds, from JOBTIER_MIN_SCHEDULE_INTERVAL). cron: five fields, each values, "
        "ranges a-b and steps /n within the field's range — "
        + ", ".join(f"{name} {low}-{high}" for name, low, high, _ in CRON_FIELDS)
        + " (steps from 1 to the field's highest value; months and weekdays may be named); "
        "timezone an IANA name; payload at "
        f"most {settings.max_payload_bytes} bytes (JOBTIER_MAX_PAYLOAD_BYTES)."
    )


OPENAPI_TYPES: list[type] = [ScheduleSpec, ScheduleChange, Schedule, ScheduleList]
