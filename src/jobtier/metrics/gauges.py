"""Gauges read from Redis at scrape time: queue depths, oldest waiting job, dead letters,
live workers, and the write-behind lag."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec

from jobtier.metrics.snapshot import labels
from jobtier.model import PRIORITIES
from jobtier.queue import Queue


async def live_gauges(queue: Queue, lag: Callable[[], Any] | None) -> dict[str, dict[str, float]]:
    """Gauges read from Redis now: depths, oldest waiting job per priority, dead letters,
    live workers, and (with Postgres) the write-behind lag."""
    stats = (await queue.stats())["total"]
    out: dict[str, dict[str, float]] = {
        "queue_depth": {
            labels(priority=p.value): stats.get(f"queued_{p.value}", 0) for p in PRIORITIES
        },
        "scheduled_jobs": {"": stats.get("scheduled", 0)},
        "running_jobs": {"": stats.get("running", 0)},
        "dead_letter_jobs": {"": stats.get("dead", 0)},
    }
    keys, redis = queue.keys, queue.redis
    pipe = redis.pipeline(transaction=False)
    for shard in range(keys.shards):
        for p in PRIORITIES:
            pipe.lindex(keys.queue(shard, p), -1)  # the oldest job of each queue
    oldest_ids = await pipe.execute()
    pipe = redis.pipeline(transaction=False)
    present = []
    for i, job_id in enumerate(oldest_ids):
        if job_id is not None:
            shard, index = divmod(i, len(PRIORITIES))
            pipe.hget(keys.job_in(shard, job_id.decode()), "updated")
            present.append(PRIORITIES[index].value)
    ages = {labels(priority=p.value): 0.0 for p in PRIORITIES}
    now = time.time() * 1000
    for priority, updated in zip(present, await pipe.execute() if present else [], strict=True):
        if updated is not None:
            key = labels(priority=priority)
            ages[key] = max(ages[key], (now - int(updated)) / 1000)
    out["oldest_queued_age_seconds"] = ages
    workers = 0
    for raw in (await redis.hgetall(keys.workers())).values():
        info = msgspec.json.decode(raw)
        if now / 1000 - float(info.get("seen_at", 0)) <= 60:
            workers += 1
    out["workers"] = {"": workers}
    if lag is not None:
        entries, seconds = await lag()
        out["persister_lag_transitions"] = {"": entries}
        out["persister_lag_seconds"] = {"": seconds}
    return out
