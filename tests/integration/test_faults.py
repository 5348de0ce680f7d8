"""Faults: a worker killed mid-job, a Redis restart. Nothing acknowledged is lost."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from jobtier.config import Settings
from jobtier.core.errors import Code
from jobtier.core.model import JobSpec, State
from jobtier.dev.local_redis import LocalRedis
from jobtier.engine.queue import Queue
from jobtier.scheduler import Scheduler
from jobtier.store.calls import complete_call
from tests.fixtures.engine import Background, wait_for, worker_for
from tests.tasks import registry


def worker_process(settings: Settings, *args: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.update(
        JOBTIER_REDIS_URL=settings.redis_url,
        JOBTIER_SHARDS=str(settings.shards),
        JOBTIER_LEASE_SECONDS=str(settings.lease_seconds),
    )
    return subprocess.Popen(
        [sys.executable, "-m", "jobtier.cli.main", "worker", "tests.tasks:registry", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        # inherited: pytest captures its log with the test's (a pipe nobody reads would
        # block the worker once full, and leak)
    )


async def test_killed_worker_jobs_are_reclaimed_and_its_late_writes_refused(
    settings: Settings, background: Background
) -> None:
    settings = settings.replace(lease_seconds=1.5)
    queue = await Queue.connect(settings, registry)
    try:
        subs = await queue.submit_many([JobSpec(type="slow_first") for _ in range(5)])
        ids = [s.job_id for s in subs]
        proc = worker_process(settings, "--concurrency", "10")
        try:

            async def all_running() -> bool:
                return all([(await queue.status(i)).state is State.RUNNING for i in ids])

            await wait_for(all_running, timeout=20)
            leases = {i: await queue.status(i) for i in ids}  # version == the lease_version
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
        background.start(Scheduler(queue.store))
        background.start(worker_for(queue, registry))

        async def all_succeeded() -> bool:
            return all([(await queue.status(i)).state is State.SUCCEEDED for i in ids])

        await wait_for(all_succeeded, timeout=30)
        for i in ids:
            status, result = await queue.result(i)
            assert status.attempt == 2 and result == "done on attempt 2"
            assert status.worker != leases[i].worker
            # the killed worker wakes up and reports success with what it was given: refused
            old = leases[i]
            assert old.worker is not None
            (code,) = await queue.scripts.call(
                *complete_call(
                    queue.keys.shard_of(i), old.worker, 60, [(i, old.version, b'"stale"')]
                )
            )
            assert Code(code) is Code.WRONG_STATE
            assert (await queue.result(i))[1] == "done on attempt 2"
    finally:
        await background.stop()  # the worker and scheduler use the queue: they stop first
        await queue.close()


async def test_jobs_survive_a_redis_restart(
    redis_server: LocalRedis, settings: Settings, background: Background
) -> None:
    queue = await Queue.connect(settings, registry)
    try:
        subs = await queue.submit_many([JobSpec(type="echo", payload=i) for i in range(200)])
        ids = [s.job_id for s in subs]
        redis_server.restart()  # SIGTERM: Redis writes its AOF and exits; then starts again
        await queue.scripts.load()  # a new server has an empty script cache (call_many reloads too)
        worker = worker_for(queue, registry)
        background.start(worker)

        async def all_done() -> bool:
            states = {(await queue.status(i)).state for i in ids}
            return states == {State.SUCCEEDED}

        await wait_for(all_done, timeout=30)
        later = await queue.submit("echo", "after restart")
        redis_server.restart()  # and again, with the worker connected and idle

        async def later_done() -> bool:
            try:
                return (await queue.status(later.job_id)).state is State.SUCCEEDED
            except Exception:
                return False

        await wait_for(later_done, timeout=30)
        newest = await queue.submit("echo", "after second restart")

        async def newest_done() -> bool:
            return (await queue.status(newest.job_id)).state is State.SUCCEEDED

        await wait_for(newest_done, timeout=30)
    finally:
        await background.stop()  # the worker and scheduler use the queue: they stop first
        await queue.close()
