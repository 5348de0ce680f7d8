"""Benchmark: Redis memory per job, by state and payload size.

For each payload size (``--payloads``, bytes of JSON) and state — waiting (queued), running
(claimed), finished (succeeded, kept for ``JOBTIER_RETENTION_SECONDS``) and dead (failed
for good, kept for ``JOBTIER_DEAD_RETENTION_SECONDS``) — it puts ``--jobs`` jobs in that
state through the scripts on a scratch Redis and reads:

* ``MEMORY USAGE`` of a job's hash (median of 20 samples, ``SAMPLES 0``: every field);
* ``INFO memory`` ``used_memory`` after less before, per job: the hash plus everything else
  the job holds (its place in a ready list or the active/dead set, its log entries);
* the same once the log stream is trimmed, as it is when the persister keeps up
  (``XTRIM MAXLEN 0``): what a job costs for as long as Redis keeps it.

Each cell runs with Redis's default ``hash-max-listpack-value`` (64: the status document is
longer, so every job hash is a hashtable) and with 1024 (the hash stays a listpack while its
longest field fits), and with the scripts of a git revision (``--before``) and the working
tree's, so a cut's saving is measured in the same run.

    .venv/bin/python bench/memory.py
    .venv/bin/python bench/memory.py --jobs 500 --payloads 0,1000

Results: bench/results/memory.json and bench/results/memory.md.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jobtier.store.calls import complete_call, fail_call

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    environment,
    flush,
    fmt,
    header_markdown,
    local_redis,
    save,
    script_queue,
    set_format,
    table,
)
from redis.asyncio import Redis
from transitions import Revision, git_sources, known_format, submit_for, use_sources

from jobtier.core.model import JobSpec
from jobtier.engine.queue import Queue
from jobtier.store import format as job_format

STATES = ("waiting", "running", "finished", "dead")
LISTPACK = (64, 1024)


def payload_of(size: int) -> Any:
    """A JSON payload of about ``size`` bytes (0: null)."""
    if size == 0:
        return None
    return {"data": "x" * max(0, size - 11)}


async def cell(
    redis: Redis,
    queue: Queue,
    n: int,
    size: int,
    state: str,
    idem: bool,
    sources: Revision | None = None,
) -> dict[str, float]:
    await flush(redis)
    await queue.scripts.load()
    shard = 0
    s = queue.settings
    before = int((await redis.info("memory"))["used_memory"])
    specs = [
        JobSpec(type="noop", payload=payload_of(size), idempotency_key=f"k{i}" if idem else None)
        for i in range(n)
    ]
    items = [queue.produce.prepare(spec, "tenant-1") for spec in specs]
    for i in range(0, n, 100):
        call = submit_for(sources, shard, items[i : i + 100], s.idempotency_ttl_seconds * 1000)
        await queue.scripts.call_many([call])
    if state != "waiting":
        claimed: list[Any] = []
        while len(claimed) < n:
            batch = await queue.scripts.claim(shard, "worker-1", 100, 600_000)
            assert batch.jobs, "nothing to claim"
            claimed.extend(batch.jobs)
        for i in range(0, n, 100):
            part = claimed[i : i + 100]
            if state == "finished":
                call = complete_call(
                    shard, "worker-1", s.retention_seconds,
                    [(j.id, j.lease_version, b"") for j in part],
                )  # fmt: skip
            elif state == "dead":
                error = b'{"type":"ValueError","message":"bad input"}'
                call = fail_call(
                    shard, "worker-1", s.dead_retention_seconds,
                    [(j.id, j.lease_version, error, -1) for j in part],
                )  # fmt: skip
            else:
                continue
            await queue.scripts.call_many([call])
    after = int((await redis.info("memory"))["used_memory"])
    base = queue.keys.base(shard)
    samples = [
        await redis.memory_usage(base + "job:" + items[i].job_id, samples=0) or 0
        for i in range(0, n, max(1, n // 20))
    ]
    await redis.xtrim(queue.keys.log(shard), maxlen=0, approximate=False)
    trimmed = int((await redis.info("memory"))["used_memory"])
    encoding = await redis.object("encoding", base + "job:" + items[0].job_id)
    return {
        "hash_bytes": statistics.median(samples),
        "used_per_job": (after - before) / n,
        "used_per_job_log_trimmed": (trimmed - before) / n,
        "listpack": 1.0 if encoding in (b"listpack", "listpack") else 0.0,
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    before = git_sources(args.before)
    # each variant writes the newest job format its scripts know (a new deployment's)
    formats = {"before": known_format(before), "after": job_format.NEWEST}
    args.formats = formats
    out: dict[str, Any] = {}
    with local_redis(aof=False) as server:
        redis = Redis.from_url(server.url)
        queue = await script_queue(redis, server.url)
        try:
            for value in LISTPACK:
                await redis.config_set("hash-max-listpack-value", value)
                for variant, sources in (("before", before), ("after", None)):
                    use_sources(queue, sources)
                    await set_format(redis, queue.keys, formats[variant])  # flush keeps it
                    for size in args.payloads:
                        for state in STATES:
                            key = f"{value}/{variant}/{size}/{state}"
                            out[key] = await cell(
                                redis, queue, args.jobs, size, state, False, sources
                            )
                    key = f"{value}/{variant}/100/waiting+idem"
                    out[key] = await cell(redis, queue, args.jobs, 100, "waiting", True, sources)
                    print(f"listpack-value {value} {variant}: done", file=sys.stderr, flush=True)
        finally:
            await redis.aclose()
    return out


def render(cells: dict[str, Any], args: argparse.Namespace, env: dict[str, Any]) -> str:
    md = header_markdown("Memory: Redis bytes per job, by state and payload", env)
    md += (
        f"\n{args.jobs:,} jobs per cell, one tenant, one shard, scripts called directly; "
        f"**before** = the scripts at `{args.before}` (job format {args.formats['before']}), "
        f"**after** = the working tree's (format {args.formats['after']}), each in the newest "
        "job format its scripts know, same run. *hash*: MEMORY USAGE of the job's hash (median of 20). *per job*: INFO "
        "used_memory delta / jobs (the hash, its place in a list or set, its log entries). "
        "*log trimmed*: the same once the log stream is emptied, as the persister keeps it "
        "when it keeps up: what a job costs for as long as Redis keeps it.\n\n"
    )
    for value in LISTPACK:
        md += f"## hash-max-listpack-value {value}"
        md += " (Redis's default)\n\n" if value == 64 else "\n\n"
        rows = []
        for size in args.payloads:
            for state in (*STATES, "waiting+idem") if size == 100 else STATES:
                b = cells[f"{value}/before/{size}/{state}"]
                a = cells[f"{value}/after/{size}/{state}"]
                rows.append([
                    f"{size:,} B", state.replace("+idem", ", idempotency key"),
                    fmt(b["hash_bytes"]), fmt(b["used_per_job"]),
                    fmt(b["used_per_job_log_trimmed"]),
                    fmt(a["hash_bytes"]), fmt(a["used_per_job"]),
                    fmt(a["used_per_job_log_trimmed"]),
                    "listpack" if a["listpack"] else "hashtable",
                ])  # fmt: skip
        md += table(
            ["payload", "state", "before: hash", "per job", "log trimmed", "after: hash",
             "per job", "log trimmed", "after: encoding"],
            rows,
        ) + "\n\n"  # fmt: skip
    return md


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=2000, help="jobs per cell (2000)")
    p.add_argument("--payloads", default="0,100,1000,10000", help="payload sizes, bytes")
    p.add_argument("--before", default="HEAD", help="git revision of the baseline (HEAD)")
    p.add_argument("--no-save", action="store_true", help="print only; keep results files")
    args = p.parse_args(argv)
    args.payloads = [int(x) for x in args.payloads.split(",") if x]
    return args


def run(argv: list[str] | None = None, report: Callable[[str], None] = print) -> None:
    args = parse(argv)
    env = environment()
    cells = asyncio.run(main(args))
    md = render(cells, args, env)
    report(md)
    if not args.no_save:
        save("memory", {"environment": env, "args": vars(args), "cells": cells}, md)


if __name__ == "__main__":
    run()
