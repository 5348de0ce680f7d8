"""Back-off for loops that retry a failing call (Redis or Postgres away for a while).

One mechanism, one policy per caller: the first wait, how fast it grows and where it stops;
``jitter`` spreads the retries of processes that failed together (a fleet losing Redis at
once must not come back as one burst). ``policy.start()`` gives a loop its ``Backoff``:
``next()`` after each failure, ``reset()`` after a success.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BackoffPolicy:
    """``first * factor ** n`` seconds before the (n+1)-th retry, capped at ``cap``, plus up
    to ``jitter`` times that at random."""

    first: float
    cap: float
    factor: float = 2.0
    jitter: float = 0.1

    def __post_init__(self) -> None:
        if not (0 < self.first <= self.cap and self.factor >= 1 and self.jitter >= 0):
            raise ValueError(f"bad back-off policy: {self}")

    def start(self) -> Backoff:
        return Backoff(self)


class Backoff:
    """The state of one retry loop under a ``BackoffPolicy``."""

    __slots__ = ("_delay", "failures", "policy")

    def __init__(self, policy: BackoffPolicy) -> None:
        self.policy = policy
        self._delay = policy.first
        self.failures = 0  # consecutive failures since the last reset

    @property
    def delay(self) -> float:
        """The wait ``next()`` will return, before jitter (for log lines)."""
        return self._delay

    def next(self, rng: random.Random | None = None) -> float:
        """Count a failure; the seconds to wait before trying again."""
        p = self.policy
        wait = self._delay
        self._delay = min(self._delay * p.factor, p.cap)
        self.failures += 1
        return wait + (rng or random).uniform(0, wait * p.jitter) if p.jitter else wait

    def reset(self) -> None:
        """After a success: the next failure starts from the first wait again."""
        self._delay = self.policy.first
        self.failures = 0


CLAIM = BackoffPolicy(first=0.05, cap=5.0)  # a worker's claims while Redis is away
REPORT = BackoffPolicy(first=0.05, cap=5.0)  # a worker's outcomes (kept, sent again)
SCHEDULER = BackoffPolicy(first=0.05, cap=5.0)  # promote / reclaim / fire passes
SUBSCRIBE = BackoffPolicy(first=0.05, cap=2.0)  # shard-channel subscriptions (push stalls)
STARTUP = BackoffPolicy(first=0.1, cap=5.0)  # start-up, while a restarted Redis loads its data
PERSIST_REDIS = BackoffPolicy(first=0.1, cap=5.0)  # the persister reading the logs
PERSIST_POSTGRES = BackoffPolicy(first=0.1, cap=5.0)  # a batch waiting for Postgres
