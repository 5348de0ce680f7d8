"""``jobtier workers``: the live workers through the HTTP API (the admin key), Python and HTTP
ones alike: what each serves, its slots, the jobs it runs. Connection, keys, ``--json`` and
exit codes as ``jobtier queues`` (manage.py)."""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

from jobtier.cli.manage import ADMIN, _connection, clock, run, short_time, table

if TYPE_CHECKING:
    from jobtier.client import Client
    from jobtier.core.worker_list import WorkerInfo

COLUMNS = ("WORKER", "HOST", "QUEUES", "TASKS", "RUNNING", "SEEN")
JOBS = ("JOB", "WORKER", "TYPE", "QUEUE", "ATTEMPT", "SINCE")


def _few(names: list[str], most: int = 4) -> str:
    """Names, comma-separated, the first few of a long list (``--json`` has them all)."""
    if len(names) <= most:
        return ",".join(names)
    return ",".join(names[: most - 1]) + f",+{len(names) - most + 1} more"


def _row(w: WorkerInfo, now: float) -> list[object]:
    host = w.host + (f" pid {w.pid}" if w.pid else "")
    seen = f"{max(now - w.seen_at, 0):.0f}s ago"
    # its count at its last heartbeat, or the jobs Redis says it runs now, if more
    running = max(w.running, len(w.jobs))
    return [w.id, host, _few(w.queues), _few(w.tasks), f"{running}/{w.concurrency}", seen]


def workers_list(c: Client, a: argparse.Namespace) -> Any:
    listed = c.workers()
    if a.json:
        return listed
    if not listed.workers:
        return "no live worker (none has advertised itself in the last minute)"
    now = time.time()
    out = [table(COLUMNS, (_row(w, now) for w in listed.workers))]
    if a.jobs:
        jobs = [
            [j.id, w.id, j.type, j.queue, j.attempt, short_time(j.since)]
            for w in listed.workers
            for j in w.jobs
        ]
        out += ["", table(JOBS, jobs) if jobs else "no running job"]
    shown = f"{listed.running_listed} of {listed.running_total}"
    out.append(f"jobs running: {listed.running_total} ({shown} listed; at {clock(now)})")
    return "\n".join(out)


def add_commands(sub: Any) -> None:
    """Add ``workers`` to the ``jobtier`` parser."""
    what = "the live workers: queues, tasks, running/slots, last seen (the admin key)"
    p = sub.add_parser(
        "workers",
        help=what,
        description="Every live worker, Python or HTTP, through the HTTP API "
        "(--url/JOBTIER_URL) with the admin key (--key, else JOBTIER_ADMIN_KEY, else "
        "JOBTIER_KEY): a worker is live for a minute after it was last seen.",
    )
    _connection(p, ADMIN)
    p.add_argument("--jobs", action="store_true", help="the jobs each runs, too")
    p.set_defaults(func=run, handler=workers_list, action="list")
