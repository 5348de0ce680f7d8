"""Benchmark: what named queues and flow limits cost, against the commit before them.

Every cell is one run of ``bench/throughput.py`` (end-to-end phase: 1 worker process at
concurrency 50, a producer submitting 500 jobs per call, Redis with AOF everysec), in a
subprocess of its own:

* ``before queues, 1 queue``: the same program from another commit (``--compare-rev``,
  extracted with ``git archive`` into a temporary folder and run on its own ``src``): the
  figure named queues must not fall below;
* ``1 queue``: this tree, every job in ``default``;
* ``20 queues``: the jobs spread round-robin over 20 queues, the worker serving all of them;
* ``concurrency limit C``: a global concurrency limit on the queue (permits, store/lua/limit.lua);
* ``rate limit R/s``: at most R starts in any second (the run then takes at least
  ``jobs / R - 1`` seconds: the figure shows the limit holding, and what it costs Redis).

Cells run interleaved (every cell once, then again), ``--runs`` times; figures are medians.
Columns: jobs/s end to end, claim round trips per job (the worker's), Redis CPU µs and
commands per job (everything Redis ran, the scripts' inner commands included).

    .venv/bin/python bench/queues.py --compare-rev 6ca6bad            # 3 runs, 20K jobs
    .venv/bin/python bench/queues.py --compare-rev 6ca6bad --quick    # 5K jobs, 1 run

Results: bench/results/queues.json and bench/results/queues.md.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from common import environment, fmt, header_markdown, median, save, table  # noqa: E402

ROW = "jobtier, end to end"
COLUMNS = {
    "jobs/s": "jobs_per_s",
    "claim round trips/job": "claim_round_trips_per_job",
    "Redis commands/job": "redis_commands_per_job",
    "Redis CPU µs/job": "redis_cpu_us_per_job",
    "worker CPU µs/job": "worker_cpu_us_per_job",
}
Row = dict[str, float | None]  # a cell's figures by COLUMNS key; None where the table has none


def parse_row(output: str) -> Row:
    """The end-to-end row of throughput.py's table, by column."""
    lines = [ln for ln in output.splitlines() if ln.startswith("|")]
    for i, line in enumerate(lines):
        if "jobs/s" in line and "claim round trips/job" in line:
            header = [c.strip() for c in line.strip("|").split("|")]
            for row in lines[i + 2 :]:
                cells = [c.strip() for c in row.strip("|").split("|")]
                if cells[0].startswith(ROW):
                    out: Row = {}
                    for name, key in COLUMNS.items():
                        value = cells[header.index(name)].replace(",", "")
                        out[key] = float(value) if re.fullmatch(r"[0-9.]+", value) else None
                    return out
    raise RuntimeError(f"no '{ROW}' row in throughput.py's output:\n{output[-2000:]}")


def extract(rev: str, into: Path) -> Path:
    """The tree of ``rev`` (src and bench) in a folder of its own."""
    archive = into / "tree.tar"
    subprocess.run(
        [
            "git",
            "-C",
            str(ROOT),
            "archive",
            "--format=tar",
            "-o",
            str(archive),
            rev,
            "src",
            "bench",
        ],
        check=True,
    )
    with tarfile.open(archive) as tar:
        tar.extractall(into / "tree", filter="data")
    return into / "tree"


def run_cell(tree: Path, jobs: int, extra: list[str], timeout: float) -> Row:
    cmd = [
        sys.executable, str(tree / "bench" / "throughput.py"), "--phases", "e2e",
        "--jobs", str(jobs), "--runs", "1", "--no-save", *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return parse_row(done.stdout)


def cells(args: argparse.Namespace, old: Path | None) -> list[tuple[str, Callable[[], Any]]]:
    n = args.jobs
    rate_jobs = max(2 * args.rate, min(n, 3 * args.rate))
    out: list[tuple[str, Callable[[], Any]]] = []
    if old is not None:
        out.append(
            (
                f"before queues ({args.compare_rev}), 1 queue",
                lambda: run_cell(old, n, [], args.timeout),
            )
        )
    out += [
        ("1 queue", lambda: run_cell(ROOT, n, [], args.timeout)),
        ("20 queues", lambda: run_cell(ROOT, n, ["--queues", "20"], args.timeout)),
        (
            f"1 queue, concurrency limit {args.limit} (of 50 slots)",
            lambda: run_cell(ROOT, n, ["--queue-concurrency", str(args.limit)], args.timeout),
        ),
        (
            f"1 queue, rate limit {args.rate}/s ({rate_jobs} jobs)",
            lambda: run_cell(ROOT, rate_jobs, ["--queue-rate", str(args.rate)], args.timeout),
        ),
    ]  # fmt: skip
    return out


def jobs_per_s(row: Row) -> float:
    """A cell's jobs/s: throughput.py's row always has a number there."""
    value = row["jobs_per_s"]
    assert value is not None, row
    return value


def render(results: dict[str, list[Row]], args: argparse.Namespace, env: Any) -> str:
    rows = []
    for name, runs in results.items():
        row = [name]
        for key in COLUMNS.values():
            values = [v for r in runs if (v := r.get(key)) is not None]
            row.append(fmt(median(values), 3 if "trips" in key else 0) if values else "-")
        rows.append(row)
    md = header_markdown("Named queues and flow limits, against the commit before them", env)
    md += (
        f"\n{args.jobs:,} no-op jobs per cell (the rate-limited cell fewer), 1 worker process at "
        f"concurrency 50, Redis AOF everysec, 16 shards; medians of {args.runs} interleaved "
        "run(s). Each cell is `bench/throughput.py --phases e2e` in a subprocess.\n\n"
    )
    md += table(["cell", *COLUMNS], rows) + "\n"
    base = results.get(next(iter(results)), [])
    this = results.get("1 queue", [])
    if base and this and next(iter(results)) != "1 queue":
        b = median([jobs_per_s(r) for r in base])
        t = median([jobs_per_s(r) for r in this])
        md += f"\n- 1 queue against the commit before queues: {t / b:.2f}x jobs/s.\n"
    return md


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=20_000, help="jobs per cell (20000)")
    p.add_argument("--runs", type=int, default=3, help="interleaved runs (3)")
    p.add_argument("--compare-rev", help="the commit to measure as 'before queues'")
    p.add_argument("--limit", type=int, default=10, help="the concurrency limit cell's limit (10)")
    p.add_argument("--rate", type=int, default=2000, help="the rate limit cell's starts/s (2000)")
    p.add_argument("--timeout", type=float, default=300.0, help="bound on one cell, s (300)")
    p.add_argument("--quick", action="store_true", help="5,000 jobs, 1 run")
    p.add_argument("--no-save", action="store_true", help="print only")
    args = p.parse_args(argv)
    if args.quick:
        args.jobs, args.runs = min(args.jobs, 5_000), 1
    env = environment()
    results: dict[str, list[Row]] = {}
    with tempfile.TemporaryDirectory(prefix="jobtier-bench-queues-") as tmp:
        old = extract(args.compare_rev, Path(tmp)) if args.compare_rev else None
        for run in range(args.runs):
            for name, cell in cells(args, old):
                figures = cell()
                results.setdefault(name, []).append(figures)
                print(f"run {run + 1} {name}: {fmt(figures['jobs_per_s'])} jobs/s", flush=True)
    md = render(results, args, env)
    print(md)
    if not args.no_save:
        paths = save("queues", {"args": vars(args), "env": env, "results": results}, md)
        print("saved", *paths)


if __name__ == "__main__":
    main()
