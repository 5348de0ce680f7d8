"""Microbenchmark: the worker's in-process cost per job, this tree against a git revision.

No Redis: jobs are handed to the worker's launcher directly and their reports are dropped, so
what is measured is the Python path a claimed job takes through the worker (context, task,
attempt, classification, result encoding, bookkeeping): the part that Redis round trips
hide in ``throughput.py``. The baseline is ``--baseline``'s ``src/jobtier``, extracted with
``git archive`` and imported in this same process under another name (``jobtier_baseline``),
so both run with one interpreter, one heap and one event loop, measured alternately:
separate processes differ by several per cent from run to run on their own.

    .venv/bin/python bench/worker_execute.py                     # against HEAD
    .venv/bin/python bench/worker_execute.py --baseline main --rounds 40

Figures: CPU µs of this process per job (the task threads included), the least over the
rounds (the best estimate of what the code costs: other work on the machine only adds to
it) and the median. Results go to bench/results/worker_execute.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import types
from collections.abc import Awaitable, Callable
from io import BytesIO
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, environment, header_markdown, save, table

BASELINE = "jobtier_baseline"
CASES = {
    "async, succeeds": "echo",
    "async, fails (retried)": "boom",
    "sync (thread), succeeds": "sync_echo",
}
BATCH = 50  # jobs started at once (the worker's concurrency)


def extract(rev: str, into: Path) -> None:
    """``rev``'s src/jobtier as the package ``jobtier_baseline`` in ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "src/jobtier"], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    package = into / BASELINE
    (into / "src" / "jobtier").rename(package)
    for path in package.rglob("*.py"):
        text = path.read_text()
        text = re.sub(r"\bjobtier\.", f"{BASELINE}.", text)
        text = re.sub(r"\bfrom jobtier import\b", f"from {BASELINE} import", text)
        path.write_text(text)
    sys.path.insert(0, str(into))


def measurer(top: str, jobs: int) -> dict[str, Callable[[], Awaitable[float]]]:
    """For the jobtier package named ``top``: a measure per case, CPU µs per job."""
    mod = {
        name: __import__(f"{top}.{name}", fromlist=["_"])
        for name in ("config", "core.keys", "core.model", "worker.registry", "worker.runner")
    }
    reg = mod["worker.registry"]

    async def echo(ctx: Any, payload: Any) -> Any:
        return payload

    async def boom(ctx: Any, payload: Any) -> None:
        raise RuntimeError("no")

    def sync_echo(ctx: Any, payload: Any) -> Any:
        return payload

    registry = reg.TaskRegistry([reg.task(echo), reg.task(retries=5)(boom), reg.task(sync_echo)])
    settings = mod["config"].Settings.from_env({})
    # what the Worker reads of its Store (of its Queue, ``jobs`` too, in older trees)
    keys, control = mod["core.keys"].Keys("jt", 16), types.SimpleNamespace(stored_result=None)
    store = types.SimpleNamespace(
        scripts=None, redis=None, keys=keys, settings=settings, jobs=control
    )
    claimed = mod["core.model"].ClaimedJob

    def measure(kind: str) -> Callable[[], Awaitable[float]]:
        batch = [claimed(f"job-{i}", kind, b'{"n":1}', 1, 6, 2, 0, 0) for i in range(jobs)]

        async def run() -> float:
            worker = mod["worker.runner"].Worker(store, registry, concurrency=BATCH)
            loop = asyncio.get_running_loop()
            if hasattr(worker, "launcher"):  # the worker as parts (worker/launcher.py)
                worker.launcher.loop = loop
                worker.reporter.report = lambda *args: None  # no Redis: the outcome is dropped
                launcher, running = worker.launcher, worker.state.running
                start_job, threads = launcher.start, launcher.threads
            else:
                worker._loop = loop
                worker._report = lambda *args: None
                start_job, running, threads = worker._start, worker._running, worker._threads
            start = time.process_time()
            for i in range(0, jobs, BATCH):
                for job in batch[i : i + BATCH]:
                    start_job(job, 0, 0)
                await asyncio.gather(*(r.handle for r in list(running.values())))
            took = time.process_time() - start
            threads.shutdown()
            return took / jobs * 1e6

        return run

    return {case: measure(kind) for case, kind in CASES.items()}


async def compare(rounds: int, jobs: int) -> dict[str, dict[str, list[float]]]:
    trees = {"baseline": measurer(BASELINE, jobs), "this tree": measurer("jobtier", jobs)}
    results: dict[str, dict[str, list[float]]] = {t: {c: [] for c in CASES} for t in trees}
    for case in CASES:
        for tree in trees.values():
            await tree[case]()  # warm-up
    for i in range(rounds):
        order = list(trees.items())
        if i % 2:
            order.reverse()
        for name, tree in order:
            for case, run in tree.items():
                results[name][case].append(await run())
        print(f"round {i + 1}/{rounds}", file=sys.stderr)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--baseline", default="HEAD", help="git revision to compare against")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--jobs", type=int, default=10_000, help="jobs per measure")
    args = parser.parse_args()
    env = environment()
    with tempfile.TemporaryDirectory(prefix="jobtier-bench-") as folder:
        extract(args.baseline, Path(folder))
        try:
            import uvloop

            results = uvloop.run(compare(args.rounds, args.jobs))
            loop = "uvloop"
        except ImportError:
            results = asyncio.run(compare(args.rounds, args.jobs))
            loop = "asyncio"
    least = {t: {c: min(v) for c, v in cases.items()} for t, cases in results.items()}
    median = {
        t: {c: statistics.median(v) for c, v in cases.items()} for t, cases in results.items()
    }
    rows = [
        [
            case,
            f"{least['baseline'][case]:.2f}",
            f"{least['this tree'][case]:.2f}",
            f"{least['this tree'][case] - least['baseline'][case]:+.2f}",
            f"{median['baseline'][case]:.2f}",
            f"{median['this tree'][case]:.2f}",
            f"{median['this tree'][case] - median['baseline'][case]:+.2f}",
        ]
        for case in CASES
    ]
    text = table(
        ["job", "baseline, least", "this tree, least", "change", "baseline, median",
         "this tree, median", "change"],
        rows,
    )  # fmt: skip
    print(text)
    markdown = (
        header_markdown("Worker: in-process CPU µs per job (no Redis)", env)
        + f"\nBaseline `{args.baseline}`; {args.jobs:,} jobs per measure, {BATCH} at a time; "
        f"{args.rounds} rounds, the two trees alternating in one process; {loop}.\n\n" + text
    )
    save(
        "worker_execute",
        {"environment": env, "args": vars(args), "loop": loop, "least": least,
         "median": median, "results": results},
        markdown,
    )  # fmt: skip


if __name__ == "__main__":
    main()
