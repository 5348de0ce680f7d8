"""Dramatiq driver for bench/compare.py (see driver.py for the protocol).

enqueue: ``Actor.send`` once per job (Dramatiq has no bulk enqueue; a group sends one message
per actor call too), one at a time. worker: one ``dramatiq.Worker`` in this process with
``worker_threads`` = ``--concurrency`` and ``worker_timeout`` = ``--worker-timeout`` (100 ms;
Dramatiq's Redis consumer polls with a back-off up to this bound when its queue is empty,
1,000 ms by default); Dramatiq's default middleware. A job counts as finished at the
``after_process_message`` middleware hook.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import dramatiq
from dramatiq import Middleware, Worker
from dramatiq.brokers.redis import RedisBroker
from driver import Countdown, Enqueueing, emit, parse

args = parse(__doc__.split("\n\n")[0], worker_timeout=100)
broker = RedisBroker(url=args.url)
dramatiq.set_broker(broker)


@dramatiq.actor(queue_name="compare")
def noop(n: int) -> None:
    return None


class Finished(Middleware):
    def __init__(self, countdown: Countdown) -> None:
        self.countdown = countdown

    def after_process_message(
        self, broker: Any, message: Any, *, result: Any = None, exception: Any = None
    ) -> None:
        self.countdown.finished(exception is None)


def enqueue() -> None:
    broker.client.ping()
    with Enqueueing():
        for n in range(args.jobs):
            noop.send(n)


def work() -> None:
    broker.add_middleware(Finished(Countdown(args.jobs)))
    worker = Worker(broker, worker_threads=args.concurrency, worker_timeout=args.worker_timeout)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    worker.start()
    emit(ready=True)
    while not stop.wait(0.5):
        pass
    worker.stop()


if __name__ == "__main__":
    enqueue() if args.role == "enqueue" else work()
