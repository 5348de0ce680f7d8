"""Benchmark: a CPU-bound plain ``def`` task in the worker's threads against its process pool,
and what the worker's other (async) jobs see meanwhile.

Starts its own Redis (AOF on). One process, one event loop: a worker (concurrency 10), the
producer and an observer of the shards' event channels. The CPU-bound task hashes 64-byte
blocks in a Python loop for about ``--work-ms`` (calibrated at start on this machine), so it
holds the GIL as CPU-bound Python does (a large buffer would let ``hashlib`` release it). Per
mode, ``--jobs`` such jobs are kept ``IN_FLIGHT`` at a time (two run, two wait: the executor
never idles), while probe jobs (an ``async def`` that notes when it starts) are submitted
every ``PROBE_EVERY`` s and a ticker on the worker's loop wakes every ``TICK`` s:

* jobs/s: CPU jobs done per second of the phase (first submit to last ``succeeded``);
* probe claim latency: submit → the probe task starts, on the worker (a claim, a start);
* loop lag: how late the ticker wakes. Heartbeats, claims and reports run on this loop:
  its lag is how late each of them is;
* heartbeat: how long each full heartbeat (every running job's lease extended in Redis)
  takes from its start, with a lease of ``LEASE`` s (a beat every third of it).

Modes, in the same run, alternating, ``--runs`` times: ``idle`` (probes only: the floor),
``threads`` (``--executor thread``, 2 threads) and ``processes`` (``--executor process``,
2 children, started before the phase). The figures are the medians over the runs.

    .venv/bin/python bench/process_pool.py            # 3 runs, 80 jobs of 50 ms per mode
    .venv/bin/python bench/process_pool.py --quick

Results: bench/results/process_pool.json and bench/results/process_pool.md.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Literal

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, fmt, header_markdown, local_redis, percentile, save, table

from jobtier.config import Settings
from jobtier.engine.queue import Queue
from jobtier.store.subscriber import ShardSubscriber
from jobtier.worker.job_context import JobContext
from jobtier.worker.procpool import ProcessOptions
from jobtier.worker.registry import TaskRegistry, task
from jobtier.worker.runner import Worker

IN_FLIGHT = 4  # CPU jobs submitted and not done: two running, two waiting for the executor
CONCURRENCY = 10  # the worker's slots: the probes always find one free
PROBE_EVERY = 0.05  # s between probe submits
TICK = 0.01  # s between the ticker's wakes
LEASE = 1.5  # s: a heartbeat every 0.5 s, so that each phase has a few to time
POOL = 2  # threads, or child processes: one per core of the machine this was written for
STARTED: dict[str, float] = {}  # probe job id -> perf_counter when its task started


def hash_rounds(rounds: int) -> int:
    """CPU-bound Python: small hashes (hashlib keeps the GIL under 2 KiB) in a loop."""
    data = b"x" * 64
    for _ in range(rounds):
        data = hashlib.sha256(data).digest() * 2
    return data[0]


@task(retries=0)
def crunch(ctx: JobContext, payload: Any) -> int:
    return hash_rounds(int(payload["rounds"]))


@task(retries=0)
async def probe(ctx: JobContext, payload: Any) -> None:
    STARTED[ctx.job_id] = time.perf_counter()


REGISTRY = TaskRegistry([crunch, probe])


def autogroup() -> bool:
    """Whether the kernel schedules by session (``sched_autogroup``): then every process of
    this run shares one CPU share against the other sessions' load, and a second process
    adds CPU only where a core is idle."""
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            return f.read().strip() == "1"
    except OSError:
        return False


def calibrate(work_ms: float) -> int:
    """Rounds of ``hash_rounds`` that take ``work_ms`` on one core here (the least of a few
    tries: other work on the machine only adds to a try)."""
    rounds = 2000
    took = min(_timed(rounds) for _ in range(5))
    return max(1, round(rounds * work_ms / 1000 / took))


def _timed(rounds: int) -> float:
    start = time.perf_counter()
    hash_rounds(rounds)
    return time.perf_counter() - start


class Observer:
    """Wakes whoever waits for a job's ``succeeded`` event."""

    def __init__(self) -> None:
        self.done: dict[str, float] = {}
        self.waiters: dict[str, asyncio.Future[float]] = {}

    def on_event(self, channel: bytes, data: bytes) -> None:
        head, _, doc = data.partition(b"\n")
        if b'"state":"succeeded"' not in doc:
            return
        job_id = head.split(b" ", 1)[0].decode()
        now = time.perf_counter()
        self.done[job_id] = now
        waiter = self.waiters.pop(job_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(now)

    async def wait(self, job_id: str) -> float:
        if job_id not in self.done:
            self.waiters[job_id] = asyncio.get_running_loop().create_future()
            async with asyncio.timeout(120):
                await self.waiters[job_id]
        return self.done.pop(job_id)


async def ticker(lags: list[float], stop: asyncio.Event) -> None:
    # perf_counter, not loop.time(): uvloop's clock counts whole milliseconds
    while not stop.is_set():
        due = time.perf_counter() + TICK
        await asyncio.sleep(TICK)
        lags.append(1000 * max(time.perf_counter() - due, 0.0))


async def prober(queue: Queue, asked: dict[str, float], stop: asyncio.Event) -> None:
    """Submits a probe every ``PROBE_EVERY`` s; ``asked`` keeps when, by job id."""
    while not stop.is_set():
        at = time.perf_counter()
        sub = await queue.submit("probe", None)
        asked[sub.job_id] = at
        await asyncio.sleep(PROBE_EVERY)


async def cpu_jobs(queue: Queue, observer: Observer, jobs: int, rounds: int) -> float:
    """``jobs`` CPU jobs, ``IN_FLIGHT`` at a time; returns the seconds they took."""
    start = time.perf_counter()
    left = jobs
    flight: set[asyncio.Task[float]] = set()

    async def one() -> float:
        sub = await queue.submit("crunch", {"rounds": rounds})
        return await observer.wait(sub.job_id)

    while left or flight:
        while left and len(flight) < IN_FLIGHT:
            flight.add(asyncio.create_task(one()))
            left -= 1
        done, flight = await asyncio.wait(flight, return_when=asyncio.FIRST_COMPLETED)
        for d in done:
            d.result()
    return time.perf_counter() - start


async def phase(
    settings: Settings, observer: Observer, mode: str, jobs: int, rounds: int, idle_s: float
) -> dict[str, Any]:
    async with await Queue.connect(settings, REGISTRY) as queue:
        executor: Literal["thread", "process"] = "process" if mode == "processes" else "thread"
        options = ProcessOptions(size=POOL)
        worker = Worker(
            queue.store,
            REGISTRY,
            concurrency=CONCURRENCY,
            threads=POOL,
            executor=executor,
            processes=options,
        )
        beats: list[float] = []
        beat = worker.heartbeat._beat

        async def timed_beat(progress_only: bool) -> None:
            start, busy = time.perf_counter(), bool(worker.state.running)
            await beat(progress_only)
            if busy and not progress_only:  # a full beat: every running job's lease extended
                beats.append(1000 * (time.perf_counter() - start))

        worker.heartbeat._beat = timed_beat  # type: ignore[method-assign]
        running = asyncio.create_task(worker.run())
        try:
            warm = [await queue.submit("crunch", {"rounds": rounds}) for _ in range(POOL * 2)]
            for sub in warm:  # the children have started and imported the task
                await observer.wait(sub.job_id)
            beats.clear()  # the warm-up's
            lags: list[float] = []
            asked: dict[str, float] = {}
            stop = asyncio.Event()
            side = [
                asyncio.create_task(ticker(lags, stop)),
                asyncio.create_task(prober(queue, asked, stop)),
            ]
            if mode == "idle":
                await asyncio.sleep(idle_s)
                took = float("nan")
            else:
                took = await cpu_jobs(queue, observer, jobs, rounds)
            stop.set()
            await asyncio.gather(*side)

            async def probes_started() -> None:
                while not all(job_id in STARTED for job_id in asked):
                    await asyncio.sleep(0.01)

            async with asyncio.timeout(30):
                await probes_started()
            probe_ms = [1000 * (STARTED.pop(job_id) - at) for job_id, at in asked.items()]
        finally:
            worker.stop()
            await running
    return {
        "jobs": 0 if mode == "idle" else jobs,
        "seconds": took,
        "jobs_per_s": jobs / took if mode != "idle" else float("nan"),
        "probe_ms": probe_ms,
        "lag_ms": lags,
        "beat_ms": beats,
    }


async def main(args: argparse.Namespace, rounds: int) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    with local_redis(aof=True) as server:
        settings = Settings.from_env(
            {}, redis_url=server.url, shards=args.shards, lease_seconds=LEASE
        )
        observer = Observer()
        async with await Queue.connect(settings, catalog=False) as queue:
            events = ShardSubscriber(
                queue.redis,
                [queue.keys.events(s) for s in range(args.shards)],
                observer.on_event,
                name="bench-process-pool",
            )
            await events.start()
            try:
                for i in range(args.runs):
                    modes = ["idle", "threads", "processes"]
                    if i % 2:
                        modes = [modes[0], *reversed(modes[1:])]
                    run: dict[str, Any] = {}
                    for mode in modes:
                        run[mode] = await phase(
                            settings, observer, mode, args.jobs, rounds, args.idle
                        )
                        print(f"run {i + 1}/{args.runs} {mode} done", file=sys.stderr)
                    runs.append(run)
            finally:
                await events.stop()
    return runs


MODES = ("idle", "threads", "processes")


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in MODES:
        per_run = [r[mode] for r in runs]

        def med(values: list[float]) -> float:
            return statistics.median(values) if values else float("nan")

        out[mode] = {
            "jobs_per_s": med([r["jobs_per_s"] for r in per_run]),
            "jobs_per_s_runs": [r["jobs_per_s"] for r in per_run],
            "probe_p50_ms": med([percentile(r["probe_ms"], 50) for r in per_run]),
            "probe_p99_ms": med([percentile(r["probe_ms"], 99) for r in per_run]),
            "probes": sum(len(r["probe_ms"]) for r in per_run),
            "lag_p50_ms": med([percentile(r["lag_ms"], 50) for r in per_run]),
            "lag_p99_ms": med([percentile(r["lag_ms"], 99) for r in per_run]),
            "lag_max_ms": med([max(r["lag_ms"]) for r in per_run]),
            "beat_p50_ms": med([percentile(r["beat_ms"], 50) for r in per_run]),
            "beat_max_ms": med([max(r["beat_ms"], default=float("nan")) for r in per_run]),
            "beats": sum(len(r["beat_ms"]) for r in per_run),
        }
    out["ratio_runs"] = [r["processes"]["jobs_per_s"] / r["threads"]["jobs_per_s"] for r in runs]
    return out


def render(s: dict[str, Any], args: argparse.Namespace, env: dict[str, Any], rounds: int) -> str:
    out = [header_markdown("Process pool: CPU-bound tasks in threads against processes", env)]
    out.append(
        f"A plain `def` task hashing 64-byte blocks in a Python loop ({rounds:,} rounds: "
        f"~{args.work_ms:g} ms on one idle core here, calibrated at start), {args.jobs} jobs "
        f"per phase, {IN_FLIGHT} in flight; one worker (concurrency {CONCURRENCY}) with "
        f"{POOL} threads or {POOL} child processes; async probe jobs every "
        f"{PROBE_EVERY * 1000:g} ms and a {TICK * 1000:g} ms ticker on the worker's loop. "
        f"Medians of {args.runs} runs, modes alternating. **The machine was shared and "
        "loaded** (see the load average above): absolute figures move with it, the ratios "
        "within a run less so.\n"
    )
    if s["autogroup"]:
        out.append(
            "The kernel schedules by session here (`kernel.sched_autogroup_enabled=1`): the "
            "run's processes share one CPU share against the other sessions' load, so the "
            "children add CPU, and jobs/s, only while a core is idle. What the pool buys on a "
            "busy machine is the worker's loop: the other jobs' latency.\n"
        )
    rows = [
        [
            mode,
            fmt(m["jobs_per_s"], 1),
            " / ".join(fmt(x, 1) for x in m["jobs_per_s_runs"]),
            fmt(m["probe_p50_ms"], 1),
            fmt(m["probe_p99_ms"], 1),
            fmt(m["lag_p50_ms"], 2),
            fmt(m["lag_p99_ms"], 2),
            fmt(m["lag_max_ms"], 1),
            fmt(m["beat_p50_ms"], 1),
            fmt(m["beat_max_ms"], 1),
        ]
        for mode, m in s.items()
        if mode in MODES
    ]
    headers = ["mode", "CPU jobs/s", "per run", "probe claim p50 ms", "p99"]
    headers += ["loop lag p50 ms", "p99", "max", "heartbeat p50 ms", "max"]
    out.append(table(headers, rows) + "\n")
    t, p = s["threads"], s["processes"]
    out.append(
        f"Processes against threads: {statistics.median(s['ratio_runs']):.2f} times the CPU "
        f"jobs/s (median of the runs' ratios: "
        f"{' / '.join(f'{x:.2f}' for x in s['ratio_runs'])}); "
        f"the other jobs' claim latency p99 {t['probe_p99_ms']:.1f} → {p['probe_p99_ms']:.1f} "
        f"ms and the loop's lag p99 {t['lag_p99_ms']:.1f} → {p['lag_p99_ms']:.1f} ms (idle: "
        f"{s['idle']['probe_p99_ms']:.1f} and {s['idle']['lag_p99_ms']:.1f} ms); "
        f"{t['probes']} and {p['probes']} probes. A heartbeat (every job's lease extended, "
        f"lease {LEASE:g} s: a beat every {LEASE / 3:g} s) took {t['beat_p50_ms']:.1f} ms "
        f"(median; max {t['beat_max_ms']:.1f}) beside threads and {p['beat_p50_ms']:.1f} ms "
        f"(max {p['beat_max_ms']:.1f}) beside processes.\n"
    )
    return "\n".join(out)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="runs of every mode (3)")
    p.add_argument("--jobs", type=int, default=80, help="CPU jobs per phase (80)")
    p.add_argument("--work-ms", type=float, default=50.0, help="a CPU job's work, ms (50)")
    p.add_argument("--idle", type=float, default=3.0, help="seconds of the idle phase (3)")
    p.add_argument("--shards", type=int, default=16, help="logical shards (16)")
    p.add_argument("--quick", action="store_true", help="1 run of 30 jobs")
    p.add_argument("--no-save", action="store_true", help="print only; keep results files")
    args = p.parse_args(argv)
    if args.quick:
        args.runs, args.jobs, args.idle = 1, min(args.jobs, 30), 1.0
    return args


def run(argv: list[str] | None = None) -> None:
    import logging

    import uvloop

    logging.getLogger("jobtier").setLevel(logging.ERROR)  # the workers' start/stop notices
    args = parse(argv)
    env = environment()
    rounds = calibrate(args.work_ms)
    runs = uvloop.run(main(args, rounds))
    summary = summarise(runs)
    summary["autogroup"] = autogroup()
    text = render(summary, args, env, rounds)
    print(text)
    if not args.no_save:
        data = {**env, "arguments": vars(args), "rounds": rounds}
        paths = save("process_pool", {**data, "summary": summary, "runs": runs}, text)
        print(f"\nsaved {paths[0]} and {paths[1]}")


if __name__ == "__main__":
    run()
