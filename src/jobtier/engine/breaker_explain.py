"""The explain answer's line for a job an open circuit breaker held back.

A worker that turns a job away for its breaker records why as the job's error
(``BreakerOpen``: ``breaker=<name> is open: …``, worker/breaker_gate.py). The job's error names
the breaker; the breaker's state now (store/breaker_state.py) says how long it still waits.
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


async def breaker_reason(store: Store, job_id: str, now_ms: int) -> Reason | None:
    """Why the job waits on its breaker, if its last attempt was held back by one."""
    raw = await store.redis.hget(store.keys.job(job_id), "error")
    if not raw:
        return None
    try:
        error = msgspec.json.decode(raw, type=_Error)
    except msgspec.DecodeError:
        return None
    named = _NAMED.match(error.message) if error.type == "BreakerOpen" else None
    if named is None:
        return None
    name = named.group(1)
    view = await BreakerStates(store).get(name)
    if view.state == "open" and view.open_until is not None:
        seconds = view.open_until - now_ms / 1000
        message = (
            f"breaker {name!r} held it back: open for {seconds:.3f} s more ({view.trips} "
            f"trips; {view.reason or 'no reason given'}); its jobs start after it, and use "
            "no attempt meanwhile"
        )
        return Reason(ReasonCode.BREAKER_OPEN, message, breaker=name, seconds=seconds)
    if view.state == "open":
        message = (
            f"breaker {name!r} held it back: opened by hand until it is closed by hand "
            f"({view.reason or 'no reason given'}); its jobs use no attempt meanwhile"
        )
    elif view.state == "half_open":
        message = (
            f"breaker {name!r} held it back: half-open, its probes test the downstream; "
            "a success closes it"
        )
    else:
        return None  # closed since: the job runs when its wait ends, as any scheduled one
    return Reason(ReasonCode.BREAKER_OPEN, message, breaker=name)
