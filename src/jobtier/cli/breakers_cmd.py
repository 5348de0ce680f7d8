"""``jobtier breakers``: the circuit breakers through the HTTP API (the admin key): the list,
and opening or closing one by hand (the API audits each). Connection, keys, ``--json`` and
exit codes as ``jobtier queues`` (manage.py)."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from jobtier.cli.api_call import call_json
from jobtier.cli.manage import ADMIN, _connection, positive_float, run, table

if TYPE_CHECKING:
    from jobtier.client import Client

COLUMNS = ("BREAKER", "STATE", "OPEN UNTIL", "TRIPS", "REASON")


def _where(name: str, action: str) -> str:
    from jobtier.client._core import path

    return path("/v1/admin/breakers", name, f"/{action}")


def _until(at: float | None) -> str:
    if at is None:
        return "—"
    return datetime.fromtimestamp(at, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _row(b: dict[str, Any]) -> list[object]:
    until = "until closed" if b["state"] == "open" and b["manual"] else _until(b["open_until"])
    return [b["name"], b["state"], until, b["trips"], b["reason"] or "—"]


def breakers_list(c: Client, a: argparse.Namespace) -> Any:
    breakers = call_json(c, "GET", "/v1/admin/breakers")["breakers"]
    if a.json:
        return breakers
    return table(COLUMNS, map(_row, breakers)) if breakers else "no breakers"


def breakers_open(c: Client, a: argparse.Namespace) -> Any:
    body = {"seconds": a.seconds, "reason": a.reason}
    b = call_json(c, "POST", _where(a.name, "open"), body)
    return b if a.json else table(COLUMNS, [_row(b)])


def breakers_close(c: Client, a: argparse.Namespace) -> Any:
    b = call_json(c, "POST", _where(a.name, "close"), {"reason": a.reason})
    return b if a.json else table(COLUMNS, [_row(b)])


def add_commands(sub: Any) -> None:
    """Add ``breakers`` to the ``jobtier`` parser."""
    p = sub.add_parser(
        "breakers",
        help="circuit breakers: state; open or close one by hand (the admin key)",
        description="Every circuit breaker through the HTTP API (--url/JOBTIER_URL) with the "
        "admin key (--key, else JOBTIER_ADMIN_KEY, else JOBTIER_KEY). Without an action: the "
        "list.",
    )
    _connection(p, ADMIN)
    group = p.add_subparsers(dest="action", metavar="[ACTION]")
    p.set_defaults(func=run, handler=breakers_list, action="list")

    def action(name: str, handler: Any, help: str) -> argparse.ArgumentParser:
        q: argparse.ArgumentParser = group.add_parser(name, help=help, description=help)
        _connection(q, ADMIN)
        q.set_defaults(func=run, handler=handler, action=name)
        return q

    action("list", breakers_list, "every breaker: state, open until, trips, last reason")
    q = action("open", breakers_open, "open a breaker by hand: no job of it starts (audited)")
    q.add_argument("name", metavar="BREAKER")
    q.add_argument(
        "--for",
        dest="seconds",
        type=positive_float,
        help="seconds to stay open (default: until closed by hand)",
    )
    q.add_argument("--reason", help="why, for the audit and the list")
    q = action("close", breakers_close, "close a breaker by hand: its jobs start again (audited)")
    q.add_argument("name", metavar="BREAKER")
    q.add_argument("--reason", help="why, for the audit and the list")
