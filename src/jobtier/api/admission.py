"""Who may submit now: per-tenant rate limit and waiting-jobs cap, global back-pressure,
load shedding by priority.

Counts come from Redis (per-tenant waiting counts kept by the scripts, the write-behind lag,
how full Redis's memory is) and are refreshed in the background once a second, so a submit
pays nothing for them. A refused submit is a 429 (this tenant) or 503 (everyone) with
``Retry-After``.

Load shedding (``JOBTIER_SHED_WAITING_TOTAL``) refines the single back-pressure threshold:
past it, submits holding a job of a shed priority (``JOBTIER_SHED_PRIORITIES``, normal and
low by default) are refused, while the others go on up to ``JOBTIER_MAX_WAITING_TOTAL``.
Every refusal is counted per priority and reason (``submits_refused_total``), one per job.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence

from jobtier.api.problems import Problem
from jobtier.config import Settings
from jobtier.engine.queue import Queue
from jobtier.metrics.snapshot import Snapshot, labels, parse_labels
from jobtier.runtime.loop import every
from jobtier.runtime.stopping import stop_task
from jobtier.store.memory import MemoryUse, redis_memory

log = logging.getLogger("jobtier.api")

LagProbe = Callable[[], Awaitable[int]]  # transitions not yet in Postgres

_MEMORY_HIGH = (
    "event=redis_memory_high used=%d maxmemory=%d ratio=%.3f refusing_submits=%s: Redis is "
    "filling up; submits are refused past JOBTIER_REDIS_MEMORY_REFUSE_RATIO=%g. Raise "
    "maxmemory, shorten JOBTIER_RETENTION_SECONDS, or add workers (docs/operating.md: Sizing Redis)"
)


class TokenBucket:
    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.stamp = time.monotonic()

    def take(self, n: int) -> float:
        """Take ``n`` tokens: 0.0 if granted, else the seconds until they would be. More than
        the burst (a large flow) is granted from a full bucket, which it leaves in debt."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        need = min(n, self.burst)
        if self.tokens >= need:
            self.tokens -= n
            return 0.0
        return (need - self.tokens) / self.rate


class Admission:
    """Admission control for submits (``check``), from counts ``refresh`` reads."""

    def __init__(self, settings: Settings, queue: Queue, lag: LagProbe | None = None) -> None:
        self.settings = settings
        self.queue = queue
        self.lag_probe = lag
        self.waiting: dict[str, int] = {}
        self.total_waiting = 0
        self.lag = 0
        self.memory = MemoryUse(0, 0)
        self._memory_warned = -1e9  # monotonic time of the last warning
        self._buckets: dict[str, TokenBucket] = {}
        self._task: asyncio.Task[None] | None = None
        self._shed = settings.shed_priority_set()
        self.refused: Counter[tuple[str, str]] = Counter()  # (priority, reason) -> jobs

    async def start(self) -> None:
        await self.refresh()
        refreshes = every(1.0, self.refresh, event="admission_refresh", log=log, wait_first=True)
        self._task = asyncio.create_task(refreshes, name="jobtier-admission")

    async def stop(self) -> None:
        await stop_task(self._task, "admission refresh")

    async def refresh(self) -> None:
        self.waiting = await self.queue.admin.waiting_by_tenant()
        self.total_waiting = sum(self.waiting.values())
        if self.lag_probe is not None:
            self.lag = await self.lag_probe()
        self.memory = await redis_memory(self.queue.redis)
        self._warn_memory()

    def _warn_memory(self) -> None:
        """A warning once a minute while Redis is past the warning ratio."""
        s, m = self.settings, self.memory
        now = time.monotonic()
        if m.ratio <= s.redis_memory_warn_ratio or now - self._memory_warned < 60:
            return
        self._memory_warned = now
        refusing = m.ratio > s.redis_memory_refuse_ratio
        log.warning(
            _MEMORY_HIGH, m.used, m.maxmemory, m.ratio, refusing, s.redis_memory_refuse_ratio
        )

    def check(
        self, tenant: str, n: int = 1, priorities: Sequence[str] = (), *, priority: str = ""
    ) -> None:
        """Raise a 429/503 problem if ``tenant`` may not submit ``n`` jobs of ``priorities``
        (one per job), or all of ``priority`` (a batch's: no list as long as the batch;
        neither given: all normal) now; a refusal is counted per priority."""
        try:
            self._check(tenant, n, priorities or (priority or "normal",))
        except Problem as refused:
            if priorities:
                self.refused.update((p, refused.slug) for p in priorities)
            else:
                self.refused[(priority or "normal", refused.slug)] += n
            raise

    def _check(self, tenant: str, n: int, priorities: Sequence[str]) -> None:
        s, m = self.settings, self.memory
        waiting = self.waiting.get(tenant, 0)
        if self.total_waiting + n > (cap := s.max_waiting_total):
            raise _refused(
                503, "overloaded", f"{self.total_waiting} jobs are waiting; the limit is {cap}"
            )
        if (shed_at := s.shed_waiting_total) and self.total_waiting + n > shed_at:
            shed = sorted({p for p in priorities if p in self._shed})
            if shed:
                detail = (
                    f"{self.total_waiting} jobs are waiting: past {shed_at} "
                    f"(JOBTIER_SHED_WAITING_TOTAL) submits of priority {', '.join(shed)} are "
                    f"shed, while the others are accepted up to {cap}"
                )
                raise _refused(503, "shed", detail, retry_after=5, priority=shed[0])
        if m.ratio > s.redis_memory_refuse_ratio:
            raise _refused(
                503,
                "overloaded",
                f"Redis memory is {m.ratio:.0%} full ({m.used} of {m.maxmemory} bytes); submits "
                f"are refused past {s.redis_memory_refuse_ratio:.0%} "
                "(JOBTIER_REDIS_MEMORY_REFUSE_RATIO) so that accepted jobs can still finish",
                retry_after=5,
            )
        if self.lag > (cap := s.persist_max_lag):
            detail = f"{self.lag} transitions wait to be written to Postgres; the limit is {cap}"
            raise _refused(503, "overloaded", detail)
        if (cap := s.max_waiting_per_tenant) and waiting + n > cap:
            raise _refused(
                429, "tenant-limit", f"tenant {tenant} has {waiting} waiting jobs; the cap is {cap}"
            )
        if s.rate_limit_per_second > 0:
            bucket = self._buckets.get(tenant)
            if bucket is None:
                rate = s.rate_limit_per_second
                bucket = self._buckets[tenant] = TokenBucket(rate, max(rate, s.max_batch))
            wait = bucket.take(n)
            if wait:
                detail = f"tenant {tenant} is limited to {s.rate_limit_per_second:g} jobs/s"
                raise _refused(429, "rate-limited", detail, retry_after=max(1, round(wait + 0.5)))
        # count what we let through, so a burst between refreshes cannot overshoot much
        self.waiting[tenant] = waiting + n
        self.total_waiting += n

    def metrics(self) -> Snapshot:
        """This API process's refused submits, per priority and reason (one per job)."""
        series = {labels(priority=p, reason=r): float(v) for (p, r), v in self.refused.items()}
        return Snapshot("", "", 0.0, counters={"submits_refused_total": series} if series else {})


def refused_by_priority(snapshots: Iterable[Snapshot]) -> dict[str, dict[str, float]]:
    """{reason: {priority: jobs}} of the submits refused, summed over API processes (the
    console's figures)."""
    out: dict[str, dict[str, float]] = {}
    for snap in snapshots:
        for key, value in snap.counters.get("submits_refused_total", {}).items():
            kv = parse_labels(key)
            by = out.setdefault(kv.get("reason", ""), {})
            by[kv.get("priority", "")] = by.get(kv.get("priority", ""), 0.0) + value
    return out


def _refused(status: int, slug: str, detail: str, retry_after: int = 2, **extra: str) -> Problem:
    return Problem(status, slug, detail, headers={"retry-after": str(retry_after)}, **extra)
