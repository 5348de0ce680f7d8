"""``jobtier jobs``, ``jobtier dead-letters`` and ``jobtier queues``: admin from the terminal.

They talk to the HTTP API through the Python client (``jobtier.client.Client``): ``--url`` (or
``JOBTIER_URL``, default http://127.0.0.1:8000) and ``--key``. ``jobs`` acts on one tenant's
jobs and needs that tenant's key (``--key``, else ``JOBTIER_KEY``: one of ``JOBTIER_API_KEYS``);
``dead-letters`` and ``queues`` need the admin key (``--key``, else ``JOBTIER_ADMIN_KEY``, else
``JOBTIER_KEY``), so the exports ``jobtier run`` prints serve both kinds. Each prints a
table for people, or ``--json`` one JSON document for scripts. Exit codes: 0 done, 1 the
API refused or could not be reached (the message says why), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import msgspec

from jobtier.logs import printable

if TYPE_CHECKING:
    from jobtier.client import Client
    from jobtier.core.model import JobError, JobStatus, LogLine, QueueInfo, Transition

DEFAULT_URL = "http://127.0.0.1:8000"
TENANT = "tenant"
ADMIN = "admin"
KEY_HELP = {
    TENANT: "a tenant's API key (one of the server's JOBTIER_API_KEYS)",
    ADMIN: "the admin key (the server's JOBTIER_ADMIN_KEY)",
}
# where each kind of command looks for its key when --key is not given, first found wins
KEY_ENV = {TENANT: ("JOBTIER_KEY",), ADMIN: ("JOBTIER_ADMIN_KEY", "JOBTIER_KEY")}
_RELATIVE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([smhd])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}
STATES = ("waiting", "scheduled", "queued", "running", "succeeded", "failed", "cancelled")
PRIORITIES = ("critical", "high", "normal", "low")


class CommandError(Exception):
    """A refusal or failure to print as ``jobtier <command>: <message>`` (exit 1)."""


# --- arguments ------------------------------------------------------------------------------
def since_time(text: str) -> datetime:
    """``--since``: an ISO 8601 time (UTC when it has no offset) or a span back from now,
    ``30s``, ``15m``, ``2h``, ``7d``."""
    m = _RELATIVE.fullmatch(text.strip())
    if m:
        return datetime.now(UTC) - timedelta(**{_UNITS[m.group(2)]: float(m.group(1))})
    try:
        value = datetime.fromisoformat(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither an ISO 8601 time (2024-05-01T12:00:00Z) nor a span back "
            "from now (30s, 15m, 2h, 7d)"
        ) from None
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of 1 or more")
    return int(text)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number above 0")
    return value


def _connection(p: argparse.ArgumentParser, key: str) -> None:
    p.add_argument(
        "--url",
        default=None,
        help=f"the API's address (default: JOBTIER_URL, else {DEFAULT_URL})",
    )
    default = ", else ".join(KEY_ENV[key])
    p.add_argument("--key", default=None, help=f"{KEY_HELP[key]} (default: {default})")
    p.add_argument("--json", action="store_true", help="print JSON for scripts, not a table")
    p.set_defaults(key_kind=key)


# --- output ---------------------------------------------------------------------------------
_LINE_BREAKS = re.compile("[\n\t]")


def one_line(text: object) -> str:
    """A field of one line of output, its line breaks and tabs escaped: a message cannot forge
    a row or a line of its own (its other controls are escaped as the whole output is printed:
    ``run``)."""
    return _LINE_BREAKS.sub(lambda m: "\\n" if m[0] == "\n" else "\\t", str(text))


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Left-aligned columns, two spaces apart, a header line on top; cells as ``str`` has them."""
    cells = [list(headers), *([one_line(cell) for cell in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells)
    return "\n".join(line.rstrip() for line in lines)


def short_time(value: str | datetime | None) -> str:
    if value is None:
        return "-"
    text = value.isoformat() if isinstance(value, datetime) else value
    return text.replace("+00:00", "Z")[:19].replace("T", " ")


def clock(unix: float) -> str:
    """A Unix time as the tables show times (UTC)."""
    return short_time(datetime.fromtimestamp(unix, UTC))


def clip(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def error_summary(error: JobError | None, width: int = 50) -> str:
    if error is None:
        return "-"
    return clip(f"{error.type}: {error.message}", width)


def as_json(value: Any) -> str:
    return msgspec.json.format(msgspec.json.encode(value), indent=2).decode()


def status_block(s: JobStatus) -> list[str]:
    lines = [
        f"id:          {s.id}",
        f"type:        {s.type}",
        f"queue:       {s.queue}",
        f"state:       {s.state}" + ("  (cancel requested)" if s.cancel_requested else ""),
        # no attempts set: an outbox row not relayed yet, or refused by the relay
        f"attempt:     {s.attempt} of {s.max_attempts}"
        if s.max_attempts
        else "attempt:     none: it never reached a queue",
        f"priority:    {s.priority}",
        f"created:     {short_time(s.created_at)}",
        f"updated:     {short_time(s.updated_at)}",
    ]
    if s.run_at is not None:
        lines.append(f"run at:      {short_time(s.run_at)}")
    if s.worker is not None:
        lines.append(f"worker:      {one_line(s.worker)}")
    if s.progress is not None:
        lines.append(f"progress:    {msgspec.json.encode(s.progress).decode()}")
    if s.error is not None:
        lines.append(f"error:       {one_line(s.error.type)}: {one_line(s.error.message)}")
        if s.error.traceback:
            trace = s.error.traceback.rstrip().splitlines()
            lines += ["traceback:", *("  " + one_line(t) for t in trace)]
    return lines


def log_block(lines: Sequence[LogLine]) -> list[str]:
    if not lines:
        return ["log lines:   none"]
    out = [f"log lines:   {len(lines)}"]
    out += [f"  {short_time(line.at)}  #{line.attempt}  {one_line(line.message)}" for line in lines]
    return out


def history_row(t: Transition, before: Transition | None = None) -> list[object]:
    """One row of ``jobs show``'s history; ``before`` the row above it. A change within a state
    is named for what it was: the cancel request, or a progress report."""
    change = f"{t.from_state or '-'} -> {t.to_state}"
    if t.from_state == t.to_state:
        asked = t.cancel_requested and not (before is not None and before.cancel_requested)
        if asked:
            change = "cancel requested"
        elif t.progress is not None:
            change = f"{t.to_state}: progress"
    return [t.version, short_time(t.at), change, t.worker, t.attempt, error_summary(t.error)]


def history_rows(history: Sequence[Transition]) -> list[list[object]]:
    return [history_row(t, history[i - 1] if i else None) for i, t in enumerate(history)]


def job_row(j: JobStatus) -> list[object]:
    attempt, updated = f"{j.attempt}/{j.max_attempts}", short_time(j.updated_at)
    return [j.id, j.type, j.queue, j.state, attempt, updated, error_summary(j.error)]


def queue_row(q: QueueInfo) -> list[object]:
    parts = []
    if q.limits is not None and q.limits.concurrency is not None:
        parts.append(f"concurrency {q.limits.concurrency}")
    if q.limits is not None and q.limits.rate is not None:
        parts.append(f"{q.limits.rate}/{q.limits.per:g}s")
    age = q.oldest_queued_age_seconds
    oldest = "-" if age is None else f"{age:.1f}s"
    paused = "yes" if q.paused else "no"
    blocked = "-" if q.blocked_until is None else f"until {clock(q.blocked_until)}"
    limits = ", ".join(parts) or "-"
    counts = [q.queued_total, q.running, q.parked, q.held]
    return [q.name, *counts, oldest, q.workers, paused, blocked, limits]


HISTORY = ["VERSION", "AT", "CHANGE", "BY", "ATTEMPT", "ERROR"]
JOBS = ["ID", "TYPE", "QUEUE", "STATE", "ATTEMPT", "UPDATED", "ERROR"]
QUEUES = ["QUEUE", "READY", "RUNNING", "PARKED", "HELD", "OLDEST", "WORKERS", "PAUSED", "BLOCKED",
          "LIMITS"]  # fmt: skip


# --- commands -------------------------------------------------------------------------------
def jobs_list(c: Client, a: argparse.Namespace) -> Any:
    filters = {"state": a.state, "type": a.type, "queue": a.queue, "created_after": a.since}
    page = c.list_jobs(**filters, cursor=a.cursor, limit=a.limit)
    if a.json:
        return page
    lines = [table(JOBS, map(job_row, page.jobs)) if page.jobs else "no jobs"]
    if page.next_cursor:
        lines.append(f"more: --cursor {page.next_cursor}")
    if page.lag.get("transitions"):
        lines.append(
            f"(the listing is {page.lag['transitions']:g} changes, "
            f"{page.lag.get('seconds', 0):g} s behind the live state)"
        )
    return "\n".join(lines)


def jobs_show(c: Client, a: argparse.Namespace) -> Any:
    d = c.show(a.job_id)
    if a.json:
        return d
    lines = status_block(d.status)
    if d.result_missing is not None:
        lines.append(f"result:      not available ({d.result_missing})")
    elif d.result is not None:
        lines.append(f"result:      {msgspec.json.encode(d.result).decode()}")
    lines += log_block(d.lines)
    if d.history is None:
        lines.append("history:     not available (the API has no Postgres, or it is away)")
    else:
        lines += ["history:", table(HISTORY, history_rows(d.history))]
    return "\n".join(lines)


def jobs_explain(c: Client, a: argparse.Namespace) -> Any:
    e = c.explain(a.job_id)
    if a.json:
        return e
    position = "" if e.position is None else f", position {e.position}"
    lines = [f"{e.id}: {e.state}{position} (checked {short_time(e.checked_at)})"]
    lines += [f"  {r.code}: {one_line(r.message)}" for r in e.reasons]
    return "\n".join(lines)


def jobs_logs(c: Client, a: argparse.Namespace) -> Any:
    lines = c.logs(a.job_id)
    return lines if a.json else "\n".join(log_block(lines))


def jobs_cancel(c: Client, a: argparse.Namespace) -> Any:
    s = c.cancel(a.job_id)
    if a.json:
        return s
    if s.state == "running":
        return f"{s.id}: cancel requested; its worker ({s.worker}) is stopping it"
    return f"{s.id}: {s.state}"


def jobs_retry(c: Client, a: argparse.Namespace) -> Any:
    s = c.retry(a.job_id)
    return s if a.json else f"{s.id}: {s.state} again (attempts reset)"


def jobs_change(c: Client, a: argparse.Namespace) -> Any:  # promote, priority
    s = c.promote(a.job_id) if a.action == "promote" else c.set_priority(a.job_id, a.priority)
    said = "now (was scheduled)" if a.action == "promote" else f"at priority {s.priority}"
    return s if a.json else f"{s.id}: {s.state} {said}"


def dead_list(c: Client, a: argparse.Namespace) -> Any:
    jobs = c.dead_letters(type=a.type, since=a.since, limit=a.limit)
    if a.json:
        return jobs
    return table(JOBS, map(job_row, jobs)) if jobs else "no dead letters"


def dead_show(c: Client, a: argparse.Namespace) -> Any:
    d = c.dead_letter(a.job_id)
    if a.json:
        return d
    lines = status_block(d.job)
    lines.append(f"payload:     {clip(msgspec.json.encode(d.payload).decode(), 2000)}")
    lines += log_block(d.lines)
    return "\n".join(lines)


def dead_replay(c: Client, a: argparse.Namespace) -> Any:
    if a.job_id is not None:
        if a.type is not None or a.since is not None or a.all:
            raise CommandError("give a job id or --type/--since/--all, not both")
        s = c.replay(a.job_id)
        return s if a.json else f"{s.id}: {s.state} again (attempts reset)"
    if a.type is None and a.since is None and not a.all:
        # a bulk action across every tenant is asked for by name, not reached by leaving
        # the filters out
        raise CommandError(
            "give a JOB_ID, --type and/or --since, or --all to replay every dead letter "
            f"(at most --limit of them: {a.limit})"
        )
    ids = c.replay_dead_letters(type=a.type, since=a.since, limit=a.limit, all=a.all)
    if a.json:
        return {"replayed": ids, "count": len(ids), "skipped": ids.skipped}
    held = [f"{s.id}: its unique key is held by job {s.holder}" for s in ids.skipped]
    passed = ["passed over:", *held] if held else []
    return "\n".join([f"replayed {len(ids)} job(s)", *ids, *passed])


def queues_list(c: Client, a: argparse.Namespace) -> Any:
    queues = c.queues()
    if a.json:
        return queues
    return table(QUEUES, map(queue_row, queues)) if queues else "no queues"


def queues_pause(c: Client, a: argparse.Namespace) -> Any:
    known = any(q.name == a.name for q in c.queues())
    c.pause_queue(a.name)
    if a.json:
        return {"queue": a.name, "paused": True, "known": known}
    if not known:  # a queue may be paused before its first job, but a typo reads the same
        return (
            f"{a.name}: paused (no job, limit or task had named this queue: "
            f"is {a.name!r} the name you meant? `jobtier queues` lists them)"
        )
    return f"{a.name}: paused"


def queues_resume(c: Client, a: argparse.Namespace) -> Any:
    c.resume_queue(a.name)
    return {"queue": a.name, "paused": False} if a.json else f"{a.name}: resumed"


def queues_unblock(c: Client, a: argparse.Namespace) -> Any:
    until = c.unblock_queue(a.name)
    if a.json:  # ("blocked": as before blocked_until was answered)
        return {"queue": a.name, "blocked": False, "blocked_until": until}
    if until is None:
        return f"{a.name}: was not blocked (nothing changed)"
    return f"{a.name}: unblocked (it was held until {clock(until)})"


def queues_purge(c: Client, a: argparse.Namespace) -> Any:
    if not a.yes:
        raise CommandError(
            f"this cancels every ready job of {a.name}, and cannot be undone: give --yes "
            "(`jobtier queues` counts them; pause the queue first to keep workers from "
            "taking some meanwhile)"
        )
    done = c.purge_queue(a.name)
    if a.json:
        return done
    s = "" if done.cancelled == 1 else "s"
    left = (
        f"; {done.remaining} ready now (submitted meanwhile, or let in by a concurrency key)"
        if done.remaining
        else ""
    )
    return f"{a.name}: purged, {done.cancelled} job{s} cancelled{left}"


def queues_limit(c: Client, a: argparse.Namespace) -> Any:
    if a.none and (a.concurrency is not None or a.rate is not None):
        raise CommandError("--none lifts the limits: give it alone")
    if not a.none and a.concurrency is None and a.rate is None:
        raise CommandError("give --concurrency and/or --rate (with --per), or --none")
    c.set_queue_limits(a.name, concurrency=a.concurrency, rate=a.rate, per=a.per)
    if a.json:
        limits = {"concurrency": a.concurrency, "rate": a.rate, "per": a.per}
        return {"queue": a.name, "limits": None if a.none else limits}
    if a.none:
        return f"{a.name}: no limits"
    parts = []
    if a.concurrency is not None:
        parts.append(f"at most {a.concurrency} running")
    if a.rate is not None:
        parts.append(f"at most {a.rate} starts per {a.per:g} s")
    return f"{a.name}: " + ", ".join(parts)


def queues_scaling(c: Client, a: argparse.Namespace) -> Any:
    s = c.queue_scaling(a.name, slots=a.slots, min=a.min, max=a.max, target_age=a.target_age)
    if a.json:
        return s
    age = "-" if s.oldest_age_seconds is None else f"{s.oldest_age_seconds:g} s"
    use = "-" if s.utilisation is None else f"{s.utilisation:.0%}"
    bounds = f"{s.min} to {'-' if s.max is None else s.max}"
    held = " (paused: not counted)" if s.paused else ""
    held = " (blocked: not counted)" if s.blocked_until is not None and not held else held
    rate = "-"
    if s.rate_per_second is not None:
        rate = f"{s.rate_per_second:g}/s ({s.rate_allowance} may start within the target age)"
    rows = [
        ("desired workers", f"{s.desired_workers} (by {s.decided_by})"),
        ("ready", f"{s.ready}{held}"),
        ("running", s.running),
        ("demand", s.demand),
        ("concurrency limit", "-" if s.concurrency_limit is None else s.concurrency_limit),
        ("rate limit", rate),
        ("oldest ready job", f"{age} (target {s.target_age_seconds:g} s)"),
        ("live workers", s.live_workers),
        ("slots per worker", f"{s.slots} (from {s.slots_from})"),
        ("utilisation", use),
        ("bounds", bounds),
        ("parked", s.parked),
    ]
    return "\n".join([f"queue {s.queue}", *(f"  {k:<18} {v}" for k, v in rows)])


# --- running --------------------------------------------------------------------------------
def run(args: argparse.Namespace, settings: object = None) -> int:
    """Run one admin command: connect, call, print; the errors as one line on stderr (the
    settings ``jobtier`` passes every command are not needed)."""
    import httpx

    from jobtier.client import ApiError, Client

    name = f"jobtier {args.command}" + ("" if args.action == "-" else f" {args.action}")
    url = args.url or os.environ.get("JOBTIER_URL") or DEFAULT_URL
    names = KEY_ENV[args.key_kind]
    key = args.key or next(filter(None, map(os.environ.get, names)), None)
    if not key:
        print(
            f"{name}: no API key: pass --key or set {names[0]} to {KEY_HELP[args.key_kind]}",
            file=sys.stderr,
        )
        return 2
    # one INFO line per request on stderr would bury the answer
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        with Client(url, key, timeout=30.0) as client:
            out = args.handler(client, args)
    except CommandError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    except ApiError as exc:
        hint = ""
        if exc.status == 401:
            hint = f": this command needs {KEY_HELP[args.key_kind]}"
        elif exc.status == 403:
            # the API's detail already names the key the route needs: say where the wrong one
            # came from, and where the right one goes
            source = "--key" if args.key else next(n for n in names if os.environ.get(n))
            hint = f": the key from {source} is not it (give it in --key or {names[0]})"
        detail = printable(exc.detail or exc.title)
        print(f"{name}: {detail} (HTTP {exc.status}){hint}", file=sys.stderr)
        return 1
    except httpx.HTTPError as exc:
        print(
            f"{name}: cannot reach the API at {url} ({exc}); is `jobtier api` running there? "
            "(--url or JOBTIER_URL)",
            file=sys.stderr,
        )
        return 1
    # (JSON escapes controls itself; a table's or a page's every line is made printable, a
    # line break of a message's escaped where it is written)
    print(as_json(out) if args.json else printable(out))
    return 0


Handler = Callable[["Client", argparse.Namespace], Any]


def add_commands(sub: Any) -> None:
    """Add ``jobs``, ``dead-letters`` and ``queues`` to the ``jobtier`` parser: each command
    runs ``run``."""

    def action(
        group: Any, name: str, handler: Handler, key: str, help: str
    ) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = group.add_parser(name, help=help, description=help)
        _connection(p, key)
        p.set_defaults(func=run, handler=handler, action=name)
        return p

    # jobs (a tenant's key)
    p = sub.add_parser(
        "jobs",
        help="list, show, cancel and retry jobs through the API (a tenant's key)",
        description="A tenant's jobs, through the HTTP API (--url/JOBTIER_URL) with that "
        "tenant's key (--key/JOBTIER_KEY, one of the server's JOBTIER_API_KEYS).",
    )
    group = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    q = action(group, "list", jobs_list, TENANT, "the tenant's jobs, newest first (Postgres)")
    q.add_argument("--state", choices=STATES, help="only jobs in this state")
    q.add_argument("--type", help="only jobs of this task type")
    q.add_argument("--queue", help="only jobs of this queue")
    since = "only jobs created since: ISO 8601, or 30s, 15m, 2h, 7d"
    q.add_argument("--since", type=since_time, help=since)
    q.add_argument("--limit", type=positive_int, default=20, help="most jobs (default 20)")
    q.add_argument("--cursor", help="the next page (printed under a full page)")
    for verb, handler, what in (
        ("show", jobs_show, "a job's status, error and traceback, result, log lines, history"),
        ("logs", jobs_logs, "the lines a job's task logged (ctx.log)"),
        ("explain", jobs_explain, "why a job has not started: each reason, with its numbers"),
        ("cancel", jobs_cancel, "cancel a waiting job, or ask the worker running it to stop"),
        ("retry", jobs_retry, "send a failed (dead-lettered) job back to its queue"),
        ("promote", jobs_change, "run a scheduled job now (delayed, or in a retry's back-off)"),
    ):
        q = action(group, verb, handler, TENANT, what)
        q.add_argument("job_id", metavar="JOB_ID")
    q = action(group, "priority", jobs_change, TENANT, "change a job's priority before it runs")
    q.add_argument("job_id", metavar="JOB_ID")
    q.add_argument("priority", choices=PRIORITIES, metavar="PRIORITY", help="|".join(PRIORITIES))

    # dead letters (the admin key)
    p = sub.add_parser(
        "dead-letters",
        help="list, show and replay dead-lettered jobs (the admin key)",
        description="The dead-letter set, every tenant's, through the HTTP API "
        "(--url/JOBTIER_URL) with the admin key (the server's JOBTIER_ADMIN_KEY: --key, else "
        "JOBTIER_ADMIN_KEY, else JOBTIER_KEY). Redis keeps dead letters JOBTIER_DEAD_RETENTION_SECONDS.",
    )
    group = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = action(group, "list", dead_list, ADMIN, "dead-lettered jobs, newest first")
    what = "replay one dead letter (JOB_ID), those matching --type/--since, or --all"
    replaying = action(group, "replay", dead_replay, ADMIN, what)
    replaying.add_argument("job_id", metavar="JOB_ID", nargs="?", help="one job to replay")
    replaying.add_argument(
        "--all", action="store_true", help="every dead letter (up to --limit), with no filter"
    )
    since = "only jobs dead-lettered since: ISO 8601, or 30s, 15m, 2h, 7d"
    for q in (listing, replaying):
        q.add_argument("--type", help="only jobs of this task type")
        q.add_argument("--since", type=since_time, help=since)
        q.add_argument("--limit", type=positive_int, default=100, help="most jobs (default 100)")
    q = action(group, "show", dead_show, ADMIN, "one dead letter: error, traceback, payload, lines")
    q.add_argument("job_id", metavar="JOB_ID")

    # queues (the admin key)
    p = sub.add_parser(
        "queues",
        help="queues: depth, age, workers; pause, resume, unblock, purge, limit, scaling "
        "(the admin key)",
        description="Every queue through the HTTP API (--url/JOBTIER_URL) with the admin key "
        "(the server's JOBTIER_ADMIN_KEY: --key, else JOBTIER_ADMIN_KEY, else JOBTIER_KEY). "
        "Without an action: the list.",
    )
    _connection(p, ADMIN)
    group = p.add_subparsers(dest="action", metavar="[ACTION]")
    # after add_subparsers, whose default (None) would win: without an action, the list
    p.set_defaults(func=run, handler=queues_list, action="list")
    action(
        group, "list", queues_list, ADMIN, "every queue: ready, running, parked, oldest, workers"
    )
    for verb, handler, what in (
        ("pause", queues_pause, "stop claims from a queue (submits still accepted)"),
        ("resume", queues_resume, "let workers claim from a paused queue again"),
        (
            "unblock",
            queues_unblock,
            "lift a RateLimited block (a partner's 'slow down') before its end",
        ),
    ):
        q = action(group, verb, handler, ADMIN, what)
        q.add_argument("name", metavar="QUEUE")
    what = "cancel every ready (or parked) job of a queue, each as a cancel would (audited)"
    q = action(group, "purge", queues_purge, ADMIN, what)
    q.add_argument("name", metavar="QUEUE")
    q.add_argument("--yes", action="store_true", help="cancel them: it cannot be undone")
    what = "the workers a queue's pool wants now, and the inputs (docs: Kubernetes)"
    q = action(group, "scaling", queues_scaling, ADMIN, what)
    q.add_argument("name", metavar="QUEUE")
    q.add_argument(
        "--slots", type=positive_int, help="jobs a worker runs at once (default: the workers')"
    )
    q.add_argument("--min", type=int, help="fewest workers to ask for (default 0)")
    q.add_argument("--max", type=positive_int, help="most workers to ask for (default: none)")
    q.add_argument(
        "--target-age",
        type=positive_float,
        help="seconds the oldest job may wait before more workers are asked for (default 60)",
    )
    q = action(group, "limit", queues_limit, ADMIN, "limit a queue across every worker")
    q.add_argument("name", metavar="QUEUE")
    q.add_argument("--concurrency", type=positive_int, help="at most this many running at once")
    q.add_argument("--rate", type=positive_int, help="at most this many starts per --per seconds")
    q.add_argument(
        "--per", type=positive_float, default=1.0, help="the rate's period (default 1 s)"
    )
    q.add_argument("--none", action="store_true", help="lift the queue's limits")
