"""RQ driver for bench/compare.py (see driver.py for the protocol).

enqueue: ``Queue.enqueue_many`` with ``Queue.prepare_data``, ``--batch`` (500) jobs per call
(one Redis pipeline each), one call at a time. worker: one ``SimpleWorker`` (runs jobs in its
own process, no fork per job; RQ has no concurrency within a worker), logging at WARNING (as
``rq worker --quiet``); a job counts as finished once ``handle_job_success`` has written its
result and registries. Other settings are RQ's defaults (results kept 500 s).
"""

from __future__ import annotations

from typing import Any

from driver import Countdown, Enqueueing, emit, parse
from redis import Redis
from rq import Queue, SimpleWorker

FUNCTION = "drive_rq.noop"  # the worker imports this module by name (its folder is on sys.path)


def noop(n: int) -> None:
    return None


def enqueue(args: Any) -> None:
    queue = Queue(connection=Redis.from_url(args.url))
    queue.connection.ping()
    with Enqueueing():
        for i in range(0, args.jobs, args.batch):
            batch = range(i, min(i + args.batch, args.jobs))
            queue.enqueue_many([Queue.prepare_data(FUNCTION, args=(n,)) for n in batch])


def work(args: Any) -> None:
    countdown = Countdown(args.jobs)

    class CountingWorker(SimpleWorker):
        def handle_job_success(self, *a: Any, **kw: Any) -> None:
            super().handle_job_success(*a, **kw)
            countdown.finished()

        def handle_job_failure(self, *a: Any, **kw: Any) -> None:
            super().handle_job_failure(*a, **kw)
            countdown.finished(ok=False)

    connection = Redis.from_url(args.url)
    worker = CountingWorker([Queue(connection=connection)], connection=connection)
    emit(ready=True)
    worker.work(logging_level="WARNING")  # until SIGTERM


if __name__ == "__main__":
    arguments = parse(__doc__.split("\n\n")[0])
    enqueue(arguments) if arguments.role == "enqueue" else work(arguments)
