"""Debounce, throttle and uniqueness by key: the submit options (``JobSpec.debounce``,
``.throttle``, ``.unique``) and the refusal of a throttled submit (docs/debounce-throttle.md).

The types carry only what msgspec can check when it decodes a request (types, positive
numbers); ``engine/keyed.py`` checks the rest (the key's form, bounds from the settings) for
every caller, the HTTP API's and Python's alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from jobtier.core.errors import JobtierError

Positive = Annotated[float, msgspec.Meta(gt=0)]
OnLimit = Literal["refuse", "delay"]
Until = Literal["finished", "started"]


class Debounce(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Run once after a quiet period: a submit with the key of a job still waiting for its
    run replaces that job's payload (and priority, attempts) and restarts its wait of
    ``seconds``; ``max_wait`` (seconds from the key's first submit) bounds the total delay.
    The key is the tenant's, per queue and task type."""

    key: str
    seconds: Positive
    max_wait: Positive | None = None


class Throttle(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """At most ``limit`` jobs of the key start their run in any ``period`` seconds (the
    tenant's key, across queues). Beyond it, ``on_limit`` ``refuse`` refuses the submit (HTTP
    429 with Retry-After), ``delay`` schedules the job at the key's next free slot."""

    key: str
    limit: Annotated[int, msgspec.Meta(ge=1)]
    period: Positive
    on_limit: OnLimit = "refuse"


class Unique(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """At most one job of the key at a time: a submit while the key's job has not finished
    (``until="finished"``), or while it waits to run (``"started"``: queued or scheduled, for
    its first attempt or a retry; not while it runs), makes no job and answers that one,
    unchanged. The job holds the key by the ``until`` it was made with. The tenant's key,
    across queues."""

    key: str
    until: Until = "finished"


class Throttled(JobtierError):
    """A submit refused by its throttle key (``on_limit: refuse``); nothing was made.
    ``retry_after``: seconds until the key has a free slot."""

    def __init__(self, key: str, limit: int, period: float, retry_after: float) -> None:
        super().__init__(
            f"throttle key {key!r} is full (at most {limit} job{'s' if limit != 1 else ''} per "
            f"{period:g} s); try again "
            f"in {retry_after:.3f} s"
        )
        self.key = key
        self.retry_after = retry_after


@dataclass(frozen=True, slots=True)
class KeyedOption:
    """A submit's debounce or throttle, checked, as store/lua/keyed.lua takes it."""

    kind: str  # 'debounce' | 'throttle' | 'unique'
    key: str
    # debounce: (quiet ms, most total delay ms or 0); throttle: (limit, period ms); unique:
    # (1 until finished, 0 until started; 0)
    first: int
    second: int
    on_limit: str = "refuse"  # throttle only: 'refuse' | 'delay'
    # throttle only: the furthest ahead a delayed job may be put, ms (JOBTIER_MAX_FUTURE_SECONDS)
    furthest: int = 0

    def args(self) -> list[Any]:
        out: list[Any] = [self.kind, self.key, self.first, self.second]
        if self.kind == "unique":
            return out[:3]
        if self.kind == "throttle":
            out += [self.on_limit, self.furthest]
        return out
