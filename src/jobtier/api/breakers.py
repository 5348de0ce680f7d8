"""Circuit breaker routes (admin key): every breaker's state, and opening or closing one by
hand (each audited: audit.py). The breakers live in Redis (store/breaker_state.py); a manual
open holds every job of the breaker on every worker, as a tripped one does."""

from __future__ import annotations

from typing import Annotated

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from jobtier.api import spec as oa
from jobtier.api.audit import audited
from jobtier.api.auth import require_admin
from jobtier.api.http import decode_body, encoded, read_json_body
from jobtier.api.problems import Problem
from jobtier.config import Settings
from jobtier.core.breaker import BREAKER_NAME_RE
from jobtier.store.breaker_state import BreakerStates, BreakerView

MAX_OPEN_SECONDS = 7 * 24 * 3600  # a manual open with a period: at most a week
REASON_CHARS = 200


class BreakerThresholds(msgspec.Struct):
    """What the workers of the breaker's tasks declared (``Breaker``), as they last said."""

    failures: int
    window_ms: int
    ratio: float | None
    min_calls: int
    open_ms: int
    backoff: float
    max_open_ms: int
    probes: int


class BreakerInfo(msgspec.Struct):
    """A breaker: ``state`` closed, open or half_open (its open period is over: the next job
    is a probe); ``open_until`` (s since the epoch) while open for a period; ``manual`` True
    when opened by hand without one (it stays open until closed by hand); ``trips``: opens
    since it last closed (the back-off's exponent); ``types``: the task types whose jobs
    recorded against it."""

    name: str
    state: str
    open_until: float | None
    manual: bool
    trips: int
    changed_at: float | None
    reason: str
    thresholds: BreakerThresholds | None
    types: list[str]


class BreakerList(msgspec.Struct):
    breakers: list[BreakerInfo]


# why a breaker was opened or closed by hand: text of one line's length, no NUL (Postgres's
# text cannot hold one), in the document as in the decoder
Reason = Annotated[str, msgspec.Meta(max_length=REASON_CHARS, pattern=r"^[^\x00]*$")]


class BreakerOpenBody(msgspec.Struct, forbid_unknown_fields=True):
    """How long (``seconds``; absent or null: until closed by hand) and why."""

    seconds: Annotated[float, msgspec.Meta(gt=0, le=MAX_OPEN_SECONDS)] | None = None
    reason: Reason | None = None


class BreakerCloseBody(msgspec.Struct, forbid_unknown_fields=True):
    reason: Reason | None = None


OPENAPI_TYPES: list[type] = [BreakerList, BreakerInfo, BreakerOpenBody, BreakerCloseBody]
_open_decoder = msgspec.json.Decoder(BreakerOpenBody)
_close_decoder = msgspec.json.Decoder(BreakerCloseBody)


def _info(view: BreakerView) -> BreakerInfo:
    return msgspec.convert(view.to_dict(), BreakerInfo)


def breaker_name(request: Request) -> str:
    """The ``{name}`` of the path: a 422 problem unless it is a valid breaker name."""
    name: str = request.path_params["name"]
    if not BREAKER_NAME_RE.fullmatch(name):
        detail = f"breaker name must match {BREAKER_NAME_RE.pattern}"
        raise Problem(422, "validation", detail, field="name")
    return name


def _reason(reason: str | None, default: str) -> str:
    if reason is not None and len(reason) > REASON_CHARS:
        detail = f"reason must be at most {REASON_CHARS} characters"
        raise Problem(422, "validation", detail, field="reason")
    if reason is not None and "\x00" in reason:
        raise Problem(422, "validation", "reason must not hold a NUL", field="reason")
    return reason or default


async def list_breakers(request: Request) -> Response:
    require_admin(request)
    views = await BreakerStates(request.state.queue.store).all()
    return encoded(BreakerList([_info(v) for v in views]))


async def open_breaker(request: Request) -> Response:
    require_admin(request)
    name = breaker_name(request)
    body: BreakerOpenBody = decode_body(_open_decoder, await read_json_body(request) or b"{}")
    seconds = body.seconds
    if seconds is not None and not 0 < seconds <= MAX_OPEN_SECONDS:
        detail = f"seconds must be above 0 and at most {MAX_OPEN_SECONDS} (or null: until closed)"
        raise Problem(422, "validation", detail, field="seconds")
    reason = _reason(body.reason, "opened by hand")
    async with audited(request, "breaker.open", name) as outcome:
        outcome.detail = {"seconds": seconds, "reason": reason}
        view = await BreakerStates(request.state.queue.store).open(name, seconds, reason)
    return encoded(_info(view))


async def close_breaker(request: Request) -> Response:
    require_admin(request)
    name = breaker_name(request)
    body: BreakerCloseBody = decode_body(_close_decoder, await read_json_body(request) or b"{}")
    reason = _reason(body.reason, "closed by hand")
    async with audited(request, "breaker.close", name) as outcome:
        outcome.detail = {"reason": reason}
        view = await BreakerStates(request.state.queue.store).close(name, reason)
    return encoded(_info(view))


def operations(settings: Settings) -> oa.Paths:
    paths = oa.Paths(settings, auth="admin")
    name = [oa.path_param("name", "a breaker name", BREAKER_NAME_RE)]
    bad_name = oa.refuses(422, "a breaker name that breaks its pattern, or a bad member (field)")
    paths.add(
        "GET /v1/admin/breakers",
        list_breakers,
        "Every circuit breaker a worker or an admin has used: its state, open period, trips, "
        "last reason and thresholds",
        oa.returns(200, "BreakerList", "the breakers, by name"),
    )
    paths.add(
        "POST /v1/admin/breakers/{name}/open",
        open_breaker,
        "Open a breaker by hand, for seconds or until closed: no job of it starts on any "
        "worker meanwhile, none uses an attempt (audited)",
        oa.returns(200, "BreakerInfo", "the breaker as it is now"),
        bad_name,
        path=name,
        body="BreakerOpenBody",
        body_required=False,
    )
    paths.add(
        "POST /v1/admin/breakers/{name}/close",
        close_breaker,
        "Close a breaker by hand: its jobs start again as their waits end (audited)",
        oa.returns(200, "BreakerInfo", "the breaker as it is now"),
        bad_name,
        path=name,
        body="BreakerCloseBody",
        body_required=False,
    )
    return paths
