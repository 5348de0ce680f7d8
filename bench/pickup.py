"""Benchmark: how soon an idle worker starts a job, how late a delayed job starts, idle CPU.

Starts its own Redis (AOF on), one ``jobtier worker jobtier.demo`` and one ``jobtier
scheduler`` process (the real CLI, uvloop), and a producer (this process) that subscribes to
the shards' event channels. It measures:

* pickup: jobs submitted one at a time, with a random pause before each (so the worker has
  gone idle, asleep on its wake channels); pickup = the job's ``running`` event arriving
  here minus the submit's acknowledgement (producer's clock, sub-millisecond). Cross-check
  on Redis's clock: the running status document's ``updated_at`` minus the submitted one's
  (1 ms resolution). Floor for comparison: the submit round trip itself;
* delayed jobs: submitted with a run-at a few hundred ms ahead, a new one every ~50 ms so
  several wait at once; lateness = the ``running`` event's arrival (wall clock) minus
  run-at, and on Redis's clock the running document's ``updated_at`` minus run-at;
* idle CPU of the worker, the scheduler and Redis over ``--idle`` seconds with nothing to
  do (``/proc/<pid>/stat``; Redis's ``INFO cpu``).

Target (issue 2): pickup p99 < 50 ms, delayed start p99 < 50 ms, near-zero idle CPU.

    .venv/bin/python bench/pickup.py                 # 500 jobs, 200 delayed, 10 s idle
    .venv/bin/python bench/pickup.py --quick

Results: bench/results/pickup.json and bench/results/pickup.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    environment,
    fmt,
    header_markdown,
    local_redis,
    percentile,
    proc_cpu,
    redis_cpu,
    save,
    table,
)

from jobtier.config import Settings
from jobtier.core.model import JobStatus, decode_status
from jobtier.dev.local_redis import terminate
from jobtier.engine.queue import Queue
from jobtier.store.subscriber import ShardSubscriber


def iso_ms(value: str) -> float:
    return datetime.fromisoformat(value).timestamp() * 1000


class Watcher:
    """Timestamps each job's ``running`` event as it arrives on the shard channels."""

    def __init__(self) -> None:
        self.running: dict[str, tuple[float, float, JobStatus]] = {}  # id: perf, wall, doc
        self.waiters: dict[str, asyncio.Future[None]] = {}

    def on_event(self, channel: bytes, data: bytes) -> None:
        perf, wall = time.perf_counter(), time.time()
        head, _, doc = data.partition(b"\n")
        if b'"state":"running"' not in doc:
            return
        job_id = head.split(b" ", 1)[0].decode()
        self.running.setdefault(job_id, (perf, wall, decode_status(doc)))
        waiter = self.waiters.pop(job_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, job_id: str, timeout: float = 10.0) -> tuple[float, float, JobStatus]:
        if job_id not in self.running:
            self.waiters[job_id] = asyncio.get_running_loop().create_future()
            async with asyncio.timeout(timeout):
                await self.waiters[job_id]
        return self.running[job_id]


def queue_names(n: int) -> list[str]:
    """The queues the worker serves: ``default`` (the demo tasks') and n - 1 more."""
    return ["default", *(f"q{i}" for i in range(1, n))]


def start_process(
    kind: str, url: str, shards: int, queues: list[str] | None = None
) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "JOBTIER_REDIS_URL": url,
        "JOBTIER_SHARDS": str(shards),
        "JOBTIER_LOG_LEVEL": "WARNING",
    }
    args = ["worker", "jobtier.demo", "--concurrency", "50"] if kind == "worker" else [kind]
    if kind == "worker" and queues:
        args += ["--queues", ",".join(queues)]
    return subprocess.Popen(
        [sys.executable, "-m", "jobtier.cli", *args], env=env, start_new_session=True
    )


async def wait_subscribers(queue: Queue, count: int, timeout: float = 20.0) -> None:
    """Until ``count`` processes listen on every shard's wake channel (they are idle)."""
    channels = [queue.keys.wake(s) for s in range(queue.keys.shards)]
    async with asyncio.timeout(timeout):
        while True:
            reply = await queue.redis.execute_command("PUBSUB", "SHARDNUMSUB", *channels)
            if all(int(n) >= count for n in reply[1::2]):
                return
            await asyncio.sleep(0.05)


async def measure_pickup(
    queue: Queue, watcher: Watcher, args: argparse.Namespace
) -> dict[str, Any]:
    rng = random.Random(1)
    pickup, pickup_redis, submit_rtt = [], [], []
    names = queue_names(args.queues)
    for i in range(args.jobs):
        await asyncio.sleep(rng.uniform(args.pause_min, args.pause_max))
        sent = time.perf_counter()
        job = await queue.submit("echo", {"x": 1}, queue=names[i % len(names)])
        ack = time.perf_counter()
        run_perf, _, status = await watcher.wait(job.job_id)
        pickup.append(1000 * (run_perf - ack))
        submit_rtt.append(1000 * (ack - sent))
        pickup_redis.append(iso_ms(status.updated_at) - iso_ms(job.status.updated_at))
    return {"pickup_ms": pickup, "pickup_redis_ms": pickup_redis, "submit_rtt_ms": submit_rtt}


async def measure_delayed(
    queue: Queue, watcher: Watcher, args: argparse.Namespace
) -> dict[str, Any]:
    rng = random.Random(2)
    submitted = []
    for _ in range(args.delayed):
        await asyncio.sleep(rng.uniform(0.03, 0.07))
        run_at = time.time() + rng.uniform(0.2, 0.4)
        job = await queue.submit("echo", {"x": 1}, run_at=run_at)
        submitted.append((job.job_id, round(run_at * 1000)))
    late, late_redis = [], []
    for job_id, run_at_ms in submitted:
        _, wall, status = await watcher.wait(job_id)
        late.append(wall * 1000 - run_at_ms)
        late_redis.append(iso_ms(status.updated_at) - run_at_ms)
    return {"lateness_ms": late, "lateness_redis_ms": late_redis}


async def measure_idle(
    queue: Queue, procs: dict[str, subprocess.Popen[bytes]], seconds: float
) -> dict[str, float]:
    await asyncio.sleep(1.0)  # let the last jobs' reports and heartbeats settle
    before = {name: proc_cpu(p.pid) for name, p in procs.items()}
    redis_before = await redis_cpu(queue.redis)
    await asyncio.sleep(seconds)
    out = {name: proc_cpu(p.pid) - before[name] for name, p in procs.items()}
    out["redis"] = await redis_cpu(queue.redis) - redis_before
    return out


async def main(args: argparse.Namespace) -> dict[str, Any]:
    with local_redis(aof=True) as server:
        settings = Settings.from_env({}, redis_url=server.url, shards=args.shards)
        procs: dict[str, subprocess.Popen[bytes]] = {}
        try:
            async with await Queue.connect(settings, catalog=False) as queue:
                procs["worker"] = start_process(
                    "worker", server.url, args.shards, queue_names(args.queues)
                )
                procs["scheduler"] = start_process("scheduler", server.url, args.shards)
                await wait_subscribers(queue, 2)
                watcher = Watcher()
                events = ShardSubscriber(
                    queue.redis,
                    [queue.keys.events(s) for s in range(args.shards)],
                    watcher.on_event,
                    name="bench-pickup",
                )
                await events.start()
                try:
                    await asyncio.sleep(0.5)
                    result = await measure_pickup(queue, watcher, args)
                    result.update(await measure_delayed(queue, watcher, args))
                finally:
                    await events.stop()
                result["idle_cpu_s"] = await measure_idle(queue, procs, args.idle)
        finally:
            for p in procs.values():
                terminate(p)
    return result


def summarise(raw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in (
        "pickup_ms",
        "pickup_redis_ms",
        "submit_rtt_ms",
        "lateness_ms",
        "lateness_redis_ms",
    ):
        v = raw[key]
        out[key] = {
            "n": len(v),
            "p50": percentile(v, 50),
            "p99": percentile(v, 99),
            "max": max(v),
            "min": min(v),
        }
    out["idle_cpu_s"] = raw["idle_cpu_s"]
    return out


def render(s: dict[str, Any], args: argparse.Namespace, env: dict[str, Any]) -> str:
    out = [header_markdown("Pickup latency and idle cost", env)]
    out.append(
        f"One `jobtier worker jobtier.demo` (concurrency 50, serving {args.queues} queue(s), "
        f"the jobs spread over them) and one `jobtier scheduler`, "
        f"{args.shards} shards, Redis with AOF on (everysec). Immediate jobs: a random pause of "
        f"{args.pause_min * 1000:.0f}-{args.pause_max * 1000:.0f} ms before each submit, so the "
        f"worker is idle each time. Target: p99 < 50 ms.\n"
    )
    labels = (
        ("pickup_ms", "pickup: submit acknowledged → `running` event (producer's clock)"),
        (
            "pickup_redis_ms",
            "pickup on Redis's clock: running - submitted `updated_at` (1 ms steps)",
        ),
        ("submit_rtt_ms", "floor: the submit round trip itself"),
        ("lateness_ms", "delayed job: `running` event - run-at (wall clock)"),
        ("lateness_redis_ms", "delayed job on Redis's clock: running `updated_at` - run-at"),
    )
    rows = [
        [label, fmt(s[k]["n"]), fmt(s[k]["p50"], 2), fmt(s[k]["p99"], 2), fmt(s[k]["max"], 2)]
        for k, label in labels
    ]
    out.append(table(["ms", "n", "p50", "p99", "max"], rows) + "\n")
    out.append(f"## Idle CPU over {args.idle:g} s (nothing to do)\n")
    rows = [
        [name, fmt(cpu, 3), f"{100 * cpu / args.idle:.2f} %"]
        for name, cpu in s["idle_cpu_s"].items()
    ]
    out.append(table(["process", "CPU seconds", "share of one core"], rows) + "\n")
    return "\n".join(out)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=500, help="immediate jobs, one at a time (500)")
    p.add_argument("--delayed", type=int, default=200, help="delayed jobs (200)")
    p.add_argument("--pause-min", type=float, default=0.02, help="s before a submit (0.02)")
    p.add_argument("--pause-max", type=float, default=0.06, help="s before a submit (0.06)")
    p.add_argument("--idle", type=float, default=10.0, help="idle period measured, s (10)")
    p.add_argument("--shards", type=int, default=16, help="logical shards (16)")
    p.add_argument(
        "--queues", type=int, default=1, help="queues the worker serves, jobs spread over them (1)"
    )
    p.add_argument("--quick", action="store_true", help="100 jobs, 50 delayed, 3 s idle")
    p.add_argument("--no-save", action="store_true", help="print only; keep results files")
    args = p.parse_args(argv)
    if args.quick:
        args.jobs, args.delayed, args.idle = min(args.jobs, 100), min(args.delayed, 50), 3.0
    return args


def run(argv: list[str] | None = None) -> None:
    import uvloop

    args = parse(argv)
    env = environment()
    raw = uvloop.run(main(args))
    summary = summarise(raw)
    text = render(summary, args, env)
    print(text)
    if not args.no_save:
        name = "pickup" if args.queues <= 1 else f"pickup-{args.queues}-queues"
        paths = save(name, {**env, "arguments": vars(args), "summary": summary, "raw": raw}, text)
        print(f"\nsaved {paths[0]} and {paths[1]}")


if __name__ == "__main__":
    run()
