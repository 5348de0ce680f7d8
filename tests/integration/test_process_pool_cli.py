"""`jobtier worker --executor process` as a process of its own: its plain def tasks run in its
children, and a SIGTERM leaves no child behind."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

from jobtier.config import Settings
from jobtier.core.model import State
from jobtier.engine.queue import Queue
from tests.fixtures.engine import wait_for
from tests.procpool_tasks import registry

ROOT = Path(__file__).parents[2]
HANG_GUARD = 60.0  # s: only stops a broken test from hanging


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_the_worker_command_runs_plain_tasks_in_its_children(
    queue: Queue, settings: Settings, tmp_path: Path
) -> None:
    queue.produce.tasks = registry
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBTIER_")}
    env.update(
        JOBTIER_REDIS_URL=settings.redis_url,
        JOBTIER_SHARDS=str(settings.shards),
        # this tree's sources first, whatever the virtualenv has installed
        PYTHONPATH=os.pathsep.join(str(ROOT / p) for p in ("src", "")),
    )
    log = tmp_path / "worker.log"
    command = [sys.executable, "-m", "jobtier.cli.main", "worker", "tests.procpool_tasks"]
    options = ["--executor", "process", "--processes", "1", "--process-max-jobs", "2"]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*command, *options],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        subs = [await queue.submit("plain", None) for _ in range(3)]

        async def done() -> bool:
            assert proc.poll() is None, log.read_text()[-3000:]
            states = [(await queue.status(s.job_id)).state for s in subs]
            return all(s is State.SUCCEEDED for s in states)

        await wait_for(done, HANG_GUARD)
        pids = [(await queue.result(s.job_id))[1]["pid"] for s in subs]
        assert proc.pid not in pids  # not the worker's threads: its children
        assert len(set(pids)) == 2  # a child's two jobs, then its replacement's
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(asyncio.to_thread(proc.wait), HANG_GUARD)
        assert code == 0, log.read_text()[-3000:]
        assert not any(alive(pid) for pid in pids), "a child outlived its worker"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
