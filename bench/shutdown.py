"""Benchmark: how long a worker takes to exit after SIGTERM, against its ``--grace``.

Starts its own Redis (AOF on) and, for each case, a fresh ``jobtier worker`` process (the
real CLI) with every slot busy on a long job (plus jobs waiting behind them), then sends it
SIGTERM and times, from this process, the signal to the worker's exit. The grace promises a
bound from the signal: the worker stops claiming at once, running jobs get until signal +
grace, and the rest are released to their queues. After each exit the jobs are counted: how
many were released (queued again, attempt not used) and whether any waiting job was claimed
after the signal.

Cases (each ``--runs`` times, median reported):

* baseline: an idle worker (no jobs), grace 5 s: the exit's own cost, measured in the same run;
* grace 1, 3, 5 s, every slot busy with async jobs of ``--job-seconds``;
* grace 3 s, every slot busy with sync jobs (threads that cannot be interrupted);
* a second SIGTERM 0.5 s after the first, grace 60 s: timed from the second signal.

``--compare-src DIR`` runs every case a second time with workers from another checkout's
``src`` (say, before a change), in the same run, for a table beside this checkout's; the job
length defaults to 12 s so that a worker that waits for its jobs shows it.

    .venv/bin/python bench/shutdown.py                 # 5 runs per case
    .venv/bin/python bench/shutdown.py --runs 3 --compare-src ../other-checkout/src

Results: bench/results/shutdown.json and bench/results/shutdown.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, flush, fmt, header_markdown, local_redis, median, save, table

from jobtier.config import Settings
from jobtier.core.model import State
from jobtier.engine.queue import Queue

TASKS = """
import asyncio, time
from jobtier import task

@task(retries=2)
async def hold(ctx, payload):
    await asyncio.sleep(payload["seconds"])

@task(retries=2)
def hold_sync(ctx, payload):
    time.sleep(payload["seconds"])
"""


@dataclass
class Case:
    name: str
    grace: float
    task: str | None  # None: no jobs (idle worker)
    second_signal: bool = False


CASES = [
    Case("baseline: idle worker", 5, None),
    Case("async jobs, every slot busy", 1, "hold"),
    Case("async jobs, every slot busy", 3, "hold"),
    Case("async jobs, every slot busy", 5, "hold"),
    Case("sync jobs (threads), every slot busy", 3, "hold_sync"),
    Case("second SIGTERM after 0.5 s (timed from it)", 60, "hold", second_signal=True),
]


async def one_run(
    queue: Queue,
    settings: Settings,
    case: Case,
    args: argparse.Namespace,
    tasks_dir: Path,
    src: str | None,
) -> dict[str, Any]:
    await flush(queue.redis)
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBTIER_")}
    path = [str(tasks_dir)] + ([src] if src else [])
    env.update(
        JOBTIER_REDIS_URL=settings.redis_url,
        JOBTIER_SHARDS=str(settings.shards),
        PYTHONPATH=os.pathsep.join(path),
    )
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "jobtier.cli", "worker", "bench_shutdown_tasks",
        "-c", str(args.concurrency), "--grace", str(case.grace),
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    jobs: list[str] = []
    try:
        if case.task is None:
            await _until(lambda: _registered(queue), 30)
        else:
            for _ in range(args.concurrency + 2):  # every slot busy, two waiting
                sub = await queue.submit(case.task, {"seconds": args.job_seconds})
                jobs.append(sub.job_id)
            await _until(lambda: _running(queue, jobs, args.concurrency), 30)
        start = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        if case.second_signal:
            await asyncio.sleep(0.5)
            start = time.monotonic()
            worker.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(worker.wait(), 600)
        took = time.monotonic() - start
    finally:
        if worker.returncode is None:
            worker.kill()
            await worker.wait()
    statuses = [await queue.status(j) for j in jobs]
    released = sum(1 for s in statuses if s.state is State.QUEUED and s.version > 1)
    succeeded = sum(1 for s in statuses if s.state is State.SUCCEEDED)
    # exactly ``concurrency`` jobs were running at the signal: any other that moved was
    # claimed after it
    claimed_late = sum(1 for s in statuses if s.version > 1) - (len(jobs) and args.concurrency)
    return {
        "seconds": took,
        "exit_code": code,
        "released": released,
        "succeeded": succeeded,
        "claimed_after_signal": claimed_late,
    }


def _label(src: str | None, given: str | None) -> str:
    """'this checkout', or the other one named by its commit (paths mean nothing elsewhere)."""
    if src is None:
        return "this checkout"
    if given:
        return given
    commit = subprocess.run(
        ["git", "-C", src, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return f"another checkout, at commit {commit}" if commit else "another checkout"


async def _registered(queue: Queue) -> bool:
    return bool(await queue.redis.hlen(queue.keys.workers()))


async def _running(queue: Queue, jobs: list[str], n: int) -> bool:
    states = [(await queue.status(j)).state for j in jobs]
    return states.count(State.RUNNING) == n


async def _until(predicate: Any, timeout: float) -> None:
    async with asyncio.timeout(timeout):
        while not await predicate():
            await asyncio.sleep(0.02)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    sources: list[str | None] = [None] + ([args.compare_src] if args.compare_src else [])
    tables: dict[str, list[dict[str, Any]]] = {}
    with local_redis() as server, tempfile.TemporaryDirectory() as tasks_dir:
        (Path(tasks_dir) / "bench_shutdown_tasks.py").write_text(TASKS)
        settings = Settings.from_env({}, redis_url=server.url, shards=4)
        queue = await Queue.connect(settings, catalog=False)
        try:
            for src in sources:
                label = _label(src, args.compare_label)
                results = tables[label] = []
                for case in CASES:
                    runs = []
                    for i in range(args.runs):
                        run = await one_run(queue, settings, case, args, Path(tasks_dir), src)
                        runs.append(run)
                        print(
                            f"[{label}] {case.name} grace={case.grace:g}s run {i + 1}: "
                            f"{run['seconds']:.2f} s released={run['released']}",
                            file=sys.stderr,
                        )
                    results.append({"case": case.__dict__, "runs": runs})
        finally:
            await queue.close()
    return {"runs_per_case": args.runs, "concurrency": args.concurrency,
            "job_seconds": args.job_seconds, "tables": tables}  # fmt: skip


def markdown(data: dict[str, Any], env: dict[str, Any]) -> str:
    out = [header_markdown("Worker shutdown time against --grace", env)]
    out.append(
        f"\nOne `jobtier worker` per run (concurrency {data['concurrency']}), every slot busy "
        f"on a {data['job_seconds']:g} s job and two more waiting; SIGTERM, then the time "
        f"until the process exits, seen from the bench process. Median of "
        f"{data['runs_per_case']} runs per case. 'released': jobs queued again after the exit "
        "(attempt not used), per run; 'succeeded': jobs that ran to their end, all runs; "
        "'claimed late': waiting jobs claimed after the signal, all runs."
    )
    for label, results in data["tables"].items():
        out.append(f"\n## Workers from {label}\n")
        out.append(_table(results))
    return "\n".join(out)


def _table(results: list[dict[str, Any]]) -> str:
    rows = []
    for result in results:
        case, runs = result["case"], result["runs"]
        seconds = [r["seconds"] for r in runs]
        grace = case["grace"]
        bounded = case["task"] is not None and not case["second_signal"]
        rows.append([
            case["name"],
            f"{grace:g}",
            fmt(median(seconds), 2),
            fmt(min(seconds), 2),
            fmt(max(seconds), 2),
            fmt(median(seconds) - grace, 2) if bounded else "-",
            "/".join(str(r["released"]) for r in runs),
            str(sum(r["succeeded"] for r in runs)),
            str(sum(r["claimed_after_signal"] for r in runs)),
            "/".join(str(r["exit_code"]) for r in runs),
        ])  # fmt: skip
    headers = ["case", "grace s", "exit s (median)", "min", "max", "median - grace",
               "released", "succeeded", "claimed late", "exit codes"]  # fmt: skip
    return table(headers, rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per case (default 5)")
    parser.add_argument("--concurrency", type=int, default=4, help="worker slots (default 4)")
    parser.add_argument(
        "--job-seconds", type=float, default=12.0, help="length of each job (default 12)"
    )
    parser.add_argument(
        "--compare-src", help="also run every case with workers from this src folder"
    )
    parser.add_argument(
        "--compare-label", help="what to call it in the tables (default: its git commit)"
    )
    parser.add_argument("--no-save", action="store_true", help="print only")
    args = parser.parse_args()
    env = environment()
    data = asyncio.run(main(args))
    text = markdown(data, env)
    print(text)
    if not args.no_save:
        paths = save("shutdown", {"environment": env, **data}, text)
        print(f"\nsaved {paths[0]} and {paths[1]}", file=sys.stderr)
