"""A recurring schedule as a client defines it, and its validation.

A schedule creates a normal job at each of its slots: a five-field cron expression in a time
zone, or a fixed interval. Missed slots (no scheduler ran) follow the schedule's misfire
policy once the first is more than ``JOBTIER_CRON_MISFIRE_GRACE_SECONDS`` late: ``skip``
fires nothing for them, ``fire_once`` the latest once, ``fire_all`` each (at most
``MAX_CATCH_UP``). Firing is ``engine/cron.py``'s.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import msgspec
from msgspec import UNSET, UnsetType

from jobtier.core.errors import InvalidRequest, PayloadTooLarge
from jobtier.core.model import Priority, encode_json
from jobtier.core.names import SCHEDULE_NAME_RE, TASK_NAME_RE

Misfire = Literal["skip", "fire_once", "fire_all"]
MAX_CATCH_UP = 1000
MAX_INTERVAL = 366 * 86400  # seconds
MAX_ATTEMPTS = 100
# a schedule's dates: within what timestamptz and a slot's millisecond arithmetic both hold
DATES_FROM = datetime(2000, 1, 1, tzinfo=UTC)
DATES_TO = datetime(9000, 1, 1, tzinfo=UTC)  # (a slot a year on is still a datetime)
DATES_RANGE = f"between {DATES_FROM:%Y-%m-%d} and {DATES_TO:%Y-%m-%d}"  # (messages, docs)

_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
# The five cron fields: name, lowest and highest value, and the names allowed for values.
CRON_FIELDS = (
    ("minute", 0, 59, ()),
    ("hour", 0, 23, ()),
    ("day-of-month", 1, 31, ()),
    ("month", 1, 12, _MONTHS),
    ("day-of-week", 0, 7, ("sun", "mon", "tue", "wed", "thu", "fri", "sat")),
)
_CRON_ITEM = re.compile(r"^(\*|[0-9A-Za-z]+(?:-[0-9A-Za-z]+)?)(?:/([0-9]+))?$")


def cron_problem(expression: str) -> str | None:
    """What is wrong with a five-field cron expression (naming the field and its range), or
    None. Each field is a comma-separated list of ``*``, ``a``, ``a-b``, each with an optional
    ``/step`` (1 to the field's highest value); months and weekdays may be named (``jan``,
    ``mon``); day-of-week 0 and 7 are Sunday; ``L`` in day-of-month and ``a#n`` in day-of-week
    are accepted as croniter reads them."""
    fields = expression.split()
    if len(fields) != 5:
        return (
            f"cron {expression[:100]!r} has {len(fields)} fields; it needs five "
            "(minute hour day-of-month month day-of-week)"
        )
    for text, (name, low, high, names) in zip(fields, CRON_FIELDS, strict=True):
        where = f"cron {name} field {text[:40]!r}"
        span = f"{low}-{high}" + (f" or {names[0]}-{names[-1]}" if names else "")
        for item in text.split(","):
            if name == "day-of-month" and item.upper() == "L":
                continue
            if name == "day-of-week" and re.fullmatch(r"[0-7]#[1-5]", item):
                continue
            m = _CRON_ITEM.fullmatch(item)
            if m is None:
                return f"{where}: {item[:20]!r} is not *, a value, a range a-b, or one with /step"
            base, step = m.group(1), m.group(2)
            if step is not None and not 1 <= int(step) <= high:
                return f"{where}: step {step} is out of range 1-{high}"
            if base == "*":
                continue
            bounds = base.split("-")
            values = []
            for value in bounds:
                if value.isdigit():
                    number = int(value)
                elif value.lower() in names:
                    number = names.index(value.lower()) + low
                else:
                    return f"{where}: {value[:20]!r} is not a value in {span}"
                if not low <= number <= high:
                    return f"{where}: {value} is out of range {span}"
                values.append(number)
            if len(values) == 2 and values[0] > values[1]:
                return f"{where}: the range {base} runs backwards"
    from croniter import CroniterBadDateError, croniter  # only where a schedule is checked

    if not croniter.is_valid(expression):
        return f"cron {expression[:100]!r} is not an expression croniter can read"
    try:
        croniter(expression, datetime.now(UTC)).get_next(datetime)
    except CroniterBadDateError:
        return f"cron {expression[:100]!r} never fires: no date matches it (such as 30 February)"
    return None


class ScheduleSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A schedule as a client defines it (the body of ``POST /v1/schedules``)."""

    name: str
    type: str
    payload: Any = None
    priority: Priority = Priority.NORMAL
    max_attempts: int | None = None
    cron: str | None = None
    timezone: str = "UTC"
    interval: int | None = None  # seconds
    misfire: Misfire = "fire_once"
    paused: bool = False
    queue: str | None = None  # the task's queue when not given
    # no slot before start_at nor after end_at (an interval's slots counted from its start)
    start_at: datetime | None = None
    end_at: datetime | None = None


class ScheduleChange(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What ``PATCH /v1/schedules/{id}`` changes: the fields given, each as ``ScheduleSpec``'s
    (a field left out keeps its value). ``max_attempts`` and ``queue`` given as null go back
    to the task's; ``cron`` given alone replaces an ``interval``, and ``interval`` a
    ``cron``."""

    name: str | UnsetType = UNSET
    type: str | UnsetType = UNSET
    payload: Any = UNSET
    priority: Priority | UnsetType = UNSET
    max_attempts: int | UnsetType | None = UNSET
    cron: str | UnsetType | None = UNSET
    timezone: str | UnsetType = UNSET
    interval: int | UnsetType | None = UNSET
    misfire: Misfire | UnsetType = UNSET
    paused: bool | UnsetType = UNSET
    queue: str | UnsetType | None = UNSET
    start_at: datetime | UnsetType | None = UNSET
    end_at: datetime | UnsetType | None = UNSET

    def given(self) -> dict[str, Any]:
        """The fields given, by name."""
        return {f: v for f in self.__struct_fields__ if (v := getattr(self, f)) is not UNSET}

    def applied(self, current: Schedule) -> ScheduleSpec:
        """``current`` with these changes, as a spec to validate. The task's queue and
        attempts (null) are left to the caller, which knows the task."""
        given = self.given()
        if not given:
            raise InvalidRequest("give at least one field to change")
        if "cron" in given and "interval" not in given and given["cron"] is not None:
            given["interval"] = None
        if "interval" in given and "cron" not in given and given["interval"] is not None:
            given["cron"] = None
        if given.get("type", current.type) != current.type:  # the new task's, unless given
            given.setdefault("queue", None)
            given.setdefault("max_attempts", None)
        kept = {f: getattr(current, f) for f in ScheduleSpec.__struct_fields__}
        return ScheduleSpec(**(kept | given))

    def moves_timing(self, current: Schedule, spec: ScheduleSpec) -> bool:
        """Whether the schedule's slots change: its cron, interval, time zone or start. (A
        new end keeps the next firing when it is not after it: api/schedules.py.)"""
        before = (current.cron, current.interval, current.timezone, current.start_at)
        return before != (spec.cron, spec.interval, spec.timezone, spec.start_at)


class Schedule(msgspec.Struct, kw_only=True):
    """A stored schedule, as the API returns it."""

    id: str
    tenant: str
    name: str
    type: str
    payload: Any
    priority: Priority
    max_attempts: int | None
    cron: str | None
    timezone: str
    interval: int | None
    misfire: Misfire
    paused: bool
    next_fire_at: datetime | None
    last_fired_at: datetime | None
    created_at: datetime
    updated_at: datetime
    queue: str | None = None  # None: `default` (a schedule from before queues)
    start_at: datetime | None = None
    end_at: datetime | None = None


def validate(spec: ScheduleSpec, min_interval: int, max_payload: int) -> bytes:
    """Check a spec; returns its payload as JSON. Raises ``InvalidRequest`` naming the field.
    (An ``end_at`` already past is the caller's to judge: a change may end a schedule now.)"""
    if not SCHEDULE_NAME_RE.fullmatch(spec.name):
        raise InvalidRequest(f"name must match {SCHEDULE_NAME_RE.pattern}", field="name")
    if not TASK_NAME_RE.fullmatch(spec.type):
        raise InvalidRequest(f"type must match {TASK_NAME_RE.pattern}", field="type")
    if spec.cron is not None and spec.interval is not None:
        raise InvalidRequest("give cron or interval, not both", field="cron")
    if spec.cron is None and spec.interval is None:
        raise InvalidRequest("give cron (a cron expression) or interval (seconds)", field="cron")
    if spec.cron is not None:
        problem = cron_problem(spec.cron)
        if problem is not None:
            raise InvalidRequest(problem, field="cron")
    if spec.interval is not None and spec.interval < min_interval:
        raise InvalidRequest(f"interval must be at least {min_interval} s", field="interval")
    if spec.interval is not None and spec.interval > MAX_INTERVAL:
        raise InvalidRequest("interval must be at most a year", field="interval")
    try:
        ZoneInfo(spec.timezone)
    except (ZoneInfoNotFoundError, ValueError, OSError):  # OSError: a folder of zones, a long name
        raise InvalidRequest(
            f"unknown time zone {spec.timezone[:60]!r}", field="timezone"
        ) from None
    for field in ("start_at", "end_at"):
        at = getattr(spec, field)
        if at is not None and at.tzinfo is None:
            raise InvalidRequest(f"{field} needs a time zone (e.g. a trailing Z)", field=field)
        if at is not None and not DATES_FROM <= at <= DATES_TO:
            raise InvalidRequest(f"{field} must be {DATES_RANGE}", field=field)
    if spec.start_at is not None and spec.end_at is not None and spec.end_at <= spec.start_at:
        raise InvalidRequest("end_at must be after start_at", field="end_at")
    if spec.max_attempts is not None and not 1 <= spec.max_attempts <= MAX_ATTEMPTS:
        raise InvalidRequest(
            f"max_attempts must be between 1 and {MAX_ATTEMPTS}", field="max_attempts"
        )
    try:
        payload = encode_json(spec.payload)
    except TypeError as exc:
        raise InvalidRequest(f"payload: {exc}", field="payload") from None
    if len(payload) > max_payload:
        raise PayloadTooLarge(
            f"payload is {len(payload)} bytes; the limit is {max_payload} "
            "(JOBTIER_MAX_PAYLOAD_BYTES)",
            field="payload",
        )
    return payload
