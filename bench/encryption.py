"""Encryption at rest (docs/encryption.md): what it costs per job, against the feature off
in the same run.

One process, one local Redis (AOF on, as production requires). Each round runs, for every
payload size, a batch of jobs of a plain task and a batch of the same task with
``encrypt=True`` (their order alternating from round to round): submitted in batches
through the Producer, then drained by a burst worker, Redis emptied between batches. An
echo task, so the result is as large as the payload and both are sealed.

    .venv/bin/python bench/encryption.py                 # about a minute and a half
    .venv/bin/python bench/encryption.py --rounds 9 --jobs 4000

Figures per job, medians over the rounds: this process's CPU µs to submit (validate, seal,
send) and to run (claim, open, task, seal, report), Redis's CPU µs, the wall-clock µs of
submit + drain, and the bytes Redis keeps of the payload and result; the ratio is the
median of each round's encrypted / plain. Then the seal and open calls alone (µs per call).
Results go to bench/results/encryption.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import statistics
import sys
import time
import timeit
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    environment,
    flush,
    header_markdown,
    local_redis,
    redis_cpu,
    save,
    table,
)

from jobtier.config import Settings
from jobtier.core.model import JobSpec
from jobtier.core.sealing import Keyring
from jobtier.engine.queue import Queue
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import TaskRegistry, task
from jobtier.worker.runner import Worker

SIZES = {"100 B": 100, "4 KiB": 4096}
CHUNK = 500  # jobs per submit_many
KEY = "k1:" + base64.b64encode(os.urandom(32)).decode()


async def echo(ctx: JobContext, payload: Any) -> Any:
    return payload


ARMS = {"plain": task(name="plain")(echo), "encrypted": task(name="sealed", encrypt=True)(echo)}
REGISTRY = TaskRegistry(ARMS.values())


def payload_of(size: int) -> dict[str, str]:
    return {"text": "x" * (size - len('{"text":""}'))}


async def one_batch(queue: Queue, kind: str, payload: Any, jobs: int) -> dict[str, float]:
    """Submit ``jobs`` jobs of ``kind`` and drain them; the figures per job."""
    redis = queue.redis
    await flush(redis)
    specs = [JobSpec(type=kind, payload=payload) for _ in range(jobs)]
    redis0, wall0, cpu0 = await redis_cpu(redis), time.perf_counter(), time.process_time()
    ids: list[str] = []
    for i in range(0, jobs, CHUNK):
        ids += [s.job_id for s in await queue.submit_many(specs[i : i + CHUNK])]
    cpu1 = time.process_time()
    stats = await Worker(queue.store, REGISTRY, burst=True, concurrency=50).run()
    cpu2, wall2 = time.process_time(), time.perf_counter()
    redis2 = await redis_cpu(redis)
    assert stats.succeeded == jobs, stats
    pipe = redis.pipeline(transaction=False)
    for job_id in ids[:50]:
        pipe.hstrlen(queue.keys.job(job_id), "payload")
        pipe.hstrlen(queue.keys.job(job_id), "result")
    lengths = await pipe.execute()
    return {
        "submit_cpu_us": 1e6 * (cpu1 - cpu0) / jobs,
        "worker_cpu_us": 1e6 * (cpu2 - cpu1) / jobs,
        "redis_cpu_us": 1e6 * (redis2 - redis0) / jobs,
        "wall_us": 1e6 * (wall2 - wall0) / jobs,
        "stored_bytes": sum(lengths) / (len(lengths) / 2),
    }


def micro(size: int) -> dict[str, float]:
    """µs per seal and per open of one value of ``size`` bytes (the best of 5 repeats)."""
    keyring = Keyring.from_text(KEY)
    assert keyring is not None
    plain = os.urandom(size)
    sealed = keyring.seal("job-1", "payload", plain)
    n = 2000
    seal = min(timeit.repeat(lambda: keyring.seal("job-1", "payload", plain), number=n, repeat=5))
    opened = min(
        timeit.repeat(lambda: keyring.open("job-1", "payload", sealed), number=n, repeat=5)
    )
    return {"seal_us": 1e6 * seal / n, "open_us": 1e6 * opened / n}


async def measure(url: str, rounds: int, jobs: int) -> dict[str, Any]:
    settings = Settings(redis_url=url, shards=16, encryption_keys=KEY, gc_freeze=False)
    queue = await Queue.connect(settings, REGISTRY)
    runs: dict[str, dict[str, list[dict[str, float]]]] = {
        size: {arm: [] for arm in ARMS} for size in SIZES
    }
    try:
        for n in SIZES.values():  # warm-up
            for t in ARMS.values():
                await one_batch(queue, t.name, payload_of(n), min(jobs, 500))
        for r in range(rounds):
            for size, n in SIZES.items():
                order = list(ARMS.items())
                if r % 2:
                    order.reverse()
                for arm, t in order:
                    runs[size][arm].append(await one_batch(queue, t.name, payload_of(n), jobs))
            print(f"round {r + 1}/{rounds}", file=sys.stderr)
    finally:
        await queue.close()
    return runs


METRICS = {
    "submit_cpu_us": ("submit CPU µs", 1),
    "worker_cpu_us": ("worker CPU µs", 1),
    "redis_cpu_us": ("Redis CPU µs", 1),
    "wall_us": ("wall µs (submit + drain)", 1),
    "stored_bytes": ("bytes kept (payload + result)", 0),
}


def summarise(runs: dict[str, dict[str, list[dict[str, float]]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for size, arms in runs.items():
        out[size] = {}
        for metric in METRICS:
            plain = [run[metric] for run in arms["plain"]]
            sealed = [run[metric] for run in arms["encrypted"]]
            ratios = [s / p for p, s in zip(plain, sealed, strict=True) if p]
            out[size][metric] = {
                "plain": statistics.median(plain),
                "encrypted": statistics.median(sealed),
                "ratio": statistics.median(ratios) if ratios else float("nan"),
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--jobs", type=int, default=2000, help="jobs per batch")
    args = parser.parse_args()
    env = environment()
    with local_redis() as server:
        try:
            import uvloop

            runs = uvloop.run(measure(server.url, args.rounds, args.jobs))
            loop = "uvloop"
        except ImportError:
            runs = asyncio.run(measure(server.url, args.rounds, args.jobs))
            loop = "asyncio"
    summary = summarise(runs)
    rows = []
    for size in SIZES:
        for metric, (label, digits) in METRICS.items():
            m = summary[size][metric]
            rows.append(
                [size, label, f"{m['plain']:,.{digits}f}", f"{m['encrypted']:,.{digits}f}",
                 f"{m['ratio']:.2f}x"]
            )  # fmt: skip
    text = table(["payload", "per job", "plain", "encrypted", "ratio"], rows)
    calls = {size: micro(n) for size, n in SIZES.items()}
    micro_rows = [[size, f"{c['seal_us']:.2f}", f"{c['open_us']:.2f}"] for size, c in calls.items()]
    micro_text = table(["value", "seal µs", "open µs"], micro_rows)
    print(text + "\n\n" + micro_text)
    markdown = (
        header_markdown("Encryption at rest: cost per job, against the feature off", env)
        + f"\n{args.jobs:,} jobs per batch (submitted {CHUNK} at a time, drained by a burst "
        f"worker of concurrency 50), an echo task (result as large as the payload); "
        f"{args.rounds} rounds, plain and encrypted alternating; medians, the ratio the "
        f"median of each round's encrypted / plain; {loop}.\n\n"
        + text
        + "\n\nThe AES-GCM calls alone (the best of 5 repeats of 2,000 calls):\n\n"
        + micro_text
    )
    save(
        "encryption",
        {"environment": env, "args": vars(args), "loop": loop, "summary": summary,
         "calls": calls, "runs": runs},
        markdown,
    )  # fmt: skip


if __name__ == "__main__":
    main()
