"""Benchmark: a batch's cost per child against plain jobs, measured in the same run.

Starts its own Redis (AOF on, 16 shards) and, each run, in turn (the order alternating
between runs):

* plain: N ``echo`` jobs submitted as ``POST /v1/jobs/batch`` would, ``submit_many`` of
  1,000 (``JOBTIER_MAX_BATCH``) per call, one call after the other;
* batch: one ``submit_batch`` of the same N payloads (one call: a request of the API).

For each, the submit's wall time per job (this process's preparing included) and Redis's
CPU per job (``INFO cpu``, user + system), commands and AOF bytes per job; then every job
is claimed and completed by the scripts directly (500 per claim, as a worker would, without
running anything) and the same is measured for that phase: what a child's finish costs with
its batch's counting (two HINCRBY and an HGET in its transition) against a plain job's.

    .venv/bin/python bench/batches.py             # 5 runs of 100,000 jobs
    .venv/bin/python bench/batches.py --quick     # 3 runs of 10,000

Results: bench/results/batches.json and bench/results/batches.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

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
from jobtier.core.model import JobSpec
from jobtier.engine.queue import Queue
from jobtier.store.calls import complete_call

PLAIN_CALL = 1000  # jobs per submit_many: JOBTIER_MAX_BATCH, the API's batch submit
CLAIM = 500


async def submit_plain(queue: Queue, n: int) -> None:
    for start in range(0, n, PLAIN_CALL):
        specs = [
            JobSpec(type="echo", payload={"n": i}) for i in range(start, min(n, start + PLAIN_CALL))
        ]
        await queue.submit_many(specs)


async def submit_batch(queue: Queue, n: int) -> None:
    b = await queue.submit_batch("echo", [{"n": i} for i in range(n)])
    assert b.total == n


async def finish_all(queue: Queue, n: int) -> None:
    """Claim and complete every ready job, shard by shard (no task runs)."""
    done = 0
    retention = queue.settings.retention_seconds
    for shard in range(queue.keys.shards):
        while True:
            claimed = await queue.scripts.claim(shard, "bench-worker", CLAIM, 60_000)
            if not claimed.jobs:
                break
            items = [(j.id, j.lease_version, b"") for j in claimed.jobs]
            await queue.scripts.call(*complete_call(shard, "bench-worker", retention, items))
            done += len(items)
    assert done == n, (done, n)


async def phase(queue: Queue, meter: RedisMeter, name: str, n: int) -> dict[str, Any]:
    await fresh(queue.redis)
    submit = submit_plain if name == "plain" else submit_batch
    await meter.start()
    t0 = time.perf_counter()
    await submit(queue, n)
    wall = time.perf_counter() - t0
    sub = await meter.stop(n)
    await meter.start()
    t1 = time.perf_counter()
    await finish_all(queue, n)
    fin_wall = time.perf_counter() - t1
    fin = await meter.stop(n)
    return {
        "submit_us_per_job": 1e6 * wall / n,
        "submit_redis_cpu_us_per_job": sub["redis_cpu_us_per_job"],
        "submit_commands_per_job": sub["redis_commands_per_job"],
        "submit_aof_bytes_per_job": sub["aof_bytes_per_job"],
        "finish_us_per_job": 1e6 * fin_wall / n,
        "finish_redis_cpu_us_per_job": fin["redis_cpu_us_per_job"],
        "finish_commands_per_job": fin["redis_commands_per_job"],
    }


async def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    with local_redis(aof=True) as server:
        settings = Settings.from_env({}, redis_url=server.url, shards=16)
        async with await Queue.connect(settings, catalog=False) as queue:
            meter = RedisMeter(queue.redis, server.pid)  # type: ignore[arg-type]
            for run in range(args.runs):
                order = ("plain", "batch") if run % 2 == 0 else ("batch", "plain")
                out = {name: await phase(queue, meter, name, args.jobs) for name in order}
                runs.append(out)
                p, b = out["plain"], out["batch"]
                print(
                    f"run {run + 1}: submit µs/job plain {p['submit_us_per_job']:.1f} batch "
                    f"{b['submit_us_per_job']:.1f}; Redis CPU µs/job plain "
                    f"{p['submit_redis_cpu_us_per_job']:.1f} batch "
                    f"{b['submit_redis_cpu_us_per_job']:.1f}; finish Redis CPU µs/job plain "
                    f"{p['finish_redis_cpu_us_per_job']:.1f} batch "
                    f"{b['finish_redis_cpu_us_per_job']:.1f}",
                    flush=True,
                )
    return runs


KEYS = (
    ("submit, wall µs/job", "submit_us_per_job", 1),
    ("submit, Redis CPU µs/job", "submit_redis_cpu_us_per_job", 1),
    ("submit, Redis commands/job", "submit_commands_per_job", 1),
    ("submit, AOF bytes/job", "submit_aof_bytes_per_job", 0),
    ("claim + complete, wall µs/job", "finish_us_per_job", 1),
    ("claim + complete, Redis CPU µs/job", "finish_redis_cpu_us_per_job", 1),
    ("claim + complete, Redis commands/job", "finish_commands_per_job", 1),
)


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for _, key, _ in KEYS:
        plain = median([r["plain"][key] for r in runs])
        batch = median([r["batch"][key] for r in runs])
        ratios = [r["batch"][key] / r["plain"][key] for r in runs if r["plain"][key]]
        out[key] = {"plain": plain, "batch": batch, "ratio_median": median(ratios)}
    return out


def render(s: dict[str, Any], args: argparse.Namespace, env: dict[str, Any]) -> str:
    out = [header_markdown("Batches: cost per child against plain jobs", env)]
    out.append(
        f"{args.runs} runs of {args.jobs:,} `echo` jobs each way, in alternating order, on one "
        "Redis with AOF on (everysec), 16 shards. Plain: `submit_many` of 1,000 jobs per call "
        "(the API's batch submit, `JOBTIER_MAX_BATCH`), one call after the other. Batch: one "
        f"`submit_batch` of the {args.jobs:,} payloads. Then every job claimed ({CLAIM} per "
        "claim) and completed by the scripts directly. Medians of the runs, and the median "
        "of the per-run ratios (batch / plain: below 1 is cheaper).\n"
    )
    out.append(
        "The machine was shared and loaded while this ran (other engineers' tests and "
        "benchmarks on the same 2 cores): wall times are noisy, Redis CPU less so; compare "
        "the two columns of one run rather than these figures with another file's.\n"
    )
    rows = [
        [label, fmt(s[key]["plain"], d), fmt(s[key]["batch"], d), f"{s[key]['ratio_median']:.2f}"]
        for label, key, d in KEYS
    ]
    out.append(table(["per job", "plain", "batch", "batch / plain"], rows) + "\n")
    return "\n".join(out)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=100_000, help="jobs each way (100000)")
    p.add_argument("--runs", type=int, default=5, help="runs (5)")
    p.add_argument("--quick", action="store_true", help="3 runs of 10,000 jobs")
    p.add_argument("--no-save", action="store_true", help="print only; keep results files")
    args = p.parse_args(argv)
    if args.quick:
        args.runs, args.jobs = min(args.runs, 3), min(args.jobs, 10_000)
    return args


def run(argv: list[str] | None = None) -> None:
    import uvloop

    args = parse(argv)
    env = environment()
    runs = uvloop.run(main(args))
    summary = summarise(runs)
    text = render(summary, args, env)
    print(text)
    if not args.no_save:
        paths = save(
            "batches", {**env, "arguments": vars(args), "summary": summary, "runs": runs}, text
        )
        print(f"\nsaved {paths[0]} and {paths[1]}")


if __name__ == "__main__":
    run()
