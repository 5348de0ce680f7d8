"""``jobtier audit``: the admin actions, newest first, through the HTTP API (the admin key):
who (a fingerprint of the key), when, what, on what, the status answered and what it did. By
target or action, a page at a time. Connection, keys, ``--json`` and exit codes as
``jobtier queues`` (manage.py)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

import msgspec

from jobtier.cli.api_call import call_json
from jobtier.cli.manage import ADMIN, _connection, positive_int, run, short_time, table
from jobtier.core.names import AUDIT_ACTIONS

if TYPE_CHECKING:
    from jobtier.client import Client

COLUMNS = ("AT", "BY", "ACTION", "TARGET", "STATUS", "DETAIL")
DETAIL_CHARS = 80


def _detail(value: Any) -> str:
    if value is None:
        return "-"
    text = value if isinstance(value, str) else msgspec.json.encode(value).decode()
    return text if len(text) <= DETAIL_CHARS else text[: DETAIL_CHARS - 1] + "…"


def _row(r: dict[str, Any]) -> list[object]:
    return [
        short_time(r["at"]),
        r["actor"],
        r["action"],
        r["target"],
        r["status"],
        _detail(r["detail"]),
    ]


def audit_list(c: Client, a: argparse.Namespace) -> Any:
    given = {"target": a.target, "action": a.only_action, "cursor": a.cursor}
    params = {"limit": str(a.limit)} | {k: v for k, v in given.items() if v}
    page = call_json(c, "GET", "/v1/admin/audit", params=params)
    if a.json:
        return page
    records = page["records"]
    if not records:
        return "no admin action recorded" + (" matches these filters" if len(params) > 1 else "")
    lines = [table(COLUMNS, map(_row, records)), f"(you are {page['you']})"]
    if page["next_cursor"]:
        lines.append(f"older: --cursor {page['next_cursor']}")
    return "\n".join(lines)


def add_commands(sub: Any) -> None:
    """Add ``audit`` to the ``jobtier`` parser."""
    p = sub.add_parser(
        "audit",
        help="the admin actions and tenants' schedule changes, newest first: who, when, what, "
        "on what (the admin key)",
        description="Every admin action (a pause, a cancel, a replay, a breaker opened, …) "
        "and every change a tenant made to its schedules (schedule.*), as the API recorded "
        "it, newest first, through the HTTP API (--url/JOBTIER_URL) with the admin key "
        "(--key, else JOBTIER_ADMIN_KEY, else JOBTIER_KEY). BY is a fingerprint of the key "
        "used (admin:…, tenant:<tenant>:…), never the key.",
    )
    _connection(p, ADMIN)
    p.set_defaults(func=run, handler=audit_list, action="-")  # (no action: errors say audit)
    p.add_argument(
        "--target",
        help="only actions on this job id, queue name, breaker name, schedule id (not its "
        "name) or filter",
    )
    p.add_argument(
        "--action",
        dest="only_action",
        choices=AUDIT_ACTIONS,
        metavar="ACTION",
        help=f"only this action: {', '.join(AUDIT_ACTIONS)}",
    )
    p.add_argument("--limit", type=positive_int, default=50, help="most records (default 50)")
    p.add_argument("--cursor", help="the page after this one (the last page printed says it)")
