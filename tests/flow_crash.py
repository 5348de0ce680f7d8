"""Processes that die by SIGKILL at a chosen point of a flow's life, for the crash tests
(tests/integration/test_flows_crash.py). Run as ``python -m tests.flow_crash <role>`` with
the ``JOBTIER_*`` settings in the environment:

resolver        a resolver that sends the first half of its first batch of resolve.lua
                calls, then kills itself: some dependents told, none acknowledged
worker-complete a worker that kills itself as soon as Redis has taken a success (the
                hand-off to the dependents is in Redis; nobody has applied it)
worker-fail     a worker that kills itself as soon as Redis has taken a failure for good
worker-fail-unsent
                a worker that kills itself when a task has failed, before it tells Redis
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from jobtier.config import Settings
from jobtier.engine.queue import Queue
from jobtier.flows.resolver import Resolver
from jobtier.store.calls import Call
from jobtier.worker.runner import Worker
from jobtier.worker.state import Running
from tests.tasks import registry


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


async def resolver(queue: Queue) -> None:
    real = queue.scripts.call_many

    async def half_then_die(calls: Sequence[Call]) -> list[Any]:
        if any(name == "resolve" for name, _, _ in calls):
            half = calls[: max(1, len(calls) // 2)]
            await real(half)  # applied in Redis: these dependents have been told
            die()
        return await real(calls)

    queue.scripts.call_many = half_then_die  # type: ignore[method-assign]
    await Resolver(queue.store, name="doomed").run()


async def worker(queue: Queue, dies_on: str, reached: bytes, unsent: bool = False) -> None:
    """A worker that dies right after Redis answered a report of kind ``dies_on`` whose job
    ``reached`` that state (``unsent``: as soon as such a report is made, before it is sent)."""
    dying = Worker(queue.store, registry, concurrency=4)
    reporter = dying.reporter
    report, account = reporter.report, reporter.account

    def report_or_die(kind: str, r: Running, extra: tuple[Any, ...]) -> None:
        if unsent and kind == dies_on:
            die()
        report(kind, r, extra)

    def account_then_die(kind: str, items: list[tuple[Any, ...]], reply: list[Any]) -> None:
        account(kind, items, reply)
        if kind != dies_on:
            return
        states = [b"succeeded"] * len(reply) if kind == "complete" else reply[1::2]
        if reached in states:
            die()

    reporter.report = report_or_die  # type: ignore[method-assign]
    reporter.account = account_then_die  # type: ignore[method-assign]
    await dying.run()


async def main(role: str) -> None:
    queue = await Queue.connect(Settings.from_env(), registry)
    print("ready", flush=True)
    if role == "resolver":
        await resolver(queue)
    elif role == "worker-complete":
        await worker(queue, "complete", b"succeeded")
    elif role == "worker-fail":
        await worker(queue, "fail", b"failed")
    elif role == "worker-fail-unsent":
        await worker(queue, "fail", b"failed", unsent=True)
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
