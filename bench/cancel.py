"""Benchmark: how soon a running job stops after a cancel request, with the push and without.

Starts its own Redis (AOF on). One process, one event loop: a worker (concurrency 10), the
producer that submits and cancels, and an observer subscribed to the shards' event channels.
The system is idle: one job at a time. For each sample a job of a task that holds until it
is cancelled is submitted; once its ``running`` event has arrived and a random pause has
passed (10-50 ms with the push; up to a heartbeat interval without it, so that requests fall
anywhere between two heartbeats), the producer asks to cancel it (``Queue.cancel``, the script the API's cancel route
runs) and measures, on its clock (``perf_counter``):

* request → task sees it: the task notes the moment its cancellation reaches it (an async
  task: the ``CancelledError`` at its ``await``; a sync task: ``ctx.cancel_requested`` seen
  by its loop, which polls every millisecond);
* request → ``cancelled``: the job's ``cancelled`` event arrives at the observer (the job
  is then ``cancelled`` in Redis, and every status reader is told).

Two modes in the same run: ``push`` (the worker acts on cancel.lua's publication on the
shard's wake channel) and ``heartbeat`` (``Worker(cancel_push=False)``: the request waits
for the worker's next heartbeat, every lease/3). The heartbeat mode runs with
``--lease`` seconds (default 3: a heartbeat a second) so that it takes seconds, not minutes;
its latency is spread evenly over one heartbeat interval, so at the default lease of 30 s
(a heartbeat every 10 s) expect ten times the figures shown.

    .venv/bin/python bench/cancel.py            # 300 push samples, 40 heartbeat, per task kind
    .venv/bin/python bench/cancel.py --quick

Results: bench/results/cancel.json and bench/results/cancel.md.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, fmt, header_markdown, local_redis, percentile, save, table

from jobtier.config import Settings
from jobtier.engine.queue import Queue
from jobtier.store.subscriber import ShardSubscriber
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import TaskRegistry, task
from jobtier.worker.runner import Worker

SEEN: dict[str, float] = {}  # job id -> perf_counter when the task saw its cancellation


@task(retries=0)
async def hold(ctx: JobContext, payload: Any) -> None:
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        SEEN[ctx.job_id] = time.perf_counter()
        raise


@task(retries=0)
def hold_sync(ctx: JobContext, payload: Any) -> None:
    deadline = time.monotonic() + 3600
    while not ctx.cancel_requested and time.monotonic() < deadline:
        time.sleep(0.001)
    SEEN[ctx.job_id] = time.perf_counter()
    ctx.check_cancelled()  # raises Cancelled: the task stopped for the request


REGISTRY = TaskRegistry([hold, hold_sync])


class Observer:
    """Timestamps each job's first event in a given state as it arrives."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, bytes], float] = {}
        self.waiters: dict[tuple[str, bytes], asyncio.Future[float]] = {}

    def on_event(self, channel: bytes, data: bytes) -> None:
        now = time.perf_counter()
        head, _, doc = data.partition(b"\n")
        start = doc.find(b'"state":"') + 9
        key = (head.split(b" ", 1)[0].decode(), doc[start : doc.find(b'"', start)])
        self.seen.setdefault(key, now)
        waiter = self.waiters.pop(key, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(now)

    async def wait(self, job_id: str, state: bytes, timeout: float) -> float:
        key = (job_id, state)
        if key not in self.seen:
            self.waiters[key] = asyncio.get_running_loop().create_future()
            async with asyncio.timeout(timeout):
                await self.waiters[key]
        return self.seen[key]


async def measure(
    settings: Settings, mode: str, kind: str, samples: int, observer: Observer
) -> dict[str, list[float]]:
    seen_ms: list[float] = []
    cancelled_ms: list[float] = []
    rng = random.Random(f"{mode}-{kind}")
    async with (
        await Queue.connect(settings, REGISTRY) as producer,
        await Queue.connect(settings, REGISTRY) as engine,
    ):
        worker = Worker(engine.store, REGISTRY, concurrency=10, cancel_push=mode == "push")
        running = asyncio.create_task(worker.run())
        timeout = settings.lease_seconds + 10
        try:
            for _ in range(samples):
                job = await producer.submit(kind, None)
                await observer.wait(job.job_id, b"running", timeout)
                # without the push the latency is the wait for the next heartbeat: the pause
                # spreads the requests over the interval (else they lock to its phase)
                longest = 0.05 if mode == "push" else settings.lease_seconds / 3
                await asyncio.sleep(rng.uniform(0.01, longest))
                asked = time.perf_counter()
                await producer.cancel(job.job_id)
                done = await observer.wait(job.job_id, b"cancelled", timeout)
                seen_ms.append(1000 * (SEEN.pop(job.job_id) - asked))
                cancelled_ms.append(1000 * (done - asked))
        finally:
            worker.stop(now=True)
            await running
    return {"seen_ms": seen_ms, "cancelled_ms": cancelled_ms}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    with local_redis(aof=True) as server:
        settings = Settings.from_env(
            {}, redis_url=server.url, shards=args.shards, lease_seconds=args.lease
        )
        observer = Observer()
        async with await Queue.connect(settings, catalog=False) as queue:
            events = ShardSubscriber(
                queue.redis,
                [queue.keys.events(s) for s in range(args.shards)],
                observer.on_event,
                name="bench-cancel",
            )
            await events.start()
            try:
                out: dict[str, Any] = {}
                for mode, samples in (("push", args.samples), ("heartbeat", args.heartbeat)):
                    for kind in ("hold", "hold_sync"):
                        out[f"{mode}/{kind}"] = await measure(
                            settings, mode, kind, samples, observer
                        )
            finally:
                await events.stop()
    return out


def summarise(raw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case, values in raw.items():
        out[case] = {
            metric: {
                "n": len(v),
                "p50": percentile(v, 50),
                "p90": percentile(v, 90),
                "p99": percentile(v, 99),
                "max": max(v),
            }
            for metric, v in values.items()
        }
    return out


KINDS = {"hold": "async (at an await)", "hold_sync": "sync (polls every 1 ms)"}


def render(s: dict[str, Any], args: argparse.Namespace, env: dict[str, Any]) -> str:
    out = [header_markdown("Cancel latency: the push against the heartbeat", env)]
    out.append(
        f"One idle worker (concurrency 10) in the benchmark's process, {args.shards} shards, "
        f"Redis with AOF on; lease {args.lease:g} s (a heartbeat every {args.lease / 3:g} s). "
        "One running job at a time, cancelled 10-50 ms after its `running` event (without the "
        "push: 10 ms to a heartbeat interval after it); the clock starts as the cancel script "
        "is sent. Target: request → `cancelled` p99 < 100 ms with the push.\n"
    )
    rows = []
    for case, metrics in s.items():
        mode, kind = case.split("/")
        for metric, label in (("seen_ms", "→ task sees it"), ("cancelled_ms", "→ `cancelled`")):
            m = metrics[metric]
            rows.append([
                mode, KINDS[kind], label, fmt(m["n"]), fmt(m["p50"], 2), fmt(m["p90"], 2),
                fmt(m["p99"], 2), fmt(m["max"], 2),
            ])  # fmt: skip
    out.append(
        table(["mode", "task", "request (ms)", "n", "p50", "p90", "p99", "max"], rows) + "\n"
    )
    push = s["push/hold"]["cancelled_ms"]["p99"]
    beat = s["heartbeat/hold"]["cancelled_ms"]["p50"]
    out.append(
        f"With the push an async task's job is `cancelled` within {push:.1f} ms (p99); "
        f"without it the median is {beat:.0f} ms here (a heartbeat every {args.lease / 3:g} s), "
        "and it grows with the lease: at the default 30 s lease a request waits for the next "
        "heartbeat, up to 10 s.\n"
    )
    return "\n".join(out)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=300, help="push samples per task kind (300)")
    p.add_argument(
        "--heartbeat", type=int, default=40, help="heartbeat-only samples per task kind (40)"
    )
    p.add_argument("--lease", type=float, default=3.0, help="lease, s (3: a heartbeat a second)")
    p.add_argument("--shards", type=int, default=16, help="logical shards (16)")
    p.add_argument("--quick", action="store_true", help="60 push and 10 heartbeat samples")
    p.add_argument("--no-save", action="store_true", help="print only; keep results files")
    args = p.parse_args(argv)
    if args.quick:
        args.samples, args.heartbeat = min(args.samples, 60), min(args.heartbeat, 10)
    return args


def run(argv: list[str] | None = None) -> None:
    import logging

    import uvloop

    logging.getLogger("jobtier").setLevel(logging.ERROR)  # the workers' stop notices
    args = parse(argv)
    env = environment()
    raw = uvloop.run(main(args))
    summary = summarise(raw)
    text = render(summary, args, env)
    print(text)
    if not args.no_save:
        paths = save(
            "cancel", {**env, "arguments": vars(args), "summary": summary, "raw": raw}, text
        )
        print(f"\nsaved {paths[0]} and {paths[1]}")


if __name__ == "__main__":
    run()
