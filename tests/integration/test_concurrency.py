"""Concurrency: claims never hand one attempt to two workers; idempotent submits race safely."""

from __future__ import annotations

import asyncio
from collections import Counter

from jobtier.config import Settings
from jobtier.core.model import JobSpec, State, decode_status
from jobtier.engine.queue import Queue
from tests.fixtures.engine import worker_for
from tests.fixtures.redis import logged
from tests.tasks import registry


async def claims_per_attempt(queue: Queue) -> Counter[tuple[str, int]]:
    """(job id, attempt) -> how many queued->running transitions the log holds."""
    seen: Counter[tuple[str, int]] = Counter()
    for shard in range(queue.keys.shards):
        for fields in await logged(queue.redis, queue.keys.log(shard)):
            doc = decode_status(fields[b"d"])
            if fields[b"fr"] == b"queued" and doc.state is State.RUNNING:
                seen[(doc.id, doc.attempt)] += 1
    return seen


async def test_racing_claim_calls_split_the_jobs(queue: Queue) -> None:
    subs = await queue.submit_many([JobSpec(type="echo", payload=i) for i in range(400)])
    ids = {s.job_id for s in subs}
    scripts = queue.scripts
    calls = [
        scripts.claim(shard, f"w{n}", 7, 30_000)
        for n in range(40)
        for shard in range(queue.keys.shards)
    ]
    claimed = [job.id for batch in await asyncio.gather(*calls) for job in batch.jobs]
    while len(claimed) < len(ids):  # 40 x 7 x 4 shards can exceed the jobs; mop up the rest
        more = await asyncio.gather(*(scripts.claim(s, "mop", 50, 30_000) for s in range(4)))
        got = [job.id for batch in more for job in batch.jobs]
        assert got, "jobs are neither claimed nor claimable"
        claimed += got
    assert len(claimed) == len(set(claimed)) == len(ids)
    assert set(claimed) == ids


async def test_many_workers_run_each_job_once(settings: Settings) -> None:
    queues = [await Queue.connect(settings, catalog=False) for _ in range(6)]
    try:
        producer = queues[0]
        subs = await producer.submit_many([JobSpec(type="echo", payload=i) for i in range(600)])
        workers = [worker_for(q, registry, burst=True, concurrency=16) for q in queues]
        stats = await asyncio.gather(*(w.run() for w in workers))
        assert sum(s.succeeded for s in stats) == 600
        assert sum(s.refused for s in stats) == 0
        assert len([s for s in stats if s.claimed]) > 1  # the work really was shared
        per_attempt = await claims_per_attempt(producer)
        assert len(per_attempt) == 600 and set(per_attempt.values()) == {1}
        for sub in subs:
            assert (await producer.status(sub.job_id)).state is State.SUCCEEDED
    finally:
        for q in queues:
            await q.close()


async def test_concurrent_submits_with_one_idempotency_key_create_one_job(
    settings: Settings,
) -> None:
    queues = [await Queue.connect(settings, catalog=False) for _ in range(4)]
    try:
        results = await asyncio.gather(
            *(
                queues[i % 4].submit("echo", {"order": 42}, idempotency_key="order-42")
                for i in range(100)
            )
        )
        assert len({r.job_id for r in results}) == 1
        assert sum(r.created for r in results) == 1
        keys = [k async for k in queues[0].redis.scan_iter(match="jt:*:job:*")]
        assert len(keys) == 1
        waiting = await queues[0].admin.waiting_by_tenant()
        assert waiting == {"default": 1}
    finally:
        for q in queues:
            await q.close()
