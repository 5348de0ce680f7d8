"""Query parameters: one parser for every route, and the OpenAPI description of each.

A route declares its parameters as ``Param`` values and reads them with ``parse_query``, so
the checks are the ones the document states:

* integers are ASCII digits only (``str.isdigit()`` also accepts '²', which ``int()``
  refuses), numbers are finite decimals, both within their range;
* strings have a length range and, where they name something, its pattern; no control
  characters (a NUL would reach Redis or Postgres, which refuses it);
* an unknown parameter, or one given twice, is refused too.

Every refusal is a 400 problem naming the parameter (``field``); a bound that is a setting
is named by its ``JOBTIER_*`` variable, so the message says what to change.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from starlette.requests import Request

from jobtier.api.problems import Problem
from jobtier.config import Settings
from jobtier.core.model import LISTED_STATES
from jobtier.core.names import QUEUE_NAME_RE, TASK_NAME_RE

Kind = Literal["integer", "number", "string", "date-time"]
Bound = float | str  # a number, or the name of the setting that holds it

_DIGITS = re.compile(r"[0-9]{1,18}")
_DECIMAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]{1,3})?")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def setting_value(settings: Settings, bound: Bound) -> float:
    return float(getattr(settings, bound) if isinstance(bound, str) else bound)


def bad(name: str | None, detail: str) -> Problem:
    return Problem(400, "bad-request", detail, field=name)


@dataclass(frozen=True, slots=True)
class Param:
    """One query parameter: its type and constraints, checked by ``parse`` and stated by
    ``openapi``."""

    name: str
    kind: Kind
    description: str
    minimum: Bound | None = None
    maximum: Bound | None = None
    min_length: int = 1
    max_length: int = 200
    pattern: str | None = None  # anchored, as JSON Schema and re.fullmatch both read it
    values: Sequence[str] = ()

    def parse(self, raw: str, settings: Settings) -> Any:
        """The value of ``raw``, or a 400 problem saying what is wrong with it."""
        name = self.name
        if self.kind == "integer":
            if not _DIGITS.fullmatch(raw):
                raise bad(name, f"{name} must be a whole number{self._range(settings)}")
            return self._in_range(int(raw), settings)
        if self.kind == "number":
            if len(raw) > 40 or not _DECIMAL.fullmatch(raw) or not math.isfinite(float(raw)):
                raise bad(name, f"{name} must be a number{self._range(settings)}")
            return self._in_range(float(raw), settings)
        if self.values:
            if raw not in self.values:
                raise bad(name, f"{name} must be one of {', '.join(self.values)}")
            return raw
        if not self.min_length <= len(raw) <= self.max_length or _CONTROL.search(raw):
            length = f"{self.min_length} to {self.max_length}"
            raise bad(name, f"{name} must be {length} printable characters")
        if self.pattern is not None and not re.fullmatch(self.pattern, raw):
            raise bad(name, f"{name} must match {self.pattern}")
        return _date_time(name, raw) if self.kind == "date-time" else raw

    def _in_range(self, value: float, settings: Settings) -> Any:
        low = None if self.minimum is None else setting_value(settings, self.minimum)
        high = None if self.maximum is None else setting_value(settings, self.maximum)
        if (low is not None and value < low) or (high is not None and value > high):
            raise bad(self.name, f"{self.name} must be{self._range(settings)}")
        return value

    def _range(self, settings: Settings) -> str:
        if self.minimum is None or self.maximum is None:
            return ""
        high = f"{setting_value(settings, self.maximum):g}"
        if isinstance(self.maximum, str):
            high += f" (JOBTIER_{self.maximum.upper()})"
        return f" from {setting_value(settings, self.minimum):g} to {high}"

    def openapi(self, settings: Settings) -> dict[str, Any]:
        """The parameter object of the OpenAPI document."""
        schema: dict[str, Any]
        if self.kind in ("integer", "number"):
            schema = {"type": self.kind}
            for key, bound in (("minimum", self.minimum), ("maximum", self.maximum)):
                if bound is not None:
                    schema[key] = _number(setting_value(settings, bound), self.kind)
        elif self.values:
            schema = {"type": "string", "enum": list(self.values)}
        else:
            schema = {"type": "string", "minLength": self.min_length, "maxLength": self.max_length}
            if self.kind == "date-time":
                schema["format"] = "date-time"
            if self.pattern is not None:
                schema["pattern"] = self.pattern
        return {"name": self.name, "in": "query", "description": self.description, "schema": schema}


def _number(value: float, kind: Kind) -> float | int:
    return int(value) if kind == "integer" or value.is_integer() else value


def _date_time(name: str, raw: str) -> datetime:
    try:
        value = datetime.fromisoformat(raw)
        # to UTC here: a time at the edge of the calendar overflows now, not in the driver
        return (value if value.tzinfo else value.replace(tzinfo=UTC)).astimezone(UTC)
    except (ValueError, OverflowError):
        raise bad(name, f"{name} must be an ISO-8601 time, e.g. 2024-05-01T12:00:00Z") from None


def parse_query(request: Request, params: Sequence[Param]) -> dict[str, Any]:
    """The route's query parameters by name (absent ones left out), or a 400 problem for an
    unknown, repeated or malformed one."""
    known = {p.name: p for p in params}
    settings: Settings = request.state.settings
    values: dict[str, Any] = {}
    for name, raw in request.query_params.multi_items():
        param = known.get(name)
        if param is None:
            allowed = ", ".join(known) or "none"
            raise bad(name[:40], f"unknown parameter {name[:40]!r} (this route takes: {allowed})")
        if name in values:
            raise bad(name, f"{name} is given more than once")
        values[name] = param.parse(raw, settings)
    return values


def limit_param(description: str, maximum: Bound) -> Param:
    """The ``limit`` of a listing: a whole number from 1 to ``maximum``."""
    return Param("limit", "integer", description, minimum=1, maximum=maximum)


def date_time(name: str, description: str) -> Param:
    return Param(name, "date-time", description, max_length=40)


def matching(name: str, description: str, regex: re.Pattern[str], max_length: int) -> Param:
    """A string parameter that must match ``regex`` (anchored)."""
    return Param(name, "string", description, max_length=max_length, pattern=regex.pattern)


# what the job listings share: these filters first, the page last
TYPE = matching("type", "only jobs of this type", TASK_NAME_RE, 128)
JOB_FILTERS = [
    Param("state", "string", "only jobs in this state", values=list(LISTED_STATES)),
    TYPE,
    matching("queue", "only jobs of this queue", QUEUE_NAME_RE, 64),
]
CREATED_AFTER = date_time("created_after", "only jobs created after this time (ISO 8601)")


def job_page(most: int) -> list[Param]:
    """Where a page of jobs starts, how many it holds (at most ``most``), which way it runs."""
    return [
        Param(
            "cursor", "string", "the next_cursor of the previous page", pattern=r"^[A-Za-z0-9_-]+$"
        ),
        limit_param("most jobs per page (default 50)", most),
        Param("order", "string", "desc (newest first, the default) or asc", values=["desc", "asc"]),
    ]
