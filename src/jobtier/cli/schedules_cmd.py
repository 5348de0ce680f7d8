"""``jobtier schedules``: a tenant's recurring schedules through the HTTP API (a tenant's
key): the list, one, a change, a run now, pause, resume and delete. A schedule is named by
its id or by its name. Connection, keys, ``--json`` and exit codes as ``jobtier jobs``
(manage.py)."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import msgspec

from jobtier.cli.manage import (
    TENANT,
    CommandError,
    _connection,
    positive_int,
    run,
    short_time,
    status_block,
    table,
)
from jobtier.core.model import Priority
from jobtier.core.names import ULID_RE

if TYPE_CHECKING:
    from jobtier.client import Client
    from jobtier.core.schedule import Schedule

COLUMNS = ("ID", "NAME", "TYPE", "WHEN", "NEXT FIRE", "LAST FIRED", "PAUSED")
MISFIRES = ("skip", "fire_once", "fire_all")


def _when(s: Schedule) -> str:
    if s.cron is not None:
        return f"{s.cron} ({s.timezone})"
    return f"every {s.interval} s"


def _row(s: Schedule) -> list[object]:
    last = short_time(s.last_fired_at)
    paused = "yes" if s.paused else "no"
    nxt = "ended" if _ended(s) else short_time(s.next_fire_at)
    return [s.id, s.name, s.type, _when(s), nxt, last, paused]


def _shown(s: Schedule, a: argparse.Namespace) -> Any:
    return s if a.json else table(COLUMNS, [_row(s)])


def _id(c: Client, ref: str) -> str:
    """The schedule ``ref`` names: its id, or the id of the tenant's schedule of that name
    (the tenant's schedules read a page at a time until it is found)."""
    from jobtier.client import NotFound
    from jobtier.client._schedules import named_op

    if ULID_RE.fullmatch(ref):
        try:
            return c.schedule(ref).id
        except NotFound:
            pass  # a name that looks like an id
    found = c._run(named_op(ref))
    # neither a name nor an id of its: the API's 404 (exit 1)
    return found.id if found is not None else c.schedule(ref).id


def schedules_list(c: Client, a: argparse.Namespace) -> Any:
    found = c.schedules(after=a.after or "", limit=a.limit)
    if a.json:
        return found
    if not found:
        return "no schedules"
    more = [f"more: --after {found[-1].name}"] if len(found) == a.limit else []
    return "\n".join([table(COLUMNS, map(_row, found)), *more])


def schedules_show(c: Client, a: argparse.Namespace) -> Any:
    s = c.schedule(_id(c, a.schedule))
    if a.json:
        return s
    payload = msgspec.json.encode(s.payload).decode()
    attempts = "-" if s.max_attempts is None else s.max_attempts
    return "\n".join(
        [
            f"id:          {s.id}",
            f"name:        {s.name}",
            f"type:        {s.type}",
            f"queue:       {s.queue or 'default'}",
            f"when:        {_when(s)}",
            f"misfire:     {s.misfire}",
            f"paused:      {'yes' if s.paused else 'no'}",
            f"from:        {short_time(s.start_at)}",
            f"until:       {short_time(s.end_at)}",
            f"next fire:   {_next(s)}",
            f"last fired:  {short_time(s.last_fired_at)}",
            f"priority:    {s.priority}",
            f"attempts:    {attempts}",
            f"payload:     {payload}",
        ]
    )


def _ended(s: Schedule) -> bool:
    """Past its last slot: no next firing, not paused, an end (docs/schedules.md)."""
    return s.next_fire_at is None and not s.paused and s.end_at is not None


def _next(s: Schedule) -> str:
    if _ended(s):
        return "- (ended: no slot left before its end)"
    return short_time(s.next_fire_at)


def _date(text: str) -> list[datetime | None]:
    """``--start-at``/``--end-at``: an ISO 8601 time (UTC when it has no offset), or ``none``
    for no such date; a list, since None is a value too."""
    if text.strip().lower() == "none":
        return [None]
    try:
        value = datetime.fromisoformat(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither an ISO 8601 time (2027-01-01T09:00:00Z) nor 'none'"
        ) from None
    return [value if value.tzinfo else value.replace(tzinfo=UTC)]


def _payload(text: str) -> Any:
    try:
        return msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None


def schedules_update(c: Client, a: argparse.Namespace) -> Any:
    names = ("name", "type", "cron", "interval", "timezone", "misfire", "priority", "queue")
    changes: dict[str, Any] = {n: getattr(a, n) for n in names if getattr(a, n) is not None}
    if a.payload is not None:
        changes["payload"] = a.payload[0]
    if a.max_attempts is not None:
        changes["max_attempts"] = a.max_attempts
    for date in ("start_at", "end_at"):
        if getattr(a, date) is not None:
            changes[date] = getattr(a, date)[0]
    if a.task_defaults:
        changes.update(queue=None, max_attempts=None)
    if a.task_defaults and (a.queue is not None or a.max_attempts is not None):
        raise CommandError("--task-defaults sets the queue and attempts: not with either")
    if not changes:
        raise CommandError("nothing to change: give at least one option (see --help)")
    return _shown(c.update_schedule(_id(c, a.schedule), **changes), a)


def schedules_run(c: Client, a: argparse.Namespace) -> Any:
    done = c.run_schedule(_id(c, a.schedule), idempotency_key=a.idempotency_key)
    if a.json:
        return done.job
    said = "submitted" if done.created else "already submitted with this key"
    return "\n".join([f"{said}:", *status_block(done.job)])


def schedules_pause(c: Client, a: argparse.Namespace) -> Any:
    return _shown(c.pause_schedule(_id(c, a.schedule)), a)


def schedules_resume(c: Client, a: argparse.Namespace) -> Any:
    return _shown(c.resume_schedule(_id(c, a.schedule)), a)


def schedules_delete(c: Client, a: argparse.Namespace) -> Any:
    if not a.yes:
        raise CommandError(f"this deletes {a.schedule} and it fires no more: give --yes")
    schedule_id = _id(c, a.schedule)
    c.delete_schedule(schedule_id)
    return {"deleted": schedule_id} if a.json else f"deleted {schedule_id}"


def add_commands(sub: Any) -> None:
    """Add ``schedules`` to the ``jobtier`` parser."""
    p = sub.add_parser(
        "schedules",
        help="recurring schedules: list, show, change, run now, pause, resume, delete",
        description="A tenant's recurring schedules through the HTTP API (--url/JOBTIER_URL) "
        "with that tenant's key (--key/JOBTIER_KEY). A SCHEDULE is its id or its name. "
        "Without an action: the list.",
    )
    _connection(p, TENANT)
    group = p.add_subparsers(dest="action", metavar="[ACTION]")
    p.set_defaults(func=run, handler=schedules_list, action="list", after=None, limit=100)

    def action(name: str, handler: Any, help: str) -> argparse.ArgumentParser:
        q: argparse.ArgumentParser = group.add_parser(name, help=help, description=help)
        _connection(q, TENANT)
        q.set_defaults(func=run, handler=handler, action=name)
        if name != "list":
            q.add_argument("schedule", metavar="SCHEDULE", help="its id or its name")
        return q

    q = action("list", schedules_list, "the tenant's schedules by name")
    q.add_argument("--after", metavar="NAME", help="those named after NAME (the next page)")
    q.add_argument("--limit", type=positive_int, default=100, help="most schedules (100)")
    action("show", schedules_show, "one schedule: its timing, next and last firing, payload")
    q = action(
        "update",
        schedules_update,
        "change the options given; its slots start anew from now when --cron, --interval, "
        "--timezone or a date change, else its next firing is kept",
    )
    q.add_argument("--name", help="a new name")
    q.add_argument("--type", help="another task")
    q.add_argument("--cron", help="a five-field cron expression (replaces an interval)")
    q.add_argument("--interval", type=positive_int, help="seconds (replaces a cron)")
    q.add_argument("--timezone", help="an IANA time zone for the cron, e.g. Europe/Paris")
    q.add_argument("--misfire", choices=MISFIRES, help="what missed slots fire")
    q.add_argument("--priority", choices=[p.value for p in Priority])
    q.add_argument("--queue", help="the queue of its jobs")
    q.add_argument("--max-attempts", type=positive_int, help="attempts of its jobs")
    for date, what in (("start", "no slot before it"), ("end", "no slot after it")):
        q.add_argument(
            f"--{date}-at",
            type=_date,
            metavar="WHEN",
            help=f"{what}: an ISO 8601 time (UTC without an offset), or 'none' for no {date}"
            + (" (an interval's slots are counted from it)" if date == "start" else ""),
        )
    q.add_argument(
        "--task-defaults",
        action="store_true",
        help="its jobs' queue and attempts the task's again (not with --queue, --max-attempts)",
    )
    q.add_argument(
        "--payload",
        type=lambda text: [_payload(text)],  # a list: JSON null is a payload too
        metavar="JSON",
        help="its jobs' payload, as JSON",
    )
    q = action(
        "run",
        schedules_run,
        "submit one job of it now, as its slots' (paused or not; its slots do not change)",
    )
    q.add_argument(
        "--idempotency-key", metavar="KEY", help="a run sent again with it makes no second job"
    )
    action("pause", schedules_pause, "no firing until resumed")
    action("resume", schedules_resume, "fire again from the next slot (no catching up)")
    q = action("delete", schedules_delete, "delete it: it fires no more")
    q.add_argument("--yes", action="store_true", help="delete it: it cannot be undone")
