"""SAQ driver for bench/compare.py (see driver.py for the protocol).

enqueue: ``Queue.enqueue`` once per job (SAQ has no bulk enqueue), ``--in-flight`` (50) calls
at a time on one connection pool. worker: one ``saq.Worker`` at ``--concurrency`` (50); a job
counts as finished in the ``after_process`` hook, which SAQ runs after it has recorded the
job's final status. Both run under uvloop.
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvloop
from driver import Countdown, Enqueueing, emit, parse
from saq import Queue, Status, Worker


async def noop(ctx: dict[str, Any], **kwargs: Any) -> None:
    return None


async def enqueue(args: Any) -> None:
    queue = Queue.from_url(args.url)
    await queue.connect()
    jobs = iter(range(args.jobs))

    async def one_at_a_time() -> None:
        for n in jobs:
            await queue.enqueue("noop", n=n)

    with Enqueueing():
        await asyncio.gather(*(one_at_a_time() for _ in range(args.in_flight)))
    await queue.disconnect()


async def work(args: Any) -> None:
    queue = Queue.from_url(args.url)
    countdown = Countdown(args.jobs)

    async def ready(ctx: dict[str, Any]) -> None:
        emit(ready=True)

    async def after(ctx: dict[str, Any]) -> None:
        countdown.finished(ctx["job"].status == Status.COMPLETE)

    worker = Worker(
        queue, functions=[noop], concurrency=args.concurrency, startup=ready, after_process=after
    )
    await worker.start()  # until SIGTERM


def main() -> None:
    args = parse(__doc__.split("\n\n")[0])
    uvloop.run(enqueue(args) if args.role == "enqueue" else work(args))


if __name__ == "__main__":
    main()
