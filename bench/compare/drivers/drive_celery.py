"""Celery driver for bench/compare.py (see driver.py for the protocol).

Broker: Redis (kombu's Redis transport), no result backend (``task_ignore_result``: nothing
here reads a result, and a backend would add writes). enqueue: ``Task.apply_async`` once per
job (Celery has no bulk publish; ``group`` sends one message per task too), all through one
producer from ``app.producer_or_acquire()``. worker: ``app.worker_main`` in this process with
``--pool`` (``solo``: the fastest of the pools for no-op tasks on this machine; ``threads`` with
``--concurrency`` is the alternative) and ``--prefetch-multiplier`` (``worker_prefetch_multiplier``,
default 4 as in Celery); heartbeat, mingle and gossip off (they talk to other workers: there
are none). A job counts as finished at the ``task_postrun`` signal, after the task returned.
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.signals import task_postrun, worker_ready
from driver import Countdown, Enqueueing, emit, parse

args = parse(__doc__.split("\n\n")[0], pool="solo", prefetch_multiplier=4)
app = Celery("compare", broker=args.url)
app.conf.update(
    task_ignore_result=True,
    worker_prefetch_multiplier=args.prefetch_multiplier,
    worker_hijack_root_logger=False,
    worker_redirect_stdouts=False,  # our report lines go to stdout as they are
    broker_connection_retry_on_startup=True,
)


@app.task(name="noop")
def noop(n: int) -> None:
    return None


def enqueue() -> None:
    with app.producer_or_acquire() as producer:
        producer.connection.ensure_connection()  # connect before the clock starts
        with Enqueueing():
            for n in range(args.jobs):
                noop.apply_async((n,), producer=producer)


def work() -> None:
    countdown = Countdown(args.jobs)

    @worker_ready.connect
    def ready(**kwargs: Any) -> None:
        emit(ready=True)

    @task_postrun.connect
    def after(state: str | None = None, **kwargs: Any) -> None:
        countdown.finished(state == "SUCCESS")

    concurrency = 1 if args.pool == "solo" else args.concurrency
    app.worker_main(
        [
            "worker", f"--pool={args.pool}", f"--concurrency={concurrency}",
            "--loglevel=WARNING", "--without-heartbeat", "--without-mingle", "--without-gossip",
        ]
    )  # fmt: skip


if __name__ == "__main__":
    enqueue() if args.role == "enqueue" else work()
