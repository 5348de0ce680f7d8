"""Benchmark: what the jobs_by_state triggers cost Postgres, against the same rows written by
the persister's own statements.

A direction issue 29 named ("listing tables kept by the persister in bulk instead of by row
triggers"), measured before it is built. Starts its own Redis and a durable Postgres (fsync
on) in temporary folders, makes a backlog of ``--transitions`` in the shard logs (chunks of
4,000 jobs: submits, then their claims, then completions, as bench/persist.py makes it), and
writes it batch by batch (``--batch`` transitions, in log order) two ways, alternated
(A B B A …) ``--reps`` times each on emptied tables:

- ``triggers``: ``write_batch`` as the persister runs it; the statement-level triggers on
  ``jobs`` keep ``jobs_by_state`` (migrations/0001_initial.sql);
- ``statements``: those triggers disabled; new jobs' listing rows COPYed straight into
  ``jobs_by_state``, and the merged rows' upsert made one statement whose ``RETURNING``
  feeds the listing rows' delete and upsert (no transition tables, no PL/pgSQL).

The last batch is left out, so that some jobs stay queued or running and the listing rows the
two leave behind can be compared: they must be the same.

CPU: the Postgres backend's own (/proc), per transition written; medians over the reps.

    .venv/bin/python bench/by_state_statements.py
    .venv/bin/python bench/by_state_statements.py --transitions 96000 --reps 4

Results: bench/results/by_state_statements.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, header_markdown, proc_cpu, save, table
from persist import Entries, prefill
from redis.asyncio import Redis

from jobtier.core.keys import Keys
from jobtier.dev.local_postgres import LocalPostgres
from jobtier.dev.local_redis import LocalRedis
from jobtier.persist import batch as pb
from jobtier.persist.db import AnyConnection, create_pool, migrate, query
from jobtier.streams.entries import LogEntry, parse_entries

SHARDS = 16
TRIGGERS = ("jobs_by_state_inserted", "jobs_by_state_updated")
BY_STATE = ("id", "tenant", "state", "type", "queue", "created_at")
# upsert_jobs, its changed rows returned to the listing rows' delete and upsert (the
# triggers' own statements, fed by RETURNING rather than a transition table)
MERGE = (
    "WITH changed AS (\n"
    + query("upsert_jobs")
    + """
    RETURNING j.id, j.tenant, j.state, j.type, j.queue, j.created_at
), gone AS (
    DELETE FROM jobs_by_state b USING changed c WHERE b.id = c.id AND c.state = 'succeeded'
)
INSERT INTO jobs_by_state AS b (id, tenant, state, type, queue, created_at)
SELECT id, tenant, state, type, queue, created_at FROM changed WHERE state <> 'succeeded'
ORDER BY id
ON CONFLICT (id) DO UPDATE
SET tenant = excluded.tenant, state = excluded.state, type = excluded.type,
    queue = excluded.queue, created_at = excluded.created_at
"""
)


async def by_statements(conn: AnyConnection, entries: list[LogEntry]) -> None:
    """``write_batch``'s work with the listing rows written by these statements."""
    rows = pb.collapse(entries)
    async with conn.transaction():
        merged, created = pb.split_created(rows)
        if merged:
            await conn.execute(query("create_staging"))
            await conn.copy_records_to_table(
                "jobs_staging", records=pb.job_records(merged), columns=pb.JOB_COLUMNS
            )
            await conn.execute(MERGE)
        if created:
            records = pb.job_records(created)
            await conn.copy_records_to_table("jobs", records=records, columns=pb.JOB_COLUMNS)
            at = {c: pb.JOB_COLUMNS.index(c) for c in BY_STATE}
            listed = [tuple(r[at[c]] for c in BY_STATE) for r in records]
            listed = [r for r in listed if r[2] != "succeeded"]
            if listed:
                await conn.copy_records_to_table("jobs_by_state", records=listed, columns=BY_STATE)
        history = pb.transition_records(sorted(entries, key=pb._key))
        await conn.copy_records_to_table(
            "job_transitions", records=history, columns=pb.TRANSITION_COLUMNS
        )


async def backlog(redis_url: str, transitions: int) -> list[LogEntry]:
    await prefill(redis_url, transitions)
    redis = Redis.from_url(redis_url)
    keys = Keys("jt", SHARDS)
    entries: list[LogEntry] = []
    try:
        for shard in range(SHARDS):
            for entry_id, fields in cast(Entries, await redis.xrange(keys.log(shard))):
                entries += parse_entries(shard, entry_id, fields)
    finally:
        await redis.aclose()
    entries.sort(key=lambda e: (e.ms, e.entry_id))
    return entries


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    env = environment()
    folder = Path(tempfile.mkdtemp(prefix="jobtier-bench-"))
    pg = LocalPostgres(Path(tempfile.mkdtemp(prefix="jobtier-bench-pg-")), durable=True)
    redis = LocalRedis(folder / "redis").start()
    try:
        pg.start()
        await migrate(pg.dsn)
        entries = await backlog(redis.url, args.transitions)
        batches = [entries[i : i + args.batch] for i in range(0, len(entries), args.batch)][:-1]
        written = sum(map(len, batches))
        pool = await create_pool(pg.dsn, max_size=1)
        cpu: dict[str, list[float]] = {"triggers": [], "statements": []}
        left: dict[str, set[tuple[Any, ...]]] = {}
        async with pool.acquire() as conn:
            pid = await conn.fetchval("SELECT pg_backend_pid()")
            for rep in range(args.reps):
                for variant in ("triggers", "statements")[:: 1 if rep % 2 == 0 else -1]:
                    await conn.execute("TRUNCATE jobs, jobs_by_state, job_transitions CASCADE")
                    on = "DISABLE" if variant == "statements" else "ENABLE"
                    for trigger in TRIGGERS:
                        await conn.execute(f"ALTER TABLE jobs {on} TRIGGER {trigger}")
                    await conn.execute("VACUUM ANALYZE jobs, jobs_by_state")
                    before = proc_cpu(pid)
                    for chunk in batches:
                        if variant == "triggers":
                            await pb.write_batch(conn, chunk)
                        else:
                            await by_statements(conn, chunk)
                    cpu[variant].append((proc_cpu(pid) - before) / written * 1e6)
                    rows = await conn.fetch(f"SELECT {', '.join(BY_STATE)} FROM jobs_by_state")
                    left[variant] = {tuple(r) for r in rows}
                    print(f"rep {rep + 1} {variant}: {cpu[variant][-1]:.1f} us a transition")
            for trigger in TRIGGERS:
                await conn.execute(f"ALTER TABLE jobs ENABLE TRIGGER {trigger}")
        await pool.close()
    finally:
        redis.stop()
        pg.stop()
    if left["triggers"] != left["statements"]:
        raise SystemExit("the two ways left different jobs_by_state rows: not comparable")
    return {
        "env": env,
        "transitions": written,
        "batch": args.batch,
        "reps": args.reps,
        "listed_after": len(left["triggers"]),
        "cpu_us": cpu,
        "median_us": {v: round(statistics.median(xs), 2) for v, xs in cpu.items()},
    }


def report(r: dict[str, Any]) -> str:
    out = [header_markdown("jobs_by_state: triggers against the persister's statements", r["env"])]
    out.append(
        f"{r['transitions']:,} transitions written in batches of {r['batch']:,} (log order: "
        "chunks of 4,000 jobs' submits, claims, completions; the last batch left out), "
        f"each way {r['reps']} times, alternated, on emptied tables; a durable Postgres. CPU: "
        "the Postgres backend's own, per transition written; the two left the same "
        f"{r['listed_after']:,} rows in jobs_by_state.\n"
    )
    base = r["median_us"]["triggers"]
    rows = [
        [
            v,
            f"{r['median_us'][v]:.1f}",
            ", ".join(f"{x:.1f}" for x in xs),
            f"{r['median_us'][v] / base:.2f}",
        ]
        for v, xs in r["cpu_us"].items()
    ]
    out.append(table(["way", "Postgres µs a transition (median)", "each rep", "÷ triggers"], rows))
    return "\n".join(out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transitions", type=int, default=48_000, help="backlog size")
    p.add_argument("--batch", type=int, default=8_000, help="transitions a batch")
    p.add_argument("--reps", type=int, default=6, help="writes of the backlog, each way")
    args = p.parse_args()
    result = asyncio.run(bench(args))
    text = report(result)
    print(text)
    paths = save("by_state_statements", result, text)
    print(f"saved {paths[0]} and {paths[1]}")


if __name__ == "__main__":
    main()
