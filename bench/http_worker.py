"""Benchmark: jobs/s through one HTTP worker (the Node worker of examples/node-worker) at
concurrency 50, against one Python worker at concurrency 50, in the same run.

Starts its own Redis (AOF on) and one API process (``jobtier api``, granian, with
``JOBTIER_WORKER_KEYS``). Each phase fills a queue with ``--jobs`` jobs of a no-op task,
then starts one worker process — ``jobtier worker`` (Python) or ``node
bench/http_worker_node.mjs`` (HTTP: each job is its share of a long-poll claim and of a
batch of completions through the API) — and times the drain on the jobs' own status events (the
shards' event channels): from the first job's ``running`` to the last one's ``succeeded``,
so that process start-up is not counted. The worker is stopped after its phase. Phases
alternate (Python first in odd runs, HTTP first in even ones) for ``--runs`` runs; the
table gives each run's rates and ratio, and their medians.

    .venv/bin/python bench/http_worker.py             # 5 runs of 5,000 jobs per worker
    .venv/bin/python bench/http_worker.py --quick     # 2 runs of 2,000

Needs node (scripts/system-deps.sh installs it). Results: bench/results/http_worker.json and
bench/results/http_worker.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, environment, fmt, header_markdown, local_redis, median, save, table

from jobtier.config import Settings
from jobtier.core.model import JobSpec
from jobtier.dev.local_redis import free_port
from jobtier.engine.queue import Queue
from jobtier.store.subscriber import ShardSubscriber
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import TaskRegistry, task

BENCH = Path(__file__).resolve().parent
NODE_WORKER = BENCH / "http_worker_node.mjs"
WORKER_KEY = "bench-worker-key"
TYPE = "bench.noop"


@task(name=TYPE, retries=0)
async def noop(ctx: JobContext, payload: Any) -> None:
    return None


REGISTRY = TaskRegistry([noop])  # what `jobtier worker http_worker:REGISTRY` runs


class Drain:
    """Counts the phase's jobs through their status events: when the first started, when
    the last succeeded."""

    def __init__(self) -> None:
        self.expect = 0
        self.first_running = 0.0
        self.succeeded = 0
        self.done = asyncio.Event()
        self.last = 0.0

    def reset(self, expect: int) -> None:
        self.expect, self.first_running, self.succeeded, self.last = expect, 0.0, 0, 0.0
        self.done.clear()

    def on_event(self, channel: bytes, data: bytes) -> None:
        now = time.perf_counter()
        doc = data.partition(b"\n")[2]
        start = doc.find(b'"state":"') + 9
        state = doc[start : doc.find(b'"', start)]
        if state == b"running" and not self.first_running:
            self.first_running = now
        elif state == b"succeeded":
            self.succeeded += 1
            if self.succeeded == self.expect:
                self.last = now
                self.done.set()


@contextlib.asynccontextmanager
async def process(*argv: str, env: dict[str, str]) -> AsyncIterator[asyncio.subprocess.Process]:
    """A child process, stopped (SIGTERM, then SIGKILL) on every way out."""
    proc = await asyncio.create_subprocess_exec(
        *argv, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(15):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def fill(queue: Queue, name: str, jobs: int) -> None:
    batch = queue.settings.max_batch
    for start in range(0, jobs, batch):
        n = min(batch, jobs - start)
        await queue.submit_many(
            [JobSpec(type=TYPE, payload={"i": i}, queue=name) for i in range(n)]
        )


async def phase(
    kind: str, queue: Queue, drain: Drain, env: dict[str, str], args: argparse.Namespace
) -> float:
    """jobs/s of one worker process of ``kind`` draining a full queue of its own."""
    name = f"{kind}-{time.monotonic_ns()}"
    await fill(queue, name, args.jobs)
    drain.reset(args.jobs)
    if kind == "python":
        argv = [sys.executable, "-m", "jobtier.cli", "worker", "http_worker:REGISTRY",
                "--queues", name, "--concurrency", str(args.concurrency)]  # fmt: skip
    else:
        node = shutil.which("node") or shutil.which("nodejs") or "node"
        argv = [node, str(NODE_WORKER)]
        env = {**env, "BENCH_QUEUE": name, "WORKER_CONCURRENCY": str(args.concurrency)}
    async with process(*argv, env=env):
        async with asyncio.timeout(args.timeout):
            await drain.done.wait()
    jobs: int = args.jobs
    return jobs / (drain.last - drain.first_running)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    with local_redis(aof=True) as server:
        port = free_port()
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(BENCH)]),
            "JOBTIER_REDIS_URL": server.url,
            "JOBTIER_SHARDS": "16",
            "JOBTIER_API_KEYS": "bench-key:bench",
            "JOBTIER_ADMIN_KEY": "bench-admin",
            "JOBTIER_WORKER_KEYS": WORKER_KEY,
            "JOBTIER_REQUIRE_KNOWN_TYPES": "0",
            "JOBTIER_API_PORT": str(port),
            "JOBTIER_LOG_LEVEL": "WARNING",
            "JOBTIER_URL": f"http://127.0.0.1:{port}",
            "WORKER_KEY": WORKER_KEY,
        }
        settings = Settings.from_env({}, redis_url=server.url, shards=16, require_known_types=False)
        drain = Drain()
        api_argv = [sys.executable, "-m", "jobtier.cli", "api", "--port", str(port)]
        async with (
            process(*api_argv, env=env),
            await Queue.connect(settings, catalog=False) as queue,
        ):
            await _ready(env["JOBTIER_URL"])
            events = ShardSubscriber(
                queue.redis, [queue.keys.events(s) for s in range(16)], drain.on_event, name="bench"
            )
            await events.start()
            runs: list[dict[str, float]] = []
            try:
                for run in range(args.runs):
                    order = ("python", "http") if run % 2 == 0 else ("http", "python")
                    rates = {kind: await phase(kind, queue, drain, env, args) for kind in order}
                    rates["ratio"] = rates["http"] / rates["python"]
                    runs.append(rates)
                    print(
                        f"run {run + 1}: python {rates['python']:,.0f} jobs/s, "
                        f"http {rates['http']:,.0f} jobs/s, ratio {rates['ratio']:.2f}",
                        flush=True,
                    )
            finally:
                await events.stop()
    return {"runs": runs}


async def _ready(url: str) -> None:
    async with httpx.AsyncClient(base_url=url) as client, asyncio.timeout(30):
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get("/healthz")).status_code == 200:
                    return
            await asyncio.sleep(0.1)


def render(raw: dict[str, Any], args: argparse.Namespace, env: dict[str, Any]) -> str:
    runs = raw["runs"]
    out = [header_markdown("One HTTP worker (Node) against one Python worker", env)]
    out.append(
        f"One worker process at a time, concurrency {args.concurrency}, draining a queue of "
        f"{args.jobs:,} jobs of a no-op task; one API process (granian) between the HTTP "
        "worker (examples/node-worker, Node's fetch) and Redis; 16 shards, Redis with AOF on. "
        "Rate: jobs over the time from the first `running` event to the last `succeeded`. "
        "The machine is shared with other work and was loaded during the run (load average "
        "above): read the ratios and medians, not one figure.\n"
    )
    rows = [
        [str(i + 1), fmt(r["python"]), fmt(r["http"]), fmt(r["ratio"], 2)]
        for i, r in enumerate(runs)
    ]
    med = {k: median([r[k] for r in runs]) for k in ("python", "http", "ratio")}
    rows.append(["median", fmt(med["python"]), fmt(med["http"]), fmt(med["ratio"], 2)])
    out.append(
        table(["run", "Python worker (jobs/s)", "HTTP worker (jobs/s)", "HTTP / Python"], rows)
        + "\n"
    )
    out.append(
        f"Median: the HTTP worker runs at {med['ratio']:.2f} times the Python worker's rate. "
        "Each of its jobs is its share of a long-poll claim and of a batch of completions "
        "(`POST /v1/worker/complete`: the results that ended while the previous batch was in "
        "flight), both through the API, a Python process that decodes, checks and answers "
        "them; the Python worker pipelines its claims and outcomes straight to Redis. Scale "
        "API processes with HTTP workers.\n"
    )
    return "\n".join(out)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=5000, help="jobs per phase (5000)")
    p.add_argument("--runs", type=int, default=5, help="runs, each a phase per worker (5)")
    p.add_argument("--concurrency", type=int, default=50, help="each worker's concurrency (50)")
    p.add_argument("--timeout", type=float, default=300.0, help="longest phase, s (300)")
    p.add_argument("--quick", action="store_true", help="2 runs of 2,000 jobs")
    p.add_argument("--no-save", action="store_true", help="print only; keep results files")
    args = p.parse_args(argv)
    if args.quick:
        args.jobs, args.runs = min(args.jobs, 2000), min(args.runs, 2)
    return args


def run(argv: list[str] | None = None) -> None:
    import uvloop

    args = parse(argv)
    env = environment()
    raw = uvloop.run(main(args))
    text = render(raw, args, env)
    print(text)
    if not args.no_save:
        paths = save("http_worker", {**env, "arguments": vars(args), **raw}, text)
        print(f"\nsaved {paths[0]} and {paths[1]}")


if __name__ == "__main__":
    run()
