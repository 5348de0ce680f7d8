"""A cancel that reaches a task while it talks to Redis is never lost: the call raises
CancelledError, so a deadline around Redis calls (``asyncio.timeout``) ends them, and a
cancelled task stops. On Python 3.11 redis-py's write (``asyncio.wait_for``) returned normally
when the cancel came just as it finished: more than half of the deadlines below went unseen,
and the loop under them ran on (store/redis.py, ``_Fast.send_packed_command``).

No timing is asserted: a lost cancel is seen as the task running on with a cancel requested
(``Task.cancelling()``), which a delivered one never allows."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from jobtier.config import Settings
from jobtier.core.model import JobSpec
from jobtier.engine.queue import Queue
from jobtier.store.redis import RedisClient, connect

pytestmark = pytest.mark.contract

ROUNDS = 150
DEADLINE = 0.002  # seconds: a few calls each, the deadline landing anywhere in one


async def deadlines_seen(call: Callable[[], Awaitable[Any]]) -> tuple[int, int]:
    """(rounds whose deadline ended them, calls that returned after a cancel was requested)."""
    task = asyncio.current_task()
    assert task is not None
    ended = lost = 0
    for _ in range(ROUNDS):
        try:
            async with asyncio.timeout(DEADLINE):
                while True:
                    await call()
                    if task.cancelling():  # the cancel came and the call returned anyway
                        lost += 1
                        break
        except TimeoutError:
            ended += 1
    return ended, lost


@pytest.fixture
async def client(settings: Settings) -> Any:
    redis: RedisClient = connect(settings)
    yield redis
    await redis.aclose()


async def test_a_deadline_ends_plain_commands_and_pipelines(client: RedisClient) -> None:
    await client.set("jt:k", "v")

    async def pipeline() -> Any:
        pipe = client.pipeline(transaction=False)
        pipe.get("jt:k")
        pipe.get("jt:k")
        return await pipe.execute()

    for call in (lambda: client.get("jt:k"), lambda: client.hget("jt:h", "f"), pipeline):
        assert await deadlines_seen(call) == (ROUNDS, 0)
    assert await client.get("jt:k") == b"v"  # the client still works after all those cancels


async def test_a_deadline_ends_status_reads(settings: Settings) -> None:
    queue = await Queue.connect(settings, catalog=False)
    try:
        (sub,) = await queue.submit_many([JobSpec(type="echo", payload=1)])
        assert await deadlines_seen(lambda: queue.status(sub.job_id)) == (ROUNDS, 0)
        assert (await queue.status(sub.job_id)).id == sub.job_id
    finally:
        await queue.close()


async def test_a_cancelled_task_stops_in_its_redis_call(client: RedisClient) -> None:
    """``task.cancel(); await task`` ends the task the first time, each time."""
    for _ in range(ROUNDS):
        calls = 0

        async def loop() -> None:
            nonlocal calls
            me = asyncio.current_task()
            while True:
                await client.get("jt:k")
                calls += 1
                if me is not None and me.cancelling():
                    raise AssertionError("the cancel was lost in the call; the task ran on")

        task = asyncio.create_task(loop())
        while calls < 2 and not task.done():  # cancelled in the middle of its calls
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
