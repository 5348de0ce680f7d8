"""Benchmark: jobs/s through jobtier end to end, against a one-job-per-round-trip baseline.

Starts its own Redis (AOF on, ``noeviction``: as production requires) in a temporary folder
and, for each run, measures with 20K no-op jobs:

* enqueue: ``Queue.submit_many`` in batches (500 per call), no worker running; side figure:
  one ``Queue.submit`` per job with 50 calls in flight;
* end to end: K worker processes (``Worker``, concurrency 50, started and idle beforehand),
  then the producer submits in batches; the time from the first submit to the last job's
  ``succeeded`` transition (its log entry id: Redis's clock, the same host clock);
* drain: the same with the queues filled first, then the workers told to go;
* the baseline, in the same run: the same processes and tasks, but every claim asks for one
  job and every completion is sent alone (``BaselineWorker`` below: 50 claim-run-complete
  loops, the shape of a classic per-job Redis queue);
* per job: claim round trips (``Worker.stats``), script calls and Redis commands
  (``INFO commandstats``, commands run inside scripts included), CPU of the worker
  processes and of Redis;
* side figure: end to end with AOF off.

Workers run as separate processes (uvloop, like ``jobtier worker``), so the producer and the
worker do not share an event loop. Other job systems are measured beside jobtier, in the same
runs, by ``compare.py``; compare ratios within one run rather than absolute numbers across
days.

    .venv/bin/python bench/throughput.py                    # 20K jobs, 3 runs, 1 worker
    .venv/bin/python bench/throughput.py --quick            # 5K jobs, 1 run: a smoke test
    .venv/bin/python bench/throughput.py --workers 2 --phases e2e,drain

Results: bench/results/throughput.json and bench/results/throughput.md (medians of runs).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from jobtier.store.calls import complete_call

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RedisMeter,
    environment,
    fmt,
    fresh,
    header_markdown,
    local_redis,
    median,
    save,
    table,
)

from jobtier.config import Settings
from jobtier.core.errors import Code
from jobtier.core.model import JobSpec, QueueLimits, encode_json
from jobtier.dev.local_redis import LocalRedis
from jobtier.engine.queue import Queue
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import TaskRegistry, task
from jobtier.worker.runner import Worker, WorkerStats

PHASES = ("enqueue", "single", "e2e", "drain", "baseline", "baseline-drain", "aof-off")
POLLING = frozenset({"hgetall", "xinfo|stream"})  # wait_finished's, left out of the counts
_decode = msgspec.json.Decoder().decode


@task(retries=0)
async def noop(ctx: JobContext, payload: Any) -> None:
    return None


# --- worker processes ---------------------------------------------------------------------------
class BaselineWorker:
    """The baseline: one job per claim round trip, one completion per call.

    ``concurrency`` loops each claim one job (the same claim script, count 1), run it
    through the same context and task as ``Worker``, and complete it alone (the same
    complete script, a batch of one). A loop that finds every shard empty sleeps 1 ms
    before sweeping again: polling, as per-job queues without a wake channel do.
    """

    def __init__(self, queue: Queue, registry: TaskRegistry, concurrency: int, name: str) -> None:
        self.queue = queue
        self.scripts = queue.scripts
        self.registry = registry
        self.concurrency = concurrency
        self.id = name
        self.stats = WorkerStats()
        self._stopping = asyncio.Event()
        self.lease_ms = int(queue.settings.lease_seconds * 1000)

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> WorkerStats:
        await asyncio.gather(*(self._loop(i) for i in range(self.concurrency)))
        return self.stats

    async def _loop(self, i: int) -> None:
        shards = self.queue.keys.shards
        shard, empty = i % shards, 0
        loop = asyncio.get_running_loop()
        retention = self.queue.settings.retention_seconds
        st = self.stats
        while not self._stopping.is_set():
            batch = await self.scripts.claim(shard, self.id, 1, self.lease_ms)
            st.claim_round_trips += 1
            if not batch.jobs:
                shard, empty = (shard + 1) % shards, empty + 1
                if empty >= shards:
                    empty = 0
                    await asyncio.sleep(0.001)
                continue
            empty = 0
            job = batch.jobs[0]
            st.claimed += 1
            t = self.registry.get(job.type)
            assert t is not None
            ctx = JobContext(job, shard, self.id, loop, lambda data: None)
            result = await t.fn(ctx, _decode(job.payload))
            data = b"" if result is None else encode_json(result)
            call = complete_call(shard, self.id, retention, [(job.id, job.lease_version, data)])
            (code,) = await self.scripts.call(*call)
            if Code(code) is Code.OK:
                st.succeeded += 1
            else:
                st.refused += 1


def child_main(args: argparse.Namespace) -> None:
    """A worker process: 'ready' on stdout, runs on 'go', stops on 'stop', prints its stats."""
    import uvloop

    from jobtier import logs

    logs.setup("WARNING")
    uvloop.run(_child(args))


async def _child(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    settings = Settings.from_env(
        {}, redis_url=args.url, shards=args.shards, redis_require_aof=False
    )
    registry = TaskRegistry([noop])
    queue = await Queue.connect(settings, registry, check=False)
    worker: Worker | BaselineWorker
    if args.child == "baseline":
        worker = BaselineWorker(queue, registry, args.concurrency, args.name)
    else:
        worker = Worker(
            queue.store,
            registry,
            concurrency=args.concurrency,
            name=args.name,
            queues=args.queue_names,
        )
    print("ready", flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)  # go
    cpu0 = os.times()
    running = asyncio.create_task(worker.run())
    await loop.run_in_executor(None, sys.stdin.readline)  # stop
    cpu1 = os.times()
    worker.stop()
    stats = await running
    await queue.close()
    cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    print(
        json.dumps(
            {
                "claimed": stats.claimed,
                "claim_round_trips": stats.claim_round_trips,
                "succeeded": stats.succeeded,
                "refused": stats.refused,
                "cpu": cpu,
                "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            }
        ),
        flush=True,
    )


class Workers:
    """K worker processes of one kind, driven over their stdin/stdout."""

    def __init__(self, kind: str, url: str, args: argparse.Namespace) -> None:
        self.procs = []
        for i in range(args.workers):
            cmd = [
                sys.executable, __file__, "--child", kind, "--url", url,
                "--shards", str(args.shards), "--concurrency", str(args.concurrency),
                "--name", f"bench-{kind}-{i}", "--queues", str(args.queues),
            ]  # fmt: skip
            self.procs.append(
                subprocess.Popen(
                    cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
                )
            )
        for p in self.procs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"worker process {p.pid} did not start")

    def send(self, word: str) -> None:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(word + "\n")
            p.stdin.flush()

    def stop(self) -> list[dict[str, Any]]:
        self.send("stop")
        out = []
        for p in self.procs:
            assert p.stdout is not None
            out.append(json.loads(p.stdout.readline()))
            p.wait(30)
        return out

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


# --- producer side ------------------------------------------------------------------------------
def queue_names(n: int) -> list[str]:
    return ["default"] if n <= 1 else [f"q{i}" for i in range(n)]


def specs(n: int, queues: Sequence[str] = ("default",)) -> list[JobSpec]:
    """n no-op jobs, spread round-robin over ``queues``."""
    return [JobSpec(type="noop", payload={"n": i}, queue=queues[i % len(queues)]) for i in range(n)]


async def set_limits(queue: Queue, args: argparse.Namespace) -> None:
    if args.queue_concurrency is None and args.queue_rate is None:
        return
    limits = QueueLimits(concurrency=args.queue_concurrency, rate=args.queue_rate, per=1.0)
    for name in args.queue_names:
        await queue.admin.set_limits(name, limits)


async def submit_batches(queue: Queue, jobs: Sequence[JobSpec], batch: int) -> None:
    for i in range(0, len(jobs), batch):
        await queue.submit_many(jobs[i : i + batch])


async def submit_single(queue: Queue, jobs: Sequence[JobSpec], in_flight: int) -> None:
    it = iter(jobs)

    async def one_at_a_time() -> None:
        for spec in it:
            await queue.submit(spec.type, spec.payload)

    await asyncio.gather(*(one_at_a_time() for _ in range(in_flight)))


async def wait_finished(queue: Queue, timeout: float) -> float:
    """Wait until no job is ready or running on any shard: once every job is submitted, each
    has ended (the bench's jobs cannot fail); return the time (s, Redis's clock) of the newest
    transition, the newest id of the shard logs. Polled every 10 ms, the shards' queue counts
    (one small hash each); the time comes from the log ids, so the poll interval does not
    enter the figure. (Not the logs' lengths: an entry holds the transitions of one script
    call, and a persister deletes what it has written.)"""
    keys = queue.keys
    async with asyncio.timeout(timeout):
        while True:
            pipe = queue.redis.pipeline(transaction=False)
            for s in range(keys.shards):
                pipe.hgetall(keys.queue_counts(s))
            if not any(
                int(v)
                for counts in await pipe.execute()
                for f, v in counts.items()
                if f.rsplit(b":", 1)[-1] in _COUNTED
            ):
                break
            await asyncio.sleep(0.01)
    pipe = queue.redis.pipeline(transaction=False)
    for s in range(keys.shards):
        pipe.execute_command("XINFO", "STREAM", keys.log(s))
    infos = [_pairs(i) for i in await pipe.execute()]
    return max(int(i[b"last-generated-id"].split(b"-")[0]) for i in infos) / 1000


# the queue counts' fields of jobs not ended: ready (per priority) and running
_COUNTED = frozenset({b"critical", b"high", b"normal", b"low", b"running"})


def _pairs(reply: Any) -> dict[bytes, Any]:
    if isinstance(reply, dict):
        return {k if isinstance(k, bytes) else str(k).encode(): v for k, v in reply.items()}
    return {reply[i]: reply[i + 1] for i in range(0, len(reply), 2)}


async def measure_enqueue(queue: Queue, args: argparse.Namespace, single: bool) -> float:
    jobs = specs(args.jobs)
    await fresh(queue.redis)
    t0 = time.perf_counter()
    if single:
        await submit_single(queue, jobs, args.in_flight)
    else:
        await submit_batches(queue, jobs, args.batch)
    count: int = args.jobs
    return count / (time.perf_counter() - t0)


async def measure_run(
    queue: Queue,
    server: LocalRedis,
    args: argparse.Namespace,
    kind: str,
    prefill: bool,
    hook: Any = None,
) -> dict[str, Any]:
    """One end-to-end (or drain, with ``prefill``) measurement with fresh worker processes.

    ``hook`` (compare.py's persister): ``await hook.start()`` once Redis is emptied and the
    workers are up, ``await hook.stop()`` once the last job is logged; what it returns is
    added to the result."""
    assert server.proc is not None
    n = args.jobs
    jobs = specs(n, args.queue_names)
    await fresh(queue.redis)
    await set_limits(queue, args)
    workers = Workers(kind, server.url, args)
    try:
        if prefill:
            await submit_batches(queue, jobs, args.batch)
        else:
            workers.send("go")
            await asyncio.sleep(0.3)  # let them subscribe and go idle: a realistic start
        if hook is not None:
            await hook.start()
        meter = RedisMeter(queue.redis, server.proc.pid, ignore=POLLING)
        await meter.start()
        t0, producer0 = time.time(), time.process_time()
        if prefill:
            workers.send("go")
        else:
            await submit_batches(queue, jobs, args.batch)
        submitted, producer1 = time.time(), time.process_time()
        end = await wait_finished(queue, args.timeout)
        redis_side = await meter.stop(n)
        extra = {} if hook is None else await hook.stop(end)
        stats = workers.stop()
    finally:
        workers.kill()
    succeeded = sum(s["succeeded"] for s in stats)
    if succeeded != n:
        raise RuntimeError(f"{kind}: {succeeded} of {n} jobs succeeded")
    claimed = sum(s["claimed"] for s in stats)
    trips = sum(s["claim_round_trips"] for s in stats)
    work = redis_side["commands"]
    return {
        "jobs_per_s": n / (end - t0),
        "seconds": end - t0,
        "submit_jobs_per_s": None if prefill else n / (submitted - t0),
        "claim_round_trips_per_job": trips / claimed,
        # transitions by FCALL (the function library), status reads by EVALSHA
        "script_calls_per_job": (work.get("fcall", 0) + work.get("evalsha", 0)) / n,
        "redis_commands_per_job": redis_side["redis_commands_per_job"],
        "worker_cpu_us_per_job": 1e6 * sum(s["cpu"] for s in stats) / n,
        "worker_max_rss_mb": max(s["max_rss_mb"] for s in stats),
        "redis_cpu_us_per_job": redis_side["redis_cpu_us_per_job"],
        "producer_cpu_us_per_job": None if prefill else 1e6 * (producer1 - producer0) / n,
        "aof_bytes_per_job": redis_side["aof_bytes_per_job"],
        "aof_rewrites": redis_side["aof_rewrites"],
        "commands": work,
        **extra,
    }


async def one_run(
    server: LocalRedis, args: argparse.Namespace, phases: set[str], aof: bool
) -> dict[str, Any]:
    settings = Settings.from_env(
        {}, redis_url=server.url, shards=args.shards, redis_require_aof=aof
    )
    out: dict[str, Any] = {}
    async with await Queue.connect(settings, catalog=False) as queue:
        if not aof:
            out["e2e_aof_off"] = await measure_run(queue, server, args, "jobtier", prefill=False)
            return out
        if "enqueue" in phases:
            out["enqueue_batch"] = await measure_enqueue(queue, args, single=False)
        if "single" in phases:
            out["enqueue_single"] = await measure_enqueue(queue, args, single=True)
        if "e2e" in phases:
            out["e2e"] = await measure_run(queue, server, args, "jobtier", prefill=False)
        if "drain" in phases:
            out["drain"] = await measure_run(queue, server, args, "jobtier", prefill=True)
        if "baseline" in phases:
            out["baseline"] = await measure_run(queue, server, args, "baseline", prefill=False)
        if "baseline-drain" in phases:
            out["baseline_drain"] = await measure_run(queue, server, args, "baseline", prefill=True)
    return out


# --- summary ------------------------------------------------------------------------------------
def med(runs: list[dict[str, Any]], phase: str, field: str | None = None) -> float:
    values = [r[phase] if field is None else r[phase][field] for r in runs if phase in r]
    values = [v for v in values if v is not None]
    return median(values)


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    fields = (
        "jobs_per_s", "submit_jobs_per_s", "claim_round_trips_per_job", "script_calls_per_job",
        "redis_commands_per_job", "worker_cpu_us_per_job", "redis_cpu_us_per_job",
        "producer_cpu_us_per_job", "worker_max_rss_mb", "aof_bytes_per_job", "aof_rewrites",
    )  # fmt: skip
    summary: dict[str, Any] = {}
    for phase in ("enqueue_batch", "enqueue_single"):
        if any(phase in r for r in runs):
            summary[phase] = med(runs, phase)
    for phase in ("e2e", "drain", "baseline", "baseline_drain", "e2e_aof_off"):
        if any(phase in r for r in runs):
            summary[phase] = {f: med(runs, phase, f) for f in fields}
            last = next(r[phase] for r in reversed(runs) if phase in r)
            summary[phase]["commands_last_run"] = last["commands"]
    return summary


def render(summary: dict[str, Any], args: argparse.Namespace, env: dict[str, Any]) -> str:
    runs = args.runs
    out = [header_markdown("Throughput: no-op jobs through jobtier", env)]
    out.append(
        f"{args.jobs:,} no-op jobs, {args.shards} shards, {args.workers} worker process(es) "
        f"at concurrency {args.concurrency}, submit batches of {args.batch}; Redis with AOF "
        f"on (everysec) unless said. Medians of {runs} run(s).\n"
    )
    if "enqueue_batch" in summary or "enqueue_single" in summary:
        out.append("## Enqueue (no worker running)\n")
        rows = []
        if "enqueue_batch" in summary:
            rows.append([f"`submit_many`, {args.batch} per call", fmt(summary["enqueue_batch"])])
        if "enqueue_single" in summary:
            rows.append(
                [f"`submit`, one job per call, {args.in_flight} in flight",
                 fmt(summary["enqueue_single"])]
            )  # fmt: skip
        out.append(table(["method", "jobs/s"], rows) + "\n")

    labels = {
        "e2e": "jobtier, end to end (workers idle, then submit)",
        "drain": "jobtier, drain (queues filled first)",
        "baseline": "baseline: 1 job per claim, 1 per completion, end to end",
        "baseline_drain": "baseline, drain",
        "e2e_aof_off": "jobtier, end to end, AOF off (side figure)",
    }
    rows = []
    for phase, label in labels.items():
        if phase not in summary:
            continue
        s = summary[phase]
        rows.append(
            [
                label,
                fmt(s["jobs_per_s"]),
                fmt(s["claim_round_trips_per_job"], 3),
                fmt(s["script_calls_per_job"], 3),
                fmt(s["redis_commands_per_job"], 1),
                fmt(s["worker_cpu_us_per_job"]),
                fmt(s["redis_cpu_us_per_job"]),
                fmt(s["producer_cpu_us_per_job"]),
                fmt(s["aof_bytes_per_job"]),
            ]
        )
    if rows:
        out.append("## End to end\n")
        out.append(
            table(
                [
                    "",
                    "jobs/s",
                    "claim round trips/job",
                    "script calls/job",
                    "Redis commands/job",
                    "worker CPU µs/job",
                    "Redis CPU µs/job",
                    "producer CPU µs/job",
                    "AOF bytes/job",
                ],
                rows,
            )
            + "\n"
        )
        ratios = []
        for what, a, b in (("end to end", "e2e", "baseline"), ("drain", "drain", "baseline_drain")):
            if a in summary and b in summary:
                ratios.append(
                    f"- {what}: jobtier / baseline = "
                    f"{summary[a]['jobs_per_s'] / summary[b]['jobs_per_s']:.1f}x"
                )
        out.extend(ratios)
        out.append(
            "\nScript calls and Redis commands per job count everything the pipeline sent "
            "(end to end: the submits too), commands run inside scripts included; the bench's "
            "own polling (its queue counts, XINFO STREAM) is left out.\n"
        )

    out.append(
        "Other job systems, measured beside jobtier in the same runs: `bench/compare.py` "
        "(bench/results/compare.md).\n"
    )
    return "\n".join(out)


# --- main ---------------------------------------------------------------------------------------
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=20_000, help="jobs per measurement (20000)")
    p.add_argument("--runs", type=int, default=3, help="runs; figures are medians (3)")
    p.add_argument("--concurrency", type=int, default=50, help="per worker process (50)")
    p.add_argument("--workers", type=int, default=1, help="worker processes (1)")
    p.add_argument("--shards", type=int, default=16, help="logical shards (16)")
    p.add_argument("--batch", type=int, default=500, help="jobs per submit_many call (500)")
    p.add_argument("--in-flight", type=int, default=50, help="concurrent single submits (50)")
    p.add_argument(
        "--queues", type=int, default=1, help="queues the jobs are spread over, all served (1)"
    )
    p.add_argument(
        "--queue-concurrency", type=int, help="a global concurrency limit on every queue"
    )
    p.add_argument("--queue-rate", type=int, help="a rate limit on every queue, starts per second")
    p.add_argument(
        "--phases",
        default=",".join(PHASES),
        help=f"comma-separated subset of {','.join(PHASES)} (default: all)",
    )
    p.add_argument("--timeout", type=float, default=120.0, help="bound on one phase, s (120)")
    p.add_argument("--quick", action="store_true", help="5,000 jobs, 1 run: a smoke test")
    p.add_argument("--no-save", action="store_true", help="print only; keep results files")
    # worker-process mode (internal)
    p.add_argument("--child", choices=("jobtier", "baseline"), help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--name", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.queue_names = queue_names(args.queues)
    if args.quick:
        args.jobs, args.runs = min(args.jobs, 5_000), 1
    return args


async def main(args: argparse.Namespace) -> dict[str, Any]:
    phases = set(args.phases.split(","))
    unknown = phases - set(PHASES)
    if unknown:
        raise SystemExit(f"unknown phases: {', '.join(sorted(unknown))}")
    runs: list[dict[str, Any]] = []
    for i in range(args.runs):
        with local_redis(aof=True) as server:
            result = await one_run(server, args, phases, aof=True)
        if "aof-off" in phases:
            with local_redis(aof=False) as server:
                result.update(await one_run(server, args, phases, aof=False))
        runs.append(result)
        brief = {
            k: round(v if isinstance(v, float) else v["jobs_per_s"]) for k, v in result.items()
        }
        print(f"run {i + 1}/{args.runs}: jobs/s {brief}", file=sys.stderr, flush=True)
    return {"runs": runs, "summary": summarise(runs)}


def run(argv: list[str] | None = None, report: Callable[[str], None] = print) -> None:
    args = parse(argv)
    if args.child:
        child_main(args)
        return
    env = environment()
    with contextlib.suppress(KeyboardInterrupt):
        import uvloop

        results = uvloop.run(main(args))
        text = render(results["summary"], args, env)
        report(text)
        if not args.no_save:
            data = {**env, "arguments": vars(args), **results}
            paths = save("throughput", data, text)
            report(f"\nsaved {paths[0]} and {paths[1]}")


if __name__ == "__main__":
    run()
