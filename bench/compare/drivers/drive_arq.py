"""arq driver for bench/compare.py (see driver.py for the protocol).

enqueue: ``ArqRedis.enqueue_job`` once per job (arq has no bulk enqueue), ``--in-flight`` (50)
calls at a time. worker: one ``arq.Worker`` with ``max_jobs`` = ``--concurrency`` (50) and
``poll_delay`` = ``--poll-delay`` (0.01 s; arq's default is 0.5 s: arq polls its queue, it has
no blocking pop or wake-up channel); a job counts as finished in the ``after_job_end`` hook,
which arq runs after it has recorded the result. Other settings are arq's defaults (results
kept 3600 s). Both run under uvloop.
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvloop
from arq import Worker, create_pool
from arq.connections import RedisSettings
from driver import Countdown, Enqueueing, emit, parse


async def noop(ctx: dict[str, Any], n: int) -> None:
    return None


async def enqueue(args: Any) -> None:
    redis = await create_pool(RedisSettings.from_dsn(args.url))
    jobs = iter(range(args.jobs))

    async def one_at_a_time() -> None:
        for n in jobs:
            await redis.enqueue_job("noop", n)

    with Enqueueing():
        await asyncio.gather(*(one_at_a_time() for _ in range(args.in_flight)))
    await redis.aclose()


async def work(args: Any) -> None:
    countdown = Countdown(args.jobs)

    async def ready(ctx: dict[str, Any]) -> None:
        emit(ready=True)

    async def after(ctx: dict[str, Any]) -> None:
        countdown.finished()  # after every job that ran to an end; a no-op does not fail

    worker = Worker(
        functions=[noop],
        redis_settings=RedisSettings.from_dsn(args.url),
        max_jobs=args.concurrency,
        poll_delay=args.poll_delay,
        on_startup=ready,
        after_job_end=after,
        handle_signals=True,
    )
    try:
        await worker.async_run()  # until SIGTERM
    finally:
        await worker.close()


def main() -> None:
    args = parse(__doc__.split("\n\n")[0], poll_delay=0.01)
    uvloop.run(enqueue(args) if args.role == "enqueue" else work(args))


if __name__ == "__main__":
    main()
