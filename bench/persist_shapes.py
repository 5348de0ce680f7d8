"""Benchmark: what the write-behind would cost in other shapes, beside today's, same run.

The write-behind writes each transition's history row, and each job's row in ``jobs`` (with
its line in ``jobs_by_state``) whenever a batch holds a newer version of the job: at its
submit, at its claim when that reaches Postgres in a batch before the job's end, and at its
end. This bench measures, on one backlog written batch by batch in the bench's process, how
much of that cost two other shapes would leave out:

* ``today``: ``batch.write_batch`` as the persister calls it;
* ``claims collapsed``: the same, but a job's row is written only at its submit and at its
  end (its claim, or any version between, left out: what holding a live job's row until a
  newer version supersedes it would save);
* ``row once, at the end``: only the row of a job that ended, COPYed in once, and no
  ``jobs_by_state`` (its triggers disabled): what the write-behind would cost if live jobs
  were listed from elsewhere and ``jobs`` held finished jobs only;
* ``by state, by the writer``: today's rows, but ``jobs_by_state`` kept by the writer's own
  statements instead of its triggers (disabled): the live new jobs' lines COPYed in, the
  merged rows' moves made in the statement that merges them (a data-modifying WITH). What
  keeping the listing table in bulk would save over the triggers, which are per statement
  already;
* ``no jobs_by_state``: today's rows with the triggers disabled and nothing in their place:
  the floor the two before it are measured against (its listings by state would be wrong).

Every shape writes every history row. The backlog is bench/persist.py's (chunks of 4,000
jobs: submits, then claims, then completions), so every claim has a batch of its own: the
case where collapsing claims saves most. CPU: Postgres's (every server process, /proc) and
the bench process's own for the writes (building the records, the client's side of COPY
and of the statements; reading and decoding the log are the same in every shape and left
out), per transition; WAL bytes per transition from ``pg_current_wal_lsn``. The shapes are
alternated (A B C C B A …) and each figure is the median of its samples.

    .venv/bin/python bench/persist_shapes.py --runs 3

Results go to bench/results/persist_shapes.json and .md (``--name`` to change).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, fmt, header_markdown, save, table
from persist import Run, backlog

from jobtier.core.model import TERMINAL
from jobtier.dev.local_postgres import LocalPostgres
from jobtier.dev.local_redis import LocalRedis
from jobtier.persist.batch import (
    JOB_COLUMNS,
    TRANSITION_COLUMNS,
    collapse,
    copy_new,
    job_records,
    split_created,
    transition_records,
    write_batch,
)
from jobtier.persist.db import AnyConnection, create_pool, migrate, query
from jobtier.streams.entries import LogEntry

BY_STATE_TRIGGERS = ("jobs_by_state_inserted", "jobs_by_state_updated")
TODAY, COLLAPSED, ONCE = "today", "claims collapsed", "row once, at the end"
BY_WRITER, NO_BY_STATE = "by state, by the writer", "no jobs_by_state"
WITHOUT_TRIGGERS = {ONCE, BY_WRITER, NO_BY_STATE}

Writer = Callable[[AnyConnection, Sequence[LogEntry]], Awaitable[int]]


async def today(conn: AnyConnection, entries: Sequence[LogEntry]) -> int:
    return await write_batch(conn, entries)


async def claims_collapsed(conn: AnyConnection, entries: Sequence[LogEntry]) -> int:
    """A job's row at its submit (the batch creates it) and at its end only."""
    rows = [r for r in collapse(entries) if r.created or r.latest.status.state in TERMINAL]
    return await write_batch(conn, entries, rows)


async def once_at_the_end(conn: AnyConnection, entries: Sequence[LogEntry]) -> int:
    """Only ended jobs' rows, each COPYed in once (as new: ``created``)."""
    rows = [
        msgspec.structs.replace(r, created=True)
        for r in collapse(entries)
        if r.latest.status.state in TERMINAL
    ]
    return await write_batch(conn, entries, rows)


# upsert_jobs, then what the update trigger does, from the rows it wrote (RETURNING)
UPSERT_AND_LIST = (
    "WITH up AS (\n"
    + query("upsert_jobs").strip()
    + """
    RETURNING j.id, j.tenant, j.state, j.type, j.queue, j.created_at
), gone AS (
    DELETE FROM jobs_by_state
    WHERE id = ANY (ARRAY(SELECT id FROM up WHERE state = 'succeeded'))
)
INSERT INTO jobs_by_state AS b (id, tenant, state, type, queue, created_at)
SELECT id, tenant, state, type, queue, created_at FROM up WHERE state <> 'succeeded'
ORDER BY id
ON CONFLICT (id) DO UPDATE
SET tenant = excluded.tenant, state = excluded.state, type = excluded.type,
    queue = excluded.queue, created_at = excluded.created_at
WHERE (b.tenant, b.state, b.type, b.queue, b.created_at)
      IS DISTINCT FROM (excluded.tenant, excluded.state, excluded.type, excluded.queue,
                        excluded.created_at)"""
)
LISTED = ("id", "tenant", "state", "type", "queue", "created_at")
# jobs_by_state's lines that are not what the triggers would have made of `jobs`, and the
# lines missing: 0 when the table is kept right
LISTING_MISMATCHES = """
SELECT count(*) FROM (
    (SELECT id, tenant, state, type, queue, created_at FROM jobs WHERE state <> 'succeeded'
     EXCEPT SELECT id, tenant, state, type, queue, created_at FROM jobs_by_state)
    UNION ALL
    (SELECT id, tenant, state, type, queue, created_at FROM jobs_by_state
     EXCEPT SELECT id, tenant, state, type, queue, created_at FROM jobs WHERE state <> 'succeeded')
) AS wrong
"""


async def by_the_writer(conn: AnyConnection, entries: Sequence[LogEntry]) -> int:
    """Today's rows and history; ``jobs_by_state`` kept by these statements, not triggers."""
    rows = collapse(entries)
    async with conn.transaction():
        merged, created = split_created(rows)
        if merged:
            await conn.execute(query("create_staging"))
            await conn.copy_records_to_table(
                "jobs_staging", records=job_records(merged), columns=JOB_COLUMNS
            )
            await conn.execute(UPSERT_AND_LIST)
        if created:
            records = job_records(created)
            if not await copy_new(conn, "jobs", records, JOB_COLUMNS):
                raise RuntimeError("a new job's row was there already")
            # JOB_COLUMNS: id 0, tenant 1, type 2, state 4, created_at 8, queue 20
            live = [(r[0], r[1], r[4], r[2], r[20], r[8]) for r in records if r[4] != "succeeded"]
            if live:
                await conn.copy_records_to_table("jobs_by_state", records=live, columns=LISTED)
        history = transition_records(sorted(entries, key=lambda e: (e.status.id, e.status.version)))
        if not await copy_new(conn, "job_transitions", history, TRANSITION_COLUMNS):
            raise RuntimeError("a history row was there already")
    return len(rows)


SHAPES: dict[str, Writer] = {
    TODAY: today,
    COLLAPSED: claims_collapsed,
    ONCE: once_at_the_end,
    BY_WRITER: by_the_writer,
    NO_BY_STATE: today,
}


async def sample(run: Run, shape: str, transitions: int, batch: int) -> dict[str, Any]:
    """One shape writing one backlog, batch by batch, on one connection."""
    triggers = "DISABLE" if shape in WITHOUT_TRIGGERS else "ENABLE"
    for trigger in BY_STATE_TRIGGERS:
        await run.pool.execute(f"ALTER TABLE jobs {triggers} TRIGGER {trigger}")
    entries = await backlog(run, transitions)
    writer = SHAPES[shape]
    rows = 0
    lsn = await run.pool.fetchval("SELECT pg_current_wal_lsn()::text")
    halfway = (len(entries) // batch // 2) * batch
    mismatched = listed = None
    pg_cpu, cpu, began = run.pg_cpu(), time.process_time(), time.perf_counter()
    async with run.pool.acquire() as conn:
        for i in range(0, len(entries), batch):
            rows += await writer(conn, entries[i : i + batch])
            if i == halfway and shape not in (ONCE, NO_BY_STATE):
                # half-way, with jobs live: the listing table as the triggers keep it? (the
                # check's own CPU and time left out of the figures)
                paused = run.pg_cpu(), time.process_time(), time.perf_counter()
                mismatched = await conn.fetchval(LISTING_MISMATCHES)
                listed = await conn.fetchval("SELECT count(*) FROM jobs_by_state")
                pg_cpu += run.pg_cpu() - paused[0]
                cpu += time.process_time() - paused[1]
                began += time.perf_counter() - paused[2]
    wall, cpu, pg_cpu = (
        time.perf_counter() - began,
        time.process_time() - cpu,
        run.pg_cpu() - pg_cpu,
    )
    if mismatched:
        raise RuntimeError(f"{shape}: {mismatched} lines of jobs_by_state wrong half-way")
    wal = await run.pool.fetchval("SELECT pg_current_wal_lsn() - $1::text::pg_lsn", lsn)
    n = len(entries)
    history = await run.pool.fetchval("SELECT count(*) FROM job_transitions")
    if history != n:
        raise RuntimeError(f"{shape}: {history} history rows for {n} transitions")
    jobs = n // 3
    return {
        "transitions": n,
        "postgres_cpu_us": pg_cpu / n * 1e6,
        "client_cpu_us": cpu / n * 1e6,
        "wall_us": wall / n * 1e6,
        "wal_bytes": float(wal) / n,
        "job_rows_a_job": rows / jobs,
        "listed_halfway": listed,
        "listing_mismatches_halfway": mismatched,
        "jobs_in_postgres": await run.pool.fetchval("SELECT count(*) FROM jobs"),
    }


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    env = environment()
    pg = LocalPostgres(Path(tempfile.mkdtemp(prefix="jobtier-bench-pg-")), durable=True)
    redis = LocalRedis(Path(tempfile.mkdtemp(prefix="jobtier-bench-")) / "redis").start()
    samples: dict[str, list[dict[str, Any]]] = {shape: [] for shape in SHAPES}
    try:
        pg.start()
        await migrate(pg.dsn)
        pool = await create_pool(pg.dsn, max_size=2)
        run = Run(redis, pg, pool, "batched")
        try:
            order = list(SHAPES)
            for i in range(args.runs):
                for shape in order if i % 2 == 0 else order[::-1]:
                    got = await sample(run, shape, args.backlog, args.batch)
                    samples[shape].append(got)
                    print(f"run {i + 1} {shape}: {got}", flush=True)
            for trigger in BY_STATE_TRIGGERS:
                await pool.execute(f"ALTER TABLE jobs ENABLE TRIGGER {trigger}")
        finally:
            await run.redis.aclose()
            await pool.close()
    finally:
        pg.stop()
        redis.stop()
    medians = {
        shape: {
            k: None if got[0][k] is None else statistics.median(s[k] for s in got) for k in got[0]
        }
        for shape, got in samples.items()
    }
    return {"environment": env, "arguments": vars(args), "samples": samples, "medians": medians}


HEADERS = (
    "shape", "job rows written a job", "Postgres CPU µs", "client CPU µs", "total µs",
    "vs today", "WAL bytes", "wall µs", "jobs_by_state half-way: lines (wrong)",
)  # fmt: skip


def report(result: dict[str, Any]) -> str:
    args, med = result["arguments"], result["medians"]
    base = med[TODAY]
    base_total = base["postgres_cpu_us"] + base["client_cpu_us"]
    rows = []
    for shape, m in med.items():
        total = m["postgres_cpu_us"] + m["client_cpu_us"]
        rows.append([
            shape, fmt(m["job_rows_a_job"], 2), fmt(m["postgres_cpu_us"], 1),
            fmt(m["client_cpu_us"], 1), fmt(total, 1), f"{total / base_total:.2f}",
            fmt(m["wal_bytes"]), fmt(m["wall_us"], 1),
            "—" if m.get("listed_halfway") is None
            else f"{m['listed_halfway']:,.0f} ({m['listing_mismatches_halfway']:.0f})",
        ])  # fmt: skip
    head = header_markdown(
        "Write-behind shapes: what each would cost, same run", result["environment"]
    )
    return (
        head + f"\nA backlog of {args['backlog']:,} transitions ({args['backlog'] // 3:,} jobs: "
        "submitted, claimed and completed in chunks of 4,000, so each claim reaches Postgres in "
        f"a batch before its job's end), written in batches of {args['batch']:,} on one "
        f"connection to a durable Postgres (fsync on); {args['runs']} sample(s) of each shape, "
        "alternated; medians. CPU per transition: Postgres's (every server process) and the "
        "bench process's for the writes only (records, the client's side of COPY and of the "
        "statements; reading and decoding the log, the same in every shape, left out). "
        "Every shape writes every transition's history row. Half-way through, where the "
        "shape keeps `jobs_by_state`, its lines are counted and compared with what its triggers "
        "make of `jobs` (lines wrong or missing in brackets; that check's CPU left out).\n\n"
        + table(HEADERS, rows)
        + "\n\n- `today`: `write_batch` as the persister calls it: a job's row at its submit, at "
        "its claim (here in a batch of its own) and at its end, `jobs_by_state` kept by its "
        "triggers.\n"
        "- `claims collapsed`: a job's row at its submit and at its end only: what holding a "
        "live job's newest version until a newer one supersedes it would write.\n"
        "- `row once, at the end`: only ended jobs' rows, COPYed in once, `jobs_by_state`'s "
        "triggers disabled: what the write-behind would cost were live jobs listed from "
        "elsewhere (not a set-up jobtier offers: its listings would miss every live job).\n"
        "- `by state, by the writer`: today's rows, `jobs_by_state` kept by the writer's "
        "statements instead of its triggers (disabled): the live new jobs' lines COPYed in, "
        "the merged rows' moves made by the statement that merges them (a data-modifying "
        "`WITH` over `upsert_jobs`' `RETURNING`). The listing kept in bulk rather than by "
        "triggers, which are per statement already.\n"
        "- `no jobs_by_state`: today's rows, the triggers disabled and nothing in their place: "
        "the floor for the shape above (its listings by state would be wrong).\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="samples of each shape")
    parser.add_argument("--backlog", type=int, default=90_000, help="transitions a sample")
    parser.add_argument("--batch", type=int, default=2000, help="transitions a batch")
    parser.add_argument("--name", default="persist_shapes", help="results file name")
    args = parser.parse_args()
    result = asyncio.run(bench(args))
    md = report(result)
    save(args.name, result, md)
    print(md)


if __name__ == "__main__":
    main()
