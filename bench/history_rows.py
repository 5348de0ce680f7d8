"""Benchmark: history rows Postgres keeps per job, with progress reports coalesced or not.

Starts its own Redis (AOF on) and Postgres in temporary folders, then, for each setting of
``JOBTIER_PROGRESS_HISTORY_SECONDS``, runs a worker with the demo tasks and a persister in
this process and submits ``--jobs`` demo ``sleep`` jobs of ``--seconds`` seconds at once.
The task reports progress every 0.1 s; the worker sends what changed every 0.2 s (its
progress interval), and each report sent is a new version of the status document.

Per job it counts the status document's versions (what ETags and event streams see: the same
whatever the setting), the rows of ``job_transitions``, and checks the history with
``history_gaps`` (every prev_version link leads to a stored row).

The baseline is the setting 0, measured in the same run: every progress report logged, as
jobtier did before coalescing.

    .venv/bin/python bench/history_rows.py                 # 20 jobs of 5 s; 0, 1 and 10 s
    .venv/bin/python bench/history_rows.py --jobs 5 --settings 0,10

Results: bench/results/history_rows.json and bench/results/history_rows.md.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, fresh, header_markdown, local_redis, save, table

from jobtier.config import Settings
from jobtier.core.model import TERMINAL
from jobtier.dev.local_postgres import LocalPostgres
from jobtier.engine.queue import Queue
from jobtier.persist.db import Pool, create_pool, migrate, query
from jobtier.persist.persister import Persister
from jobtier.worker.registry import TaskRegistry
from jobtier.worker.runner import Worker

SHARDS = 4


async def measure(base: Settings, pool: Pool, every: float, jobs: int, seconds: float) -> Any:
    """Run ``jobs`` sleep jobs with progress_history_seconds=every; per-job figures."""
    settings = base.replace(progress_history_seconds=every)
    registry = TaskRegistry.load("jobtier.demo")
    await pool.execute("TRUNCATE jobs, jobs_by_state, job_transitions, job_results CASCADE")
    async with await Queue.connect(settings, registry) as queue:
        await fresh(queue.redis)
        worker = Worker(queue.store, registry, concurrency=jobs)
        persister = Persister(settings, queue.redis, pool, "bench-persister")
        running = [asyncio.create_task(worker.run()), asyncio.create_task(persister.run())]
        try:
            ids = [(await queue.submit("sleep", {"seconds": seconds})).job_id for _ in range(jobs)]
            deadline = time.monotonic() + seconds * 4 + 30
            versions: dict[str, int] = {}
            while len(versions) < jobs:
                if time.monotonic() > deadline:
                    raise SystemExit(f"jobs did not finish: {len(versions)} of {jobs} did")
                for job_id in ids:
                    status = await queue.status(job_id)
                    if status.state in TERMINAL:
                        versions[job_id] = status.version
                await asyncio.sleep(0.2)
            while await pool.fetchval(
                "SELECT count(*) FROM jobs WHERE id = ANY($1) AND version = ANY($2)",
                ids, list(set(versions.values())),
            ) < jobs:  # fmt: skip
                await asyncio.sleep(0.05)  # the persister has written every job's last version
        finally:
            worker.stop()
            persister.stop()
            await asyncio.gather(*running)
    rows: dict[str, int] = {
        r[0]: r[1]
        for r in await pool.fetch(
            "SELECT job_id, count(*) FROM job_transitions WHERE job_id = ANY($1) GROUP BY 1", ids
        )
    }
    states: dict[str, str] = {
        r[0]: r[1] for r in await pool.fetch("SELECT id, state FROM jobs WHERE id = ANY($1)", ids)
    }
    gaps = await pool.fetch(query("history_gaps"), ids)
    return {
        "progress_history_seconds": every,
        "jobs": jobs,
        "succeeded": sum(1 for s in states.values() if s == "succeeded"),
        "versions": [versions[i] for i in ids],
        "rows": [rows.get(i, 0) for i in ids],
        "gaps": len(gaps),
    }


async def main(args: argparse.Namespace) -> list[Any]:
    out = []
    with local_redis() as redis_server, tempfile.TemporaryDirectory(prefix="jobtier-pg-") as d:
        pg = LocalPostgres(Path(d), durable=False).start()
        try:
            await migrate(pg.dsn)
            base = Settings.from_env(
                {}, redis_url=redis_server.url, database_url=pg.dsn, shards=SHARDS
            )
            pool = await create_pool(pg.dsn, max_size=4)
            try:
                for every in args.settings:
                    print(f"progress_history_seconds={every:g}: {args.jobs} sleep jobs …")
                    out.append(await measure(base, pool, every, args.jobs, args.seconds))
            finally:
                await pool.close()
        finally:
            pg.destroy()
    return out


def render(results: list[Any], args: argparse.Namespace, env: dict[str, Any]) -> str:
    baseline = statistics.median(results[0]["rows"]) if results else 0
    lines = []
    for r in results:
        med = statistics.median(r["rows"])
        label = f"{r['progress_history_seconds']:g}"
        lines.append([
            label + (" (baseline: every report)" if r is results[0] else ""),
            f"{r['succeeded']}/{r['jobs']}",
            f"{statistics.median(r['versions']):g}",
            f"{med:g} ({min(r['rows'])}-{max(r['rows'])})",
            f"{baseline / med:.1f}x" if med else "-",
            str(r["gaps"]),
        ])  # fmt: skip
    headers = [
        "JOBTIER_PROGRESS_HISTORY_SECONDS", "succeeded", "versions per job",
        "history rows per job", "fewer rows", "gaps",
    ]  # fmt: skip
    return (
        header_markdown("History rows per job", env)
        + f"\n{args.jobs} demo `sleep` jobs of {args.seconds:g} s at once per setting, one "
        "in-process worker (progress sent every 0.2 s) and persister, Redis with AOF, a "
        "local Postgres. Versions = changes of the status document (ETags, event streams); "
        "rows = `job_transitions` rows of the job; gaps = missing rows `history_gaps` "
        "found. Median over the jobs (min-max).\n\n" + table(headers, lines) + "\n"
    )


def run(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=20, help="sleep jobs per setting (20)")
    parser.add_argument("--seconds", type=float, default=5.0, help="each job's sleep (5)")
    parser.add_argument(
        "--settings",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[0.0, 1.0, 10.0],
        help="values of JOBTIER_PROGRESS_HISTORY_SECONDS, the first being the baseline "
        "(default 0,1,10)",
    )
    args = parser.parse_args(argv)
    env = environment()
    results = asyncio.run(main(args))
    markdown = render(results, args, env)
    print(markdown)
    json_path, md_path = save("history_rows", {"env": env, "results": results}, markdown)
    print(f"saved {json_path} and {md_path}")


if __name__ == "__main__":
    run()
