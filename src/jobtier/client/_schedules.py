"""Recurring schedules (``/v1/schedules``): the operations both clients drive (``_core``'s
style, kept here: ``_core`` is at the size a module may have)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import httpx
import msgspec

from jobtier.client._core import Call, Op, check, fetch, json_call, path, query, submission
from jobtier.client._errors import Conflict
from jobtier.client._types import Submission, schedule_decoder, schedule_list_decoder
from jobtier.core.schedule import Schedule, ScheduleSpec

if TYPE_CHECKING:
    from jobtier.client._core import BaseClient


def create_op(spec: ScheduleSpec | Mapping[str, Any]) -> Op[Schedule]:
    call = json_call("POST", "/v1/schedules", spec)
    return (yield from fetch(call, schedule_decoder, "a schedule"))


def list_op(after: str, limit: int) -> Op[list[Schedule]]:
    call = Call("GET", "/v1/schedules", params=query(limit=limit, after=after or None))
    return (yield from fetch(call, schedule_list_decoder, "a schedule list")).schedules


def one_op(method: str, schedule_id: str, suffix: str = "") -> Op[Schedule]:
    call = Call(method, path("/v1/schedules", schedule_id, suffix))
    return (yield from fetch(call, schedule_decoder, "a schedule", schedule_id))


def upsert_op(spec: ScheduleSpec | Mapping[str, Any]) -> Op[Schedule]:
    """Create the schedule ``spec`` names, or make the tenant's schedule of that name ``spec``:
    every field of a ``ScheduleSpec`` as the spec gives it, or its default (the task's queue
    and attempts when not given). The name is looked up after the create's 409, a page of the
    listing at a time (``named_op``)."""
    fields = msgspec.to_builtins(spec) if isinstance(spec, ScheduleSpec) else dict(spec)
    try:
        return (yield from create_op(fields))
    except Conflict:
        pass
    full = msgspec.to_builtins(msgspec.convert(fields, ScheduleSpec))
    found = yield from named_op(full["name"])
    if found is None:
        return (yield from create_op(fields))  # deleted meanwhile: made again
    return (yield from update_op(found.id, full))


def named_op(name: str) -> Op[Schedule | None]:
    """The tenant's schedule of that name (None: none), the listing read a page at a time."""
    after = ""
    while page := (yield from list_op(after, 1000)):
        for found in page:
            if found.name == name:
                return found
        after = page[-1].name
    return None


def update_op(schedule_id: str, changes: Mapping[str, Any]) -> Op[Schedule]:
    call = json_call("PATCH", path("/v1/schedules", schedule_id), dict(changes))
    return (yield from fetch(call, schedule_decoder, "a schedule", schedule_id))


def run_op(core: BaseClient[Any], schedule_id: str, idempotency_key: str | None) -> Op[Submission]:
    """A job of the schedule now; sent again after a 429 or 503 only with a key (as a
    submit)."""
    headers = None if idempotency_key is None else {"idempotency-key": idempotency_key}
    call = Call("POST", path("/v1/schedules", schedule_id, "/run"), headers=headers)
    response = yield from core._retrying(call, safe=idempotency_key is not None)
    check(response, job_id=schedule_id, key=idempotency_key or "")
    return submission(response.status_code, response.content)


def delete_op(schedule_id: str) -> Op[None]:
    response: httpx.Response = yield Call("DELETE", path("/v1/schedules", schedule_id))
    check(response, job_id=schedule_id)
