"""The gauges ``/metrics`` reads from Redis at scrape time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from jobtier.core.model import PRIORITIES
from jobtier.engine.queue import Queue
from jobtier.metrics.snapshot import labels
from jobtier.store.breaker_state import BreakerStates
from jobtier.store.memory import redis_memory
from jobtier.streams.group import group_lag


async def live_gauges(
    queue: Queue, lag: Callable[[], Any] | None, outbox: Callable[[], Any] | None = None
) -> dict[str, dict[str, float]]:
    """{metric: {labels: value}} read now: per queue its depth by priority and oldest waiting
    job, running, parked, held (behind concurrency keys), paused and waiting jobs and the
    seconds left of its block; each
    circuit breaker's state; the totals of waiting (for dependencies), scheduled and
    dead-lettered jobs; live workers, Redis's memory, (with ``lag``, when
    the API has Postgres) the write-behind lag and the outbox's backlog (``outbox``, while
    Postgres answers), and (once any webhook or job callback was accepted: the dispatchers'
    group exists) the webhook dispatchers' lag."""
    stats = await queue.admin.stats()
    total = stats["total"]
    depth, running, parked, paused, waiting, blocked, held = {}, {}, {}, {}, {}, {}, {}
    now_ms = time.time() * 1000
    for name, q in stats["queues"].items():
        for p in PRIORITIES:
            depth[labels(queue=name, priority=p.value)] = q["queued"][p.value]
        running[labels(queue=name)] = q["running"]
        waiting[labels(queue=name)] = q["waiting"]
        parked[labels(queue=name)] = q["parked"]
        held[labels(queue=name)] = q["held"]
        paused[labels(queue=name)] = 1.0 if q["paused"] else 0.0
        # (an end in the past stays in Redis until the next block: read as none)
        blocked[labels(queue=name)] = max(q["blocked_until_ms"] - now_ms, 0.0) / 1000
    ages = {
        labels(queue=name, priority=prio): age
        for (name, prio), age in (await queue.admin.oldest_queued()).items()
    }
    for key in depth:
        ages.setdefault(key, 0.0)
    out: dict[str, dict[str, float]] = {
        "queue_depth": depth,
        "queue_running_jobs": running,
        "queue_parked_jobs": parked,
        "queue_held_jobs": held,
        "queue_paused": paused,
        "queue_blocked_seconds": blocked,
        "queue_waiting_jobs": waiting,
        "oldest_queued_age_seconds": ages,
        "scheduled_jobs": {"": total.get("scheduled", 0)},
        "waiting_jobs": {"": total.get("waiting", 0)},
        "running_jobs": {"": total.get("running", 0)},
        "dead_letter_jobs": {"": total.get("dead", 0)},
    }
    out["workers"] = {"": len(await queue.admin.live_workers())}
    breakers = await BreakerStates(queue.store).all()
    out["breaker_state"] = {labels(breaker=b.name): float(b.value) for b in breakers}
    memory = await redis_memory(queue.redis)
    out["redis_memory_used_bytes"] = {"": memory.used}
    out["redis_memory_max_bytes"] = {"": memory.maxmemory}
    out["redis_memory_used_ratio"] = {"": memory.ratio}
    if lag is not None:
        entries, seconds = await lag()
        out["persister_lag_transitions"] = {"": entries}
        out["persister_lag_seconds"] = {"": seconds}
    if outbox is not None and (backlog := await outbox()) is not None:
        out["outbox_pending_rows"] = {"": backlog[0]}
        out["outbox_oldest_pending_seconds"] = {"": backlog[1]}
    dispatch = await group_lag(queue.redis, queue.keys, queue.keys.dispatch_group())
    if dispatch.exists:
        out["dispatcher_lag_transitions"] = {"": dispatch.transitions}
        out["dispatcher_lag_seconds"] = {"": dispatch.seconds}
    return out
