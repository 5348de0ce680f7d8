"""Microbenchmark: the worker's in-process cost per job, this tree against a git revision.

No Redis: jobs are handed to ``Worker._start`` directly and the reports are dropped, so what
is measured is the Python path a claimed job takes through the worker (context, task,
attempt, classification, result encoding, bookkeeping) — the part the Redis round trips
hide in ``throughput.py``. The baseline is the same program run against ``--baseline``'s
``src`` (extracted with ``git archive``), in alternating subprocesses of the same run.

    .venv/bin/python bench/worker_execute.py                    # against HEAD
    .venv/bin/python bench/worker_execute.py --baseline main --runs 9

Columns: CPU time of the process per job (threads included; less moved by other work on the\nmachine than wall time) (median of ``--runs`` runs of ``--jobs`` jobs each), baseline
and this tree. Results go to bench/results/worker_execute.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, environment, header_markdown, save, table

CASES = ("async, succeeds", "async, fails (retried)", "sync (thread), succeeds")

# Runs in a subprocess whose PYTHONPATH selects the jobtier under test.
CHILD = r"""
import asyncio, json, sys, time, types
from jobtier.config import Settings
from jobtier.keys import Keys
from jobtier.model import ClaimedJob
from jobtier.worker.registry import TaskRegistry, task
from jobtier.worker.runner import Worker

@task
async def echo(ctx, payload):
    return payload

@task(retries=5)
async def boom(ctx, payload):
    raise RuntimeError("no")

@task
def sync_echo(ctx, payload):
    return payload

CASES = {"async, succeeds": "echo", "async, fails (retried)": "boom",
         "sync (thread), succeeds": "sync_echo"}
JOBS, BATCH = int(sys.argv[1]), 50
registry = TaskRegistry([echo, boom, sync_echo])
settings = Settings.from_env({})
fake_queue = types.SimpleNamespace(scripts=None, keys=Keys("jt", 16), settings=settings)

async def measure(kind):
    worker = Worker(fake_queue, registry, concurrency=BATCH)
    worker._loop = asyncio.get_running_loop()
    worker._report = lambda *args: None  # no Redis: the outcome is dropped
    jobs = [ClaimedJob(f"job-{i}", kind, b'{"n":1}', 1, 6, 2, 0, 0) for i in range(JOBS)]
    start = time.process_time()
    for i in range(0, JOBS, BATCH):
        for job in jobs[i : i + BATCH]:
            worker._start(job, 0, 0)
        await asyncio.gather(*(r.handle for r in list(worker._running.values())))
    took = time.process_time() - start
    worker._threads.shutdown()
    return took / JOBS * 1e9

async def main():
    out = {}
    for case, kind in CASES.items():
        await measure(kind)  # warm-up
        out[case] = await measure(kind)
    print(json.dumps(out))

try:
    import uvloop
    uvloop.run(main())
except ImportError:
    asyncio.run(main())
"""


def extract(rev: str, into: Path) -> Path:
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "src"], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def run_child(src: Path, jobs: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(jobs)], env=env, check=True, capture_output=True
    )
    result: dict[str, float] = json.loads(out.stdout)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default="HEAD", help="git revision to compare against")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--jobs", type=int, default=20_000)
    args = parser.parse_args()
    env = environment()
    with tempfile.TemporaryDirectory(prefix="jobtier-bench-") as folder:
        base_src = extract(args.baseline, Path(folder))
        this_src = ROOT / "src"
        runs: dict[str, list[dict[str, float]]] = {"baseline": [], "this tree": []}
        for i in range(args.runs):
            order = [("baseline", base_src), ("this tree", this_src)]
            for name, src in order if i % 2 == 0 else reversed(order):
                runs[name].append(run_child(src, args.jobs))
                print(f"run {i + 1}/{args.runs} {name}: {runs[name][-1]}", file=sys.stderr)
    medians = {
        name: {case: statistics.median(r[case] for r in results) for case in CASES}
        for name, results in runs.items()
    }
    rows = [
        [
            case,
            f"{medians['baseline'][case] / 1000:.2f}",
            f"{medians['this tree'][case] / 1000:.2f}",
            f"{medians['this tree'][case] / medians['baseline'][case]:.3f}",
        ]
        for case in CASES
    ]
    text = table(["job", "baseline CPU µs/job", "this tree CPU µs/job", "ratio"], rows)
    print(text)
    markdown = (
        header_markdown("Worker: in-process cost per job (no Redis)", env)
        + f"\n{args.jobs:,} jobs per run, 50 at a time; baseline `{args.baseline}`; "
        f"medians of {args.runs} alternating runs, uvloop when installed.\n\n" + text
    )
    save(
        "worker_execute",
        {"environment": env, "args": vars(args), "runs": runs, "medians": medians},
        markdown,
    )


if __name__ == "__main__":
    main()
