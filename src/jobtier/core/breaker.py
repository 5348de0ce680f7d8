"""Circuit breakers per downstream: what a task declares, and what it raises.

A breaker is named after a downstream (``"payments"``) and shared by every worker through
Redis (``store/lua/breaker.lua`` keeps its state, ``store/breakers.py`` calls it). A task
names its breaker with ``@task(breaker="payments")`` or ``@task(breaker=Breaker(...))`` for
thresholds of its own; the failures that count against the downstream are ``DownstreamDown``
and the classes of ``breaker_on``. While the breaker is open, the worker starts no job of it:
each goes back to wait, its attempt refunded (``BreakerOpen``), as ``RateLimited`` does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from jobtier.core.errors import ConfigError, JobtierError

# a breaker's name is part of its Redis keys: the queue names' characters (no ':')
BREAKER_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
STATES = ("closed", "open", "half_open")  # the metric's value is the index


class DownstreamDown(JobtierError):
    """Raised by a task when the downstream its breaker guards failed (a timeout, a 5xx, a
    refused connection): the failure counts against the breaker, and the job is retried as
    any failure is."""


class BreakerOpen(JobtierError):
    """Why a job of an open breaker did not start: it waits ``retry_after`` seconds without
    using an attempt (the worker's, never the task's)."""

    def __init__(self, breaker: str, state: str, retry_after: float) -> None:
        super().__init__(f"breaker={breaker} is {state}: not started, retried in {retry_after:g}s")
        self.breaker = breaker
        self.state = state
        self.retry_after = retry_after


@dataclass(frozen=True, slots=True)
class Breaker:
    """A breaker's thresholds.

    It opens when ``failures`` downstream failures fall within ``window`` seconds or, with
    ``ratio`` set, when the failures are at least that share of the outcomes of the window
    (once it holds ``min_calls``). It stays open ``open_for`` seconds, then lets ``probes``
    jobs through (half-open): a success closes it, a failure opens it again for ``backoff``
    times longer, at most ``max_open`` seconds.
    """

    name: str
    failures: int = 5
    window: float = 30.0
    ratio: float | None = None
    min_calls: int = 10
    open_for: float = 5.0
    backoff: float = 2.0
    max_open: float = 300.0
    probes: int = 1

    def __post_init__(self) -> None:
        bad = self.problem()
        if bad:
            raise ConfigError(f"breaker {self.name!r}: {bad}")

    def problem(self) -> str | None:
        """What is wrong with these thresholds, or None."""
        if not BREAKER_NAME_RE.fullmatch(self.name):
            return f"the name must match {BREAKER_NAME_RE.pattern}"
        if self.failures < 1 or self.min_calls < 1 or self.probes < 1:
            return "failures, min_calls and probes must be at least 1"
        if not (self.window > 0 and self.open_for > 0 and self.max_open >= self.open_for):
            return "window and open_for must be positive, max_open at least open_for"
        if self.backoff < 1:
            return "backoff must be at least 1"
        if self.ratio is not None and not 0 < self.ratio <= 1:
            return "ratio must be in (0, 1]"
        return None

    def args(self) -> tuple[int | str, ...]:
        """The thresholds as breaker.lua reads them (ms, and '' for no ratio)."""
        return (
            self.failures,
            round(self.window * 1000),
            "" if self.ratio is None else repr(self.ratio),
            self.min_calls,
            round(self.open_for * 1000),
            repr(self.backoff),
            round(self.max_open * 1000),
            self.probes,
        )
