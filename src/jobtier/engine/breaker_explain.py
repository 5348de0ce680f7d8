"""The explain answer's line for a job an open circuit breaker holds back.

A worker that turns a job away for its breaker records why as the job's error
(``BreakerOpen``: ``breaker=<name> is open: …``, worker/breaker_gate.py), and a job its workers
handed back unasked (its type held) is of a task type the breaker lists (the types that
recorded against it). The breaker's state now (store/breaker_state.py) says how long it still
waits.
"""

from __future__ import annotations

import re

import msgspec

from jobtier.core.explanation import Reason, ReasonCode
from jobtier.store.breaker_state import BreakerStates
from jobtier.store.context import Store

_NAMED = re.compile(r"^breaker=([A-Za-z0-9_.-]{1,64}) ")


class _Error(msgspec.Struct):
    type: str = ""
    message: str = ""


async def _named(store: Store, job_id: str) -> str | None:
    """The breaker that held the job's last start back, if one did."""
    raw = await store.redis.hget(store.keys.job(job_id), "error")
    if not raw:
        return None
    try:
        error = msgspec.json.decode(raw, type=_Error)
    except msgspec.DecodeError:
        return None
    named = _NAMED.match(error.message) if error.type == "BreakerOpen" else None
    return named.group(1) if named else None


async def breaker_reason(store: Store, job_id: str, type: str, now_ms: int) -> Reason | None:
    """Why the job waits on its breaker: the one that held its last start back, or an open
    one its task type records against (workers hand such jobs back without asking: they
    wait parked)."""
    states = BreakerStates(store)
    name = await _named(store, job_id)
    if name is not None:
        view = await states.get(name)
    else:
        found = [b for b in await states.all() if type in b.types and b.state != "closed"]
        if not found:
            return None
        view = found[0]
        name = view.name
    if view.state == "open" and view.open_until is not None:
        seconds = view.open_until - now_ms / 1000
        message = (
            f"breaker {name!r} holds it back: open for {seconds:.3f} s more ({view.trips} "
            f"trips; {view.reason or 'no reason given'}); its jobs start after it, and use "
            "no attempt meanwhile"
        )
        return Reason(ReasonCode.BREAKER_OPEN, message, breaker=name, seconds=seconds)
    if view.state == "open":
        message = (
            f"breaker {name!r} holds it back: opened by hand until it is closed by hand "
            f"({view.reason or 'no reason given'}); its jobs use no attempt meanwhile"
        )
    elif view.state == "half_open":
        message = (
            f"breaker {name!r} holds it back: half-open, its probes test the downstream; "
            "a success closes it"
        )
    else:
        return None  # closed since: the job runs when its wait ends, as any scheduled one
    return Reason(ReasonCode.BREAKER_OPEN, message, breaker=name)
