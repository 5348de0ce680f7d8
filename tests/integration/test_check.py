"""`jobtier check ROLE`: the health check for processes that serve no port."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

from jobtier.config import Settings
from tests.fixtures.engine import wait_for
from tests.integration.test_faults import worker_process


async def check(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, JOBTIER_REDIS_URL=settings.redis_url, JOBTIER_SHARDS="4")
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "jobtier.cli.main", "check", *args],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


async def test_check_follows_a_worker_alive_then_hung(settings: Settings) -> None:
    r = await check(settings, "worker")
    assert r.returncode == 1 and "no worker process on host" in r.stderr
    assert "none in the last 1 h" in r.stderr
    proc = worker_process(settings)
    try:

        async def alive() -> bool:
            return (await check(settings, "worker", "--max-age", "3")).returncode == 0

        await wait_for(alive, timeout=30)
        r = await check(settings, "worker")
        assert r.returncode == 0 and f":{proc.pid}: alive, published" in r.stdout
        assert (await check(settings, "scheduler")).returncode == 1  # another role: none
        # one process singled out by its pid: this one is alive, another pid is not
        assert (await check(settings, "worker", "--pid", str(proc.pid))).returncode == 0
        r = await check(settings, "worker", "--pid", str(proc.pid + 100_000))
        assert r.returncode == 1 and f"with pid {proc.pid + 100_000}" in r.stderr, r.stderr
        r = await check(settings, "worker", "--pid", str(proc.pid), "--any-host")
        assert r.returncode == 2 and "not with --any-host" in r.stderr, r.stderr
        proc.send_signal(signal.SIGSTOP)  # hung: it stops publishing

        async def failing() -> bool:
            r = await check(settings, "worker", "--max-age", "3")
            return r.returncode == 1 and "the latest" in r.stderr

        await wait_for(failing, timeout=30)

        async def gone_past_fresh() -> bool:  # past the 15 s a snapshot counts as live
            r = await check(settings, "worker")
            return r.returncode == 1 and "the latest" in r.stderr

        await wait_for(gone_past_fresh, timeout=90, interval=1)
        proc.send_signal(signal.SIGCONT)
        await wait_for(alive, timeout=30)
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(10)


async def test_check_says_when_redis_is_unreachable(settings: Settings) -> None:
    down = settings.replace(redis_url="redis://127.0.0.1:1/0")
    r = await check(down, "persister")
    assert r.returncode == 1 and "Redis unreachable" in r.stderr
