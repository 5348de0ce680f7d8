"""The same engine and status tier on a real Redis Cluster (shards spread over 3 nodes)."""

from __future__ import annotations

import asyncio

from jobtier.config import Settings
from jobtier.connection import ShardSubscriber
from jobtier.model import State
from jobtier.queue import JobSpec, Queue
from jobtier.scheduler import Scheduler
from tests.fixtures.api import StartApi
from tests.fixtures.engine import Background, wait_for, worker_for
from tests.tasks import registry


async def test_shards_really_are_spread_over_nodes(cluster_settings: Settings) -> None:
    async with await Queue.connect(cluster_settings) as queue:
        nodes = {queue.redis.get_node_from_key(queue.keys.log(s)).port for s in range(16)}  # type: ignore[union-attr]
        assert len(nodes) == 3


async def test_jobs_run_end_to_end_on_a_cluster(
    cluster_settings: Settings, background: Background
) -> None:
    async with await Queue.connect(cluster_settings, registry) as queue:
        subs = await queue.submit_many([JobSpec(type="echo", payload=i) for i in range(300)])
        later = await queue.submit("echo", "later", delay=0.3)
        failing = await queue.submit("flaky", {"succeed_on": 2})
        background.start(Scheduler(queue))
        worker = worker_for(queue, registry, concurrency=20)
        background.start(worker)
        ids = [s.job_id for s in subs] + [later.job_id, failing.job_id]  # type: ignore[union-attr]

        async def all_done() -> bool:
            states = [(await queue.status(i)).state for i in ids]
            return all(s is State.SUCCEEDED for s in states)

        await wait_for(all_done, timeout=30)
        assert (await queue.result(failing.job_id))[1] == "ok on 2"
        stats = await queue.stats()
        assert stats["total"]["queued"] == 0 and stats["total"]["running"] == 0
        assert worker.stats.refused == 0


async def test_cancel_replay_and_events_on_a_cluster(cluster_settings: Settings) -> None:
    async with await Queue.connect(cluster_settings, registry) as queue:
        got: list[bytes] = []
        sub = ShardSubscriber(
            queue.redis, [queue.keys.events(s) for s in range(16)], lambda c, d: got.append(d)
        )
        await sub.start()
        try:
            jobs = [await queue.submit("echo", i) for i in range(32)]
            for job in jobs:
                await queue.cancel(job.job_id)

            async def all_events() -> bool:
                return len(got) == 64

            await wait_for(all_events)
        finally:
            await sub.stop()
        dead = await queue.submit("fail", {"fatal": True})
        await worker_for(queue, registry, burst=True).run()
        assert [d.id for d in await queue.dead_letters()] == [dead.job_id]
        assert (await queue.replay(dead.job_id)).state is State.QUEUED


async def test_api_on_a_cluster(cluster_settings: Settings, start_api: StartApi) -> None:
    api = await start_api(redis_url=cluster_settings.redis_url, redis_cluster=True, shards=16)
    async with api.client() as c:
        jobs = [
            (await c.post("/v1/jobs", json={"type": "echo", "payload": i})).json()
            for i in range(40)
        ]
        statuses = await asyncio.gather(*(c.get(f"/v1/jobs/{j['id']}") for j in jobs))
        assert [s.json()["id"] for s in statuses] == [j["id"] for j in jobs]
        job = jobs[0]
        poll = asyncio.create_task(
            c.get(f"/v1/jobs/{job['id']}?wait=10", headers={"if-none-match": '"1"'})
        )
        await asyncio.sleep(0.2)
        assert (await c.post(f"/v1/jobs/{job['id']}/cancel")).status_code == 200
        assert (await poll).json()["state"] == "cancelled"
