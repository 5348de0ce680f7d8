"""Benchmark: webhook deliveries per second, and job throughput with and without the dispatcher.

Starts its own Redis (AOF on) and a durable Postgres in temporary folders, a fast receiver on
loopback (its own process: a bare keep-alive HTTP/1.1 responder answering 200) allow-listed
with JOBTIER_WEBHOOK_ALLOWED_HOSTS, and measures:

* deliveries/s: a tenant subscription on terminal states, a `jobtier dispatcher` process
  running, N jobs run by a worker; the clock runs from the first job's start until Postgres
  records every delivery as delivered (each one signed, sent, answered and recorded);
* job throughput: M no-op jobs submitted, then drained by a worker (concurrency 50) in this
  process, with a `jobtier persister` process running throughout, in three modes interleaved
  run by run (off, on, follow, off, on, follow, …) in the same run:
  - off: no dispatcher (the subscription is in place, nothing reads it);
  - on: a dispatcher delivering every job's terminal webhook (the tenant's subscription);
  - follow: a dispatcher, and no job has a target (submitted as a tenant with no
    subscription and no callback): the cost of following the logs alone. That tenant is not
    marked (webhooks/marks.py), so its entries are acknowledged undecoded, with no look-up
    in Postgres; the subscribed tenant is marked by the dispatcher's start-up, as the bench
    writes its subscription straight into Postgres.
  A dispatcher is started and has caught up (its group has read and acknowledged every log
  entry, no delivery is pending) before the clock starts, so no mode pays for the backlog an
  earlier run left: does following the logs, or delivering, slow the jobs down?

    .venv/bin/python bench/webhooks.py                  # defaults: 5,000 deliveries, 3 runs
    .venv/bin/python bench/webhooks.py --deliveries 2000 --jobs 10000 --runs 2

Results go to bench/results/webhooks.json and bench/results/webhooks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from jobtier.config import Settings, env_name
from jobtier.core.model import JobSpec
from jobtier.dev.local_postgres import LocalPostgres
from jobtier.dev.local_redis import LocalRedis, free_port
from jobtier.engine.produce import DEFAULT_TENANT
from jobtier.engine.queue import Queue
from jobtier.persist.db import create_pool, migrate, query
from jobtier.worker.registry import TaskRegistry, task
from jobtier.worker.runner import Worker

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, fmt, header_markdown, median, save, table


@task(retries=0)
async def noop(ctx: Any, payload: Any) -> None:
    return None


# --- the receiver ---------------------------------------------------------------------------
class _Responder(asyncio.Protocol):
    """Answers every request on a keep-alive connection with 200 and an empty body."""

    def __init__(self, counter: Any) -> None:
        self.counter = counter
        self.buffer = b""

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            head_end = self.buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buffer[:head_end].lower()
            length = 0
            at = head.find(b"content-length:")
            if at >= 0:
                length = int(
                    head[at + 15 : head.find(b"\r\n", at) if b"\r\n" in head[at:] else None]
                )
            end = head_end + 4 + length
            if len(self.buffer) < end:
                return
            self.buffer = self.buffer[end:]
            with self.counter.get_lock():
                self.counter.value += 1
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")


def _serve(port: int, counter: Any) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _Responder(counter), "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# --- helpers --------------------------------------------------------------------------------
def env_of(settings: Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBTIER_")}
    defaults = Settings()
    for f in dataclasses.fields(Settings):
        value = getattr(settings, f.name)
        if value != getattr(defaults, f.name):
            env[env_name(f)] = str(int(value) if isinstance(value, bool) else value)
    return env


def spawn(role: str, settings: Settings) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "jobtier.cli", role], env=env_of(settings),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip


def kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def wait_until(check: Any, timeout: float = 600.0, every: float = 0.05) -> None:
    async with asyncio.timeout(timeout):
        while not await check():
            await asyncio.sleep(every)


async def delivered(pool: Any) -> int:
    return int(
        await pool.fetchval("SELECT count(*) FROM webhook_deliveries WHERE state = 'delivered'")
    )


QUIET_TENANT = "bench-no-targets"  # no subscription, no callback: nothing to deliver


async def fill(queue: Queue, n: int, tenant: str = DEFAULT_TENANT) -> None:
    for start in range(0, n, 1000):
        specs = [JobSpec(type="noop") for _ in range(min(1000, n - start))]
        await queue.submit_many(specs, tenant=tenant)


async def caught_up(queue: Queue, pool: Any) -> bool:
    """The dispatchers' group has read and acknowledged every log entry, and no delivery is
    pending: a dispatcher started now has no backlog left from an earlier run."""
    name = queue.keys.dispatch_group().encode()
    for shard in range(queue.keys.shards):
        for group in await queue.redis.xinfo_groups(queue.keys.log(shard)):
            if group["name"] == name and (group["pending"] or group["lag"]):
                return False
    pending = await pool.fetchval("SELECT count(*) FROM webhook_deliveries WHERE state = 'pending'")
    return int(pending) == 0


async def drain(queue: Queue, registry: TaskRegistry) -> float:
    start = time.perf_counter()
    await Worker(queue.store, registry, concurrency=50, burst=True).run()
    return time.perf_counter() - start


# --- the benchmark --------------------------------------------------------------------------
async def run(args: argparse.Namespace) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="jobtier-bench-webhooks-"))
    redis_server = LocalRedis(folder / "redis").start()
    pg = LocalPostgres(folder / "pg", durable=True)
    counter = multiprocessing.Value("q", 0)
    port = free_port()
    receiver = multiprocessing.Process(target=_serve, args=(port, counter), daemon=True)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        pg.start()
        await migrate(pg.dsn)
        receiver.start()
        for _ in range(200):  # until it listens
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            await asyncio.sleep(0.02)
        settings = Settings.from_env(
            {}, redis_url=redis_server.url, database_url=pg.dsn,
            webhook_allowed_hosts="127.0.0.1", require_known_types=False,
        )  # fmt: skip
        registry = TaskRegistry([noop])
        pool = await create_pool(pg.dsn, min_size=0, max_size=2)
        queue = await Queue.connect(settings, registry)
        from jobtier.webhooks.callbacks import ensure_group
        from jobtier.webhooks.signing import new_secret

        tenant = DEFAULT_TENANT
        await pool.execute(query("secret_create_if_missing"), tenant, new_secret())
        await pool.execute(
            query("subscription_insert"), "wh_01M8BENCH0000000000000000", tenant,
            f"http://127.0.0.1:{port}/hook", "terminal", "bench",
        )  # fmt: skip
        await ensure_group(queue.redis, queue.keys, start="$")
        persister = spawn("persister", settings)
        procs.append(persister)

        # 1. deliveries per second: a dispatcher (started and idle), then N jobs run; the clock
        # runs from the first job's start to the last delivery recorded
        dispatcher = spawn("dispatcher", settings)
        procs.append(dispatcher)
        await asyncio.sleep(2.0)  # its start-up is not part of the figure
        await fill(queue, args.deliveries)
        before = counter.value
        start = time.perf_counter()
        await drain(queue, registry)

        deliveries: int = args.deliveries

        async def all_delivered() -> bool:
            return await delivered(pool) >= deliveries

        await wait_until(all_delivered)
        elapsed = time.perf_counter() - start
        received = counter.value - before
        kill(dispatcher)
        rate = args.deliveries / elapsed
        print(
            f"deliveries: {args.deliveries} in {elapsed:.2f} s = {rate:,.0f}/s (received {received})"
        )

        # 2. job throughput: dispatcher off / on (delivering) / on with nothing to deliver
        modes = ("off", "on", "follow")
        rates: dict[str, list[float]] = {mode: [] for mode in modes}
        for i in range(args.runs * len(modes)):
            mode = modes[i % len(modes)]
            if mode != "off":
                dispatcher = spawn("dispatcher", settings)
                procs.append(dispatcher)
                # the entries of earlier runs (the off run's above all) are delivered before
                # the clock starts: only this run's own work is measured

                async def idle() -> bool:
                    return await caught_up(queue, pool)

                await wait_until(idle, every=0.2)
                await asyncio.sleep(0.5)
            await fill(queue, args.jobs, QUIET_TENANT if mode == "follow" else DEFAULT_TENANT)
            seconds = await drain(queue, registry)
            rates[mode].append(args.jobs / seconds)
            print(f"run {i + 1}: dispatcher {mode}: {args.jobs / seconds:,.0f} jobs/s")
            if mode != "off":
                kill(dispatcher)
        # the follow runs' jobs had no target: not one delivery was made for them
        quiet = int(
            await pool.fetchval(
                "SELECT count(*) FROM webhook_deliveries WHERE tenant = $1", QUIET_TENANT
            )
        )
        if quiet:
            raise SystemExit(f"the follow runs made {quiet} deliveries: they had a target")
        await queue.close()
        await pool.close()
        return {
            "deliveries": args.deliveries,
            "deliveries_seconds": elapsed,
            "deliveries_per_second": rate,
            "received": received,
            "jobs_per_run": args.jobs,
            "jobs_per_second": rates,
            "follow_deliveries": quiet,
        }
    finally:
        for proc in procs:
            kill(proc)
        receiver.terminate()
        receiver.join(10)
        pg.stop()
        redis_server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deliveries", type=int, default=5000, help="webhooks to deliver (5000)")
    parser.add_argument("--jobs", type=int, default=20000, help="jobs per throughput run (20000)")
    parser.add_argument("--runs", type=int, default=3, help="throughput runs per mode (3)")
    args = parser.parse_args()
    env = environment()
    result = asyncio.run(run(args))
    rates = result["jobs_per_second"]
    off, on, follow = rates["off"], rates["on"], rates["follow"]
    rows = [
        ["webhook deliveries, loopback receiver (signed, sent, recorded)",
         f"{fmt(result['deliveries_per_second'])}/s",
         f"{result['deliveries']:,} in {result['deliveries_seconds']:.2f} s"],
        ["no-op jobs end to end, persister running, dispatcher off",
         f"{fmt(median(off))} jobs/s", " / ".join(fmt(x) for x in off)],
        ["the same, dispatcher on (delivering each job's webhook)",
         f"{fmt(median(on))} jobs/s", " / ".join(fmt(x) for x in on)],
        ["the same, dispatcher on, no job has a target (following the logs only)",
         f"{fmt(median(follow))} jobs/s", " / ".join(fmt(x) for x in follow)],
        ["on / off", f"{median(on) / median(off):.2f}", ""],
        ["follow / off", f"{median(follow) / median(off):.2f}", ""],
    ]  # fmt: skip
    md = header_markdown("Webhooks: deliveries per second, job throughput with the dispatcher", env)
    md += "\n" + table(["what", "median", "runs"], rows) + "\n"
    print("\n" + table(["what", "median", "runs"], rows))
    save("webhooks", {"environment": env, **result}, md)


if __name__ == "__main__":
    main()
