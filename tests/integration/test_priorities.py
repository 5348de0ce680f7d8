"""Priorities: FIFO within a priority; weighted so that low never starves."""

from __future__ import annotations

from collections import Counter
from typing import cast

from jobtier.config import Settings
from jobtier.core.model import JobSpec, Priority
from jobtier.engine.queue import Queue


async def one_shard_queue(settings: Settings) -> Queue:
    return await Queue.connect(settings.replace(shards=1), catalog=False)


async def claim_all(queue: Queue, batch: int) -> list[str]:
    order: list[str] = []
    while True:
        got = (await queue.scripts.claim(0, "w", batch, 30_000)).jobs
        if not got:
            return order
        order += [j.id for j in got]


async def test_fifo_within_a_priority(settings: Settings) -> None:
    queue = await one_shard_queue(settings)
    try:
        subs = await queue.submit_many([JobSpec(type="echo", payload=i) for i in range(50)])
        subs += [await queue.submit("echo", i) for i in range(50, 60)]
        assert await claim_all(queue, 7) == [s.job_id for s in subs]
    finally:
        await queue.close()


async def test_weights_and_no_starvation(settings: Settings) -> None:
    queue = await one_shard_queue(settings)
    try:
        kinds: dict[str, str] = {}
        for priority, n in [("low", 40), ("normal", 200), ("high", 200), ("critical", 400)]:
            for sub in await queue.submit_many(
                [JobSpec(type="echo", priority=cast(Priority, priority)) for _ in range(n)]
            ):
                kinds[sub.job_id] = priority
        order = [kinds[i] for i in await claim_all(queue, 10)]
        first = Counter(order[:150])
        # 8:4:2:1 over the first 150 claims, while every queue still has work
        assert first == {"critical": 80, "high": 40, "normal": 20, "low": 10}
        # the low jobs were spread through the run, not left to the end
        positions = [i for i, p in enumerate(order) if p == "low"]
        assert positions[0] < 15 and len([p for p in positions if p < 300]) >= 20
        # empty turns go to the highest non-empty queue: nothing idles while work is ready
        assert len(order) == 840
    finally:
        await queue.close()


async def test_high_priority_flood_does_not_starve_low(settings: Settings) -> None:
    queue = await one_shard_queue(settings)
    try:
        low = await queue.submit("echo", "low", priority="low")
        claimed_low_at = None
        for round_ in range(30):
            await queue.submit_many(
                [JobSpec(type="echo", priority=cast(Priority, "high")) for _ in range(20)]
            )
            got = [j.id for j in (await queue.scripts.claim(0, "w", 5, 30_000)).jobs]
            if low.job_id in got:
                claimed_low_at = round_
                break
        assert claimed_low_at is not None and claimed_low_at <= 3
    finally:
        await queue.close()
