"""Benchmark: the console with a million jobs in Postgres.

Starts its own Redis (AOF on) and a durable Postgres in temporary folders. The schema comes
in steps from the migration files of git revision ``--before`` (default ``4ffac07``, the last
with the migrations that were since squashed into one): 0001-0008 first, the schema before
listings by state moved to ``jobs_by_state``; it fills ``jobs`` with ``--jobs`` rows by COPY
(tenants, types, queues and states skewed as a busy deployment's are, created over 30 days),
then:

1. the listing's queries per filter (``PgReader.admin_list_jobs``, what ``GET /v1/admin/jobs``
   runs): time per page, p50 and p99 of ``--reps`` runs, on that schema (the baseline, same
   run: a state filter on ``jobs`` itself, through its state indexes) and after migration
   0009 (today's schema), with the plan of each (``EXPLAIN ANALYZE``: the indexes it uses,
   or a sequential scan);
2. what 0009 changes for the write-behind: the migration's time on the filled table, and
   the drain rate and Postgres CPU per transition before and after (no index entry for an
   update that stays on its page, a row in ``jobs_by_state`` while a job is not succeeded);
3. the page over HTTP (``jobtier api``, granian): its size, the time to its first frame
   (a frame is built once a second per API process, whatever the number of pages), the
   first page of jobs and one job's detail;
4. the listing endpoint's latency under the locust poller mix (``loadtest/locustfile.py``'s
   pollers and submitters, plus ``bench/console_locust.py``'s operators paging through
   filters), against the same endpoint with no other load (baseline, same run).

    .venv/bin/python bench/console.py                      # 1M jobs, ~10 min
    .venv/bin/python bench/console.py --jobs 100000 --locust-seconds 20   # a quick look

Results: bench/results/console.json and bench/results/console.md (``--name`` another name).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
from redis.asyncio import Redis

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import (  # noqa: E402
    environment,
    flush,
    header_markdown,
    percentile,
    save,
    set_format,
    table,
)
from common_http import ApiProcess  # noqa: E402
from persist import prefill  # noqa: E402

from jobtier.config import Settings  # noqa: E402
from jobtier.core.keys import Keys, ulid  # noqa: E402
from jobtier.dev.local_postgres import LocalPostgres  # noqa: E402
from jobtier.dev.local_redis import LocalRedis, free_port  # noqa: E402
from jobtier.persist.batch import JOB_COLUMNS  # noqa: E402
from jobtier.persist.db import Pool, connect, create_pool, migrate, query  # noqa: E402
from jobtier.persist.listing_stats import UNINDEXED  # noqa: E402
from jobtier.persist.persister import Persister  # noqa: E402
from jobtier.persist.pg_reader import PgReader, encode_cursor, listing_sql  # noqa: E402
from jobtier.persist.retention import ensure_partitions  # noqa: E402
from jobtier.store import format as job_format  # noqa: E402

SHARDS = 16
# the migration measured, of --before's: listings by state from jobs_by_state, no index of
# jobs over state (today's schema, 0001_initial, is what it left)
BEFORE, AFTER = 8, 9
MIGRATIONS = "src/jobtier/persist/migrations"
BY_STATE_SIZE = "SELECT pg_total_relation_size('jobs_by_state')"
TENANTS = 200
TYPES = 30
QUEUES = ("default", "emails", "reports", "images", "billing", "webhooks", "exports", "search")
DAYS = 30
ADMIN_KEY = "bench-admin"
TENANT_KEY = "bench-tenant"
STATES = (  # (state, share): most jobs are done
    ("succeeded", 0.96), ("failed", 0.02), ("cancelled", 0.01), ("queued", 0.006),
    ("scheduled", 0.003), ("running", 0.001),
)  # fmt: skip


# --- the million jobs -----------------------------------------------------------------------
def zipf_weights(n: int, s: float = 1.1) -> list[float]:
    return [1 / (k**s) for k in range(1, n + 1)]


def iso(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%S.") + f"{at.microsecond // 1000:03d}Z"


def job_records(n: int, seed: int, now: datetime) -> Any:
    """``jobs`` rows in JOB_COLUMNS order, ``chunk`` at a time: the documents are rendered as
    lib.lua renders them (the listing serves them as stored)."""
    rng = random.Random(seed)
    tenants = [f"tenant-{i:03d}" for i in range(TENANTS)]
    types = [f"task_{i:02d}" for i in range(TYPES)]
    tenant_w, type_w = zipf_weights(TENANTS), zipf_weights(TYPES)
    states, state_w = zip(*STATES, strict=True)
    chunk: list[tuple[Any, ...]] = []
    for i in range(n):
        state = rng.choices(states, state_w)[0]
        if state in ("queued", "running"):  # waiting and running jobs are recent
            created = now - timedelta(seconds=rng.uniform(0, 600))
        elif state == "scheduled":
            created = now - timedelta(seconds=rng.uniform(0, 86_400))
        else:
            created = now - timedelta(seconds=rng.uniform(0, DAYS * 86_400))
        created = created.replace(microsecond=created.microsecond // 1000 * 1000)
        ms = int(created.timestamp() * 1000)
        job_id = f"{ulid(ms, rng.randbytes(10))}-{i % SHARDS}"
        tenant = rng.choices(tenants, tenant_w)[0]
        kind = types[-1] if rng.random() < 0.0001 else rng.choices(types[:-1], type_w[:-1])[0]
        queue = QUEUES[int(kind[-2:]) % len(QUEUES)]
        prio = rng.choices(("critical", "high", "normal", "low"), (1, 3, 12, 4))[0]
        attempt = 0 if state in ("queued", "scheduled") else rng.choice((1, 1, 1, 2, 3))
        updated = created + timedelta(seconds=rng.uniform(0.01, 30)) if attempt else created
        error = None
        if state == "failed" or (attempt > 1):
            error = b'{"type":"TimeoutError","message":"upstream took too long"}'
        run_at = created + timedelta(hours=1) if state == "scheduled" else None
        worker = f"worker-{rng.randrange(40):02d}" if state == "running" else None
        version = {"queued": 1, "scheduled": 1, "running": 2}.get(state, 3 + 2 * (attempt - 1))
        doc = (
            f'{{"id":"{job_id}","type":"{kind}","queue":"{queue}","state":"{state}",'
            f'"version":{version},"priority":"{prio}","attempt":{attempt},"max_attempts":3,'
            f'"created_at":"{iso(created)}","updated_at":"{iso(updated)}",'
            f'"run_at":{json.dumps(iso(run_at)) if run_at else "null"},"progress":null,'
            f'"error":{error.decode() if error else "null"},'
            f'"cancel_requested":{"true" if state == "cancelled" else "false"},'
            f'"worker":{json.dumps(worker)}}}'
        ).encode()
        payload = b'{"order":%d,"sku":"A-%d"}' % (i, rng.randrange(10_000))
        result = b'{"ok":true}' if state == "succeeded" else None
        chunk.append((
            job_id, tenant, kind, prio, state, version, attempt, 3, created, updated, run_at,
            payload, None, result, len(result) if result else None, error, None,
            state == "cancelled", worker, doc, queue, None,
        ))  # fmt: skip
        if len(chunk) == 50_000:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def migrations_at(rev: str) -> list[tuple[str, str]]:
    """(name, SQL) of the migrations at git revision ``rev``, in order."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=HERE.parent, capture_output=True, text=True, check=True
        ).stdout

    files = sorted(git("ls-tree", "--name-only", f"{rev}:{MIGRATIONS}").split())
    found = [(f[:-4], git("show", f"{rev}:{MIGRATIONS}/{f}")) for f in files if f.endswith(".sql")]
    if not any(name.startswith(f"{AFTER:04d}_") for name, _ in found):
        raise SystemExit(f"--before {rev}: no migration {AFTER:04d} in {MIGRATIONS}")
    return found


async def migrate_to(dsn: str, steps: list[tuple[str, str]], last: int) -> float:
    """Apply the ``steps`` numbered up to ``last`` (as db.migrate would, in one transaction);
    seconds."""
    conn = await connect(dsn)
    started = time.monotonic()
    try:
        async with conn.transaction():
            await conn.execute(query("create_migrations_table"))
            done = {r["name"] for r in await conn.fetch(query("applied_migrations"))}
            for name, sql in steps:
                if int(name[:4]) <= last and name not in done:
                    await conn.execute(sql)
                    await conn.execute(query("record_migration"), name)
    finally:
        await conn.close()
    return time.monotonic() - started


async def fill(pool: Pool, n: int, now: datetime) -> float:
    started = time.monotonic()
    async with pool.acquire() as conn:
        for records in job_records(n, 11, now):
            await conn.copy_records_to_table("jobs", records=records, columns=JOB_COLUMNS)
    seconds = time.monotonic() - started
    await pool.execute("VACUUM ANALYZE jobs")
    return seconds


# --- the listing's queries ------------------------------------------------------------------
async def cases(pool: Pool, now: datetime) -> list[tuple[str, dict[str, Any]]]:
    """The filters an operator uses, with values taken from the data (the busiest and a
    small tenant, a common and a rare type, a one-hour window, an id prefix)."""
    top = await pool.fetchval(
        "SELECT tenant FROM jobs GROUP BY tenant ORDER BY count(*) DESC LIMIT 1"
    )
    small = await pool.fetchval(
        "SELECT tenant FROM jobs GROUP BY tenant ORDER BY count(*), tenant LIMIT 1"
    )
    some = await pool.fetchval("SELECT id FROM jobs ORDER BY created_at DESC OFFSET 5000 LIMIT 1")
    rare_type = f"task_{TYPES - 1:02d}"
    window = now - timedelta(days=10)
    return [
        ("every job, newest first", {}),
        ("state=failed", {"state": "failed"}),
        ("state=running (0.1 %)", {"state": "running"}),
        ("state=succeeded (96 %)", {"state": "succeeded"}),
        (f"tenant={small} & state=succeeded", {"tenant": small, "state": "succeeded"}),
        ("type=task_00 (common)", {"type": "task_00"}),
        (f"type={rare_type} (0.01 %)", {"type": rare_type}),
        ("queue=reports", {"queue": "reports"}),
        (f"tenant={top} (busiest)", {"tenant": top}),
        (f"tenant={small} (smallest)", {"tenant": small}),
        ("tenant=busiest & state=failed", {"tenant": top, "state": "failed"}),
        ("created in a 1-hour window, 10 days ago", {"created_after": window, "created_before": window + timedelta(hours=1)}),
        ("id prefix, 8 characters", {"id_prefix": some[:8]}),
        ("id prefix, full id", {"id_prefix": some}),
        ("state=failed & queue=reports & type=task_02", {"state": "failed", "queue": "reports", "type": "task_02"}),
        (f"state=failed & type={rare_type}", {"state": "failed", "type": rare_type}),
        (f"state=scheduled & type={rare_type}", {"state": "scheduled", "type": rare_type}),
        ("state=cancelled & queue=billing", {"state": "cancelled", "queue": "billing"}),
        # queued jobs are not in 0020's partial indexes: read through the rare type's jobs
        (f"state=queued & type={rare_type}", {"state": "queued", "type": rare_type}),
    ]  # fmt: skip


def plan_indexes(node: dict[str, Any], out: list[str]) -> list[str]:
    """The access paths of a plan: index names, or "Seq Scan" for a table scan."""
    if node.get("Index Name"):
        out.append(node["Index Name"])
    elif node.get("Node Type") == "Seq Scan":
        out.append("Seq Scan")
    for child in node.get("Plans", []):
        plan_indexes(child, out)
    return out


_readers: dict[int, PgReader] = {}  # per pool: its statistics, read as the API's reader does
FORCED: dict[str, str] = {}  # "query": a listing's query whatever the reader would choose


async def listing_query(pool: Pool, filters: dict[str, Any], current: bool) -> str:
    """The listing's query for these filters: this tree's choice (``PgReader.listing_query``:
    by state through jobs_by_state, but queued or running jobs of a rare type through that
    type's jobs), or (``current`` False) the one query of the schema before migration 0009, a
    state filter on ``jobs`` itself."""
    if not current:
        return "admin_list_jobs"
    if "query" in FORCED:
        return FORCED["query"]
    reader = _readers.get(id(pool)) or await warm_reader(pool)
    return await reader.listing_query("admin_list_jobs", **filters)


async def warm_reader(pool: Pool) -> PgReader:
    """The pool's reader, its statistics read now and kept for the rest of the run: their
    first read is on a fresh session (Postgres loads pg_stats's catalog entries then, about
    20 ms), once a process and then once a minute, not once a page: not timed."""
    reader = _readers[id(pool)] = PgReader(pool)
    reader.stats.ttl = 24 * 3600.0
    await reader.stats.columns()
    return reader


async def page_of(
    pool: Pool, filters: dict[str, Any], cursor: str | None, current: bool
) -> tuple[list[Any], str | None]:
    """A page of 50, newest first, as ``PgReader.admin_list_jobs`` reads it."""
    name = await listing_query(pool, filters, current)
    sql, params = listing_sql(name, 50, "desc", **filters, cursor=cursor)
    rows = await pool.fetch(sql, *params)
    if len(rows) <= 50:
        return rows, None
    return rows[:50], encode_cursor("desc", rows[49]["created_at"], rows[49]["id"])


async def explain(pool: Pool, filters: dict[str, Any], current: bool) -> dict[str, Any]:
    sql, params = listing_sql(await listing_query(pool, filters, current), 50, "desc", **filters)
    raw = await pool.fetchval(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}", *params)
    plan = json.loads(raw)[0]
    return {
        "access": sorted(set(plan_indexes(plan["Plan"], []))),
        "execution_ms": round(plan["Execution Time"], 2),
        "plan_rows": plan["Plan"].get("Actual Rows"),
        "buffers": plan["Plan"].get("Shared Hit Blocks", 0)
        + plan["Plan"].get("Shared Read Blocks", 0),
    }


async def time_case(
    pool: Pool, filters: dict[str, Any], reps: int, current: bool
) -> dict[str, Any]:
    """Milliseconds per page over ``reps`` runs (through asyncpg's prepared statements, as the
    API runs them), and the time of a page 20 pages deep (keyset: as cheap as the first)."""
    times = []
    rows = 0
    for _ in range(reps):
        started = time.perf_counter()
        page, cursor = await page_of(pool, filters, None, current)
        times.append((time.perf_counter() - started) * 1000)
        rows = len(page)
    deep = None
    cursor = None
    for _ in range(20):
        page, cursor = await page_of(pool, filters, cursor, current)
        if cursor is None:
            break
    if cursor is not None:
        started = time.perf_counter()
        await page_of(pool, filters, cursor, current)
        deep = (time.perf_counter() - started) * 1000
    return {
        "rows": rows,
        "p50_ms": round(percentile(times, 50), 2),
        "p99_ms": round(percentile(times, 99), 2),
        "page_21_ms": None if deep is None else round(deep, 2),
    }


async def listing(
    pool: Pool, named: list[tuple[str, dict[str, Any]]], reps: int, current: bool
) -> dict[str, Any]:
    out = {}
    for label, filters in named:
        timing = await time_case(pool, filters, reps, current)
        out[label] = {**timing, **await explain(pool, filters, current)}
        print(f"  {label}: {out[label]}", flush=True)
    return out


# --- the write-behind's cost ----------------------------------------------------------------
async def drain_rate(
    redis_url: str, pg: LocalPostgres, pool: Pool, transitions: int
) -> dict[str, Any]:
    """A backlog of ``transitions`` (submit, claim, complete of transitions/3 jobs) drained by
    one persister into the filled table: transitions a second, and Postgres CPU each."""
    redis = Redis.from_url(redis_url)
    await flush(redis)
    # marked as Queue.connect marks a new deployment's shards: the API started later reads them
    await set_format(redis, Keys("jt", SHARDS), job_format.NEWEST)
    await prefill(redis_url, transitions)
    # retention off: a pruning pass would delete the oldest filled jobs mid-measure
    settings = Settings.from_env(
        {}, redis_url=redis_url, database_url=pg.dsn, shards=SHARDS,
        pg_job_retention_days=0, pg_history_retention_days=0,
    )  # fmt: skip
    persister = Persister(settings, redis, pool, "bench")
    await persister.consumer.setup()
    cpu = pg_cpu(pg)
    started = time.monotonic()
    task = asyncio.create_task(persister.run())
    while persister.stats.transitions < transitions and time.monotonic() - started < 300:
        await asyncio.sleep(0.01)
    elapsed = time.monotonic() - started
    cpu = pg_cpu(pg) - cpu
    persister.stop()
    await task
    await redis.aclose()
    done = persister.stats.transitions
    return {
        "transitions": done,
        "per_second": round(done / elapsed),
        "postgres_cpu_us": round(cpu / done * 1e6, 1),
    }


def pg_cpu(pg: LocalPostgres) -> float:
    """CPU seconds of this Postgres: the postmaster, its children, and those it reaped."""
    postmaster = int((pg.data / "postmaster.pid").read_text().split()[0])
    ticks = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(entry.name) == postmaster:
            ticks += sum(int(v) for v in stat[11:15])
        elif int(stat[1]) == postmaster:
            ticks += int(stat[11]) + int(stat[12])
    return ticks / os.sysconf("SC_CLK_TCK")


# --- the page over HTTP -------------------------------------------------------------------------
def first_frame_ms(url: str) -> float:
    """From the stream's request to its first frame: a frame built for this request (the
    previous one is over a second old)."""
    started = time.perf_counter()
    with httpx.stream("GET", f"{url}/v1/admin/dashboard/stream",
                      headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=30) as r:  # fmt: skip
        for line in r.iter_lines():
            if line.startswith("data:"):
                return (time.perf_counter() - started) * 1000
    raise RuntimeError("the stream ended without a frame")


def page_costs(url: str, job_id: str) -> dict[str, Any]:
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    out: dict[str, Any] = {}
    with httpx.Client(base_url=url, timeout=30) as c:
        page = c.get("/dashboard")
        out["page_bytes"] = len(page.content)
        for name, path, n in (
            ("GET /dashboard", "/dashboard", 30),
            ("GET /v1/admin/jobs (first page, no filter)", "/v1/admin/jobs?limit=50", 30),
            ("GET /v1/admin/jobs?state=failed", "/v1/admin/jobs?limit=50&state=failed", 30),
            ("GET /v1/admin/jobs/{id} (detail)", f"/v1/admin/jobs/{job_id}", 30),
            ("GET /v1/admin/queues", "/v1/admin/queues", 30),
        ):
            times = []
            for _ in range(n):
                started = time.perf_counter()
                r = c.get(path, headers=admin)
                times.append((time.perf_counter() - started) * 1000)
                r.raise_for_status()
            out[name] = {"p50_ms": round(percentile(times, 50), 2), "p99_ms": round(percentile(times, 99), 2),
                         "bytes": len(r.content)}  # fmt: skip
    frames = []
    for _ in range(10):
        frames.append(first_frame_ms(url))
        time.sleep(1.1)  # past the frame cache's second: the next stream builds a new one
    out["stream opened → first frame"] = {
        "p50_ms": round(percentile(frames, 50), 2),
        "p99_ms": round(max(frames), 2),
    }
    return out


def run_locust(url: str, folder: Path, seconds: int, users: int, operators: int,
               classes: list[str], filters: list[dict[str, str]]) -> dict[str, Any]:  # fmt: skip
    """A headless locust run; its stats per request name."""
    folder.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ, "JOBTIER_KEY": TENANT_KEY, "LOADTEST_ADMIN_KEY": ADMIN_KEY,
        "LOADTEST_CONSOLE_FILTERS": json.dumps(filters), "LOADTEST_SPREAD_JOBS": "2000",
        "LOADTEST_OPERATORS": str(operators),
    }  # fmt: skip
    locustfile = f"{HERE.parent / 'loadtest' / 'locustfile.py'},{HERE / 'console_locust.py'}"
    cmd = [
        sys.executable, "-m", "locust", "-f", locustfile, "--headless", "-u", str(users),
        "-r", str(users), "-t", f"{seconds}s", "--host", url, "--csv", str(folder / "stats"),
        "--only-summary", "--stop-timeout", "5", *classes,
    ]  # fmt: skip
    log = folder / "locust.log"
    with log.open("wb") as out:
        subprocess.run(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=seconds + 120, check=False
        )
    rows = {}
    with (folder / "stats_stats.csv").open() as f:
        for row in csv.DictReader(f):
            rows[row["Name"]] = {
                "requests": int(row["Request Count"]),
                "failures": int(row["Failure Count"]),
                "per_second": round(float(row["Requests/s"]), 1),
                "p50_ms": float(row["50%"] or "nan"),
                "p95_ms": float(row["95%"] or "nan"),
                "p99_ms": float(row["99%"] or "nan"),
                "max_ms": float(row["Max Response Time"] or "nan"),
            }
    return rows


# --- the run --------------------------------------------------------------------------------
async def postgres_phase(
    args: argparse.Namespace, pg: LocalPostgres, redis: LocalRedis, result: dict[str, Any]
) -> list[tuple[str, dict[str, Any]]]:
    """Fill, time the listing before and after 0009, and the write-behind's drain; the
    filters (for the HTTP phase)."""
    steps = migrations_at(args.before)
    await migrate_to(pg.dsn, steps, BEFORE)
    pool = await create_pool(pg.dsn, min_size=1, max_size=4)
    async with pool.acquire() as conn:  # the history's partitions, before any write
        await ensure_partitions(conn, datetime.now(UTC))
    now = datetime.now(UTC)
    print(f"filling {args.jobs:,} jobs by COPY…", flush=True)
    result["fill_seconds"] = round(await fill(pool, args.jobs, now), 1)
    size = "SELECT pg_total_relation_size('jobs')"
    result["table_mb"] = round(await pool.fetchval(size) / 2**20)
    named = await cases(pool, now)

    print(f"listing before {AFTER:04d} (baseline)…", flush=True)
    result["before"] = await listing(pool, named, args.baseline_reps, current=False)
    result["drain_before"] = await drain_rate(redis.url, pg, pool, args.transitions)
    print(f"  drain {result['drain_before']}", flush=True)

    print(f"migration {AFTER:04d}…", flush=True)
    await pool.close()
    result["migration_seconds"] = round(await migrate_to(pg.dsn, steps, AFTER), 1)
    pool = await create_pool(pg.dsn, min_size=1, max_size=4)
    await pool.execute("VACUUM ANALYZE jobs")
    await pool.execute("VACUUM ANALYZE jobs_by_state")
    await warm_reader(pool)
    result["table_mb_after"] = round(await pool.fetchval(size) / 2**20)
    result["by_state_mb"] = round(await pool.fetchval(BY_STATE_SIZE) / 2**20)
    print(f"listing after {AFTER:04d}…", flush=True)
    result["after"] = await listing(pool, named, args.reps, current=True)
    result["drain_after"] = await drain_rate(redis.url, pg, pool, args.transitions)
    print(f"  drain {result['drain_after']}", flush=True)

    # then this tree's migrations after 0009 (today's schema): 0020's partial indexes serve a
    # state that jobs collect in with a type or a queue; the same filters again, same run
    await pool.close()
    started = time.perf_counter()
    result["later_migrations"] = await migrate(pg.dsn)
    result["later_migration_seconds"] = round(time.perf_counter() - started, 1)
    print(f"this tree's later migrations: {result['later_migrations']}", flush=True)
    pool = await create_pool(pg.dsn, min_size=1, max_size=4)
    await pool.execute("VACUUM ANALYZE jobs_by_state")
    await warm_reader(pool)
    result["today"] = await listing(pool, named, args.reps, current=True)
    # the same run, queued or running jobs of a type or queue through jobs_by_state as before
    # the reader chose by the statistics (persist/listing_stats.py): the baseline of that choice
    unindexed = [
        (label, f) for label, f in named
        if f.get("state") in UNINDEXED and (f.get("type") or f.get("queue"))
    ]  # fmt: skip
    FORCED["query"] = "list_jobs_by_state"
    result["today_by_state"] = await listing(pool, unindexed, args.reps, current=True)
    FORCED.clear()
    result["drain_today"] = await drain_rate(redis.url, pg, pool, args.transitions)
    print(f"  drain {result['drain_today']}", flush=True)
    result["failed_job"] = await pool.fetchval("SELECT id FROM jobs WHERE state = 'failed' LIMIT 1")
    await pool.close()
    return named


def http_phase(
    args: argparse.Namespace,
    pg: LocalPostgres,
    redis: LocalRedis,
    folder: Path,
    named: list[tuple[str, dict[str, Any]]],
    result: dict[str, Any],
) -> None:
    """The page and the listing endpoint over HTTP, with a persister writing behind."""
    env = {
        "JOBTIER_REDIS_URL": redis.url, "JOBTIER_DATABASE_URL": pg.dsn,
        "JOBTIER_SHARDS": str(SHARDS), "JOBTIER_API_KEYS": f"{TENANT_KEY}:tenant-000",
        "JOBTIER_ADMIN_KEY": ADMIN_KEY, "JOBTIER_REQUIRE_KNOWN_TYPES": "0",
        "JOBTIER_LOG_LEVEL": "WARNING", "JOBTIER_PG_JOB_RETENTION_DAYS": "0",
        "JOBTIER_PG_HISTORY_RETENTION_DAYS": "0",
    }  # fmt: skip
    api = ApiProcess(free_port(), env, log=folder / "api.log").wait_ready()
    # the write-behind runs as in production: Postgres is writing while it is read
    persister = subprocess.Popen(
        [sys.executable, "-m", "jobtier.cli", "persister"], env={**os.environ, **env},
        stdout=(folder / "persister.log").open("wb"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        print("the page over HTTP…", flush=True)
        result["page"] = page_costs(api.url, result["failed_job"])
        print(f"  {result['page']}", flush=True)
        filters = [
            {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in f.items()}
            for _, f in named
        ]
        # every filter through the API's pool a few times first: the alone run must not pay
        # the statements' first planning on each pooled connection, which the mix run would not
        admin = {"authorization": f"Bearer {ADMIN_KEY}"}
        with httpx.Client(base_url=api.url, timeout=30, headers=admin) as c:
            for f in filters:
                for _ in range(10):
                    c.get("/v1/admin/jobs", params={**f, "limit": 50}).raise_for_status()
        print("locust: the listing alone (baseline)…", flush=True)
        result["locust_alone"] = run_locust(
            api.url, folder / "alone", args.locust_seconds, args.operators, args.operators,
            ["ConsoleUser"], filters,
        )  # fmt: skip
        print(f"  {result['locust_alone']}", flush=True)
        print("locust: the listing under the poller mix…", flush=True)
        result["locust_mix"] = run_locust(
            api.url, folder / "mix", args.locust_seconds, args.users + args.operators,
            args.operators, ["Poller", "Submitter", "ConsoleUser"], filters,
        )  # fmt: skip
        print(f"  {result['locust_mix']}", flush=True)
    finally:
        if persister.poll() is None:
            os.killpg(persister.pid, signal.SIGTERM)
            persister.wait(30)
        api.stop()


def bench(args: argparse.Namespace) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="jobtier-bench-console-"))
    pg = LocalPostgres(Path(tempfile.mkdtemp(prefix="jobtier-bench-pg-")), durable=True)
    redis = LocalRedis(folder / "redis").start()
    result: dict[str, Any] = {"jobs": args.jobs, "migrations_of": args.before}
    try:
        pg.start()
        named = asyncio.run(postgres_phase(args, pg, redis, result))
        http_phase(args, pg, redis, folder, named, result)
        result["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    finally:
        redis.stop()
        pg.destroy()
        shutil.rmtree(folder, ignore_errors=True)
    return result


def report(r: dict[str, Any], env: dict[str, Any], args: argparse.Namespace) -> str:
    out = [
        header_markdown("Console: the listing and the page with a million jobs in Postgres", env)
    ]
    out.append(
        f"{r['jobs']:,} jobs COPYed in {r['fill_seconds']} s ({r['table_mb']} MiB with the "
        f"indexes of `{args.before}`'s 0001-{BEFORE:04d}; {r['table_mb_after']} MiB after "
        f"{AFTER:04d}, and "
        f"{r.get('by_state_mb', '-')} MiB of jobs_by_state). {TENANTS} tenants and "
        f"{TYPES} types (Zipf-skewed), {len(QUEUES)} queues, created over {DAYS} days; "
        "96 % succeeded, 2 % failed, 1 % cancelled, the rest waiting or running.\n"
    )
    out.append("## The listing's queries (a page of 50, newest first)\n")
    out.append(
        f"p50/p99 of {args.reps} runs after migration {AFTER:04d} ({args.baseline_reps} before "
        "it: the baseline, a state filter on `jobs` through its state indexes), through "
        "asyncpg's prepared statements as the API runs them; the access paths from `EXPLAIN "
        "ANALYZE`; a page 20 pages deep, by cursor.\n"
    )
    rows = []
    for label, a in r["after"].items():
        b = r["before"][label]
        rows.append([
            label, str(a["rows"]), f"{a['p50_ms']:.2f}", f"{a['p99_ms']:.2f}",
            "-" if a["page_21_ms"] is None else f"{a['page_21_ms']:.2f}", ", ".join(a["access"]),
            f"{b['p50_ms']:.1f}", ", ".join(b["access"]),
        ])  # fmt: skip
    out.append(table(
        ["filter", "rows", "p50 ms", "p99 ms", "page 21 ms", f"plan ({AFTER:04d})", "before: p50 ms", "plan (before)"],
        rows,
    ))  # fmt: skip
    if "today" in r:
        later = ", ".join(r["later_migrations"]) or "none"
        out.append(f"\n### Then this tree's later migrations ({later}), same filters\n")
        out.append(
            f"Applied by `jobtier migrate`'s code to the filled database in "
            f"{r['later_migration_seconds']} s; p50/p99 of {args.reps} runs again, beside "
            f"{AFTER:04d}'s above (the same reader: its choice of query included). Queued or "
            "running jobs of a type or queue are read through that type's (or queue's) jobs "
            "where Postgres's statistics say they are fewer than the state's "
            "(`persist/listing_stats.py`); the last column reads them through `jobs_by_state` "
            "whatever the statistics, in the same run, after this tree's.\n"
        )
        rows = []
        forced = r.get("today_by_state", {})
        for label, t in r["today"].items():
            a = r["after"][label]
            f = forced.get(label)
            rows.append([
                label, str(t["rows"]), f"{t['p50_ms']:.2f}", f"{t['p99_ms']:.2f}",
                ", ".join(t["access"]), f"{a['p50_ms']:.2f}", f"{a['p99_ms']:.2f}",
                "-" if f is None else f"{f['p50_ms']:.2f} / {f['p99_ms']:.2f} ({', '.join(f['access'])})",
            ])  # fmt: skip
        out.append(table(
            ["filter", "rows", "p50 ms", "p99 ms", "plan (this tree)", f"{AFTER:04d}: p50 ms", f"{AFTER:04d}: p99 ms",
             "through jobs_by_state whatever the statistics: p50 / p99 ms (plan)"],
            rows,
        ))  # fmt: skip
    out.append(f"\n## What migration {AFTER:04d} changes for the write-behind\n")
    d0, d1 = r["drain_before"], r["drain_after"]
    heads = ["", f"before {AFTER:04d}", f"after {AFTER:04d}"]
    lines = [
        ["the migration on the filled table", "-", f"{r['migration_seconds']} s"],
        ["write-behind drain, transitions/s", f"{d0['per_second']:,}", f"{d1['per_second']:,}"],
        ["Postgres CPU per transition, us", f"{d0['postgres_cpu_us']}", f"{d1['postgres_cpu_us']}"],
    ]
    if (d2 := r.get("drain_today")) is not None:  # and after this tree's later migrations
        heads.append("this tree")
        lines[0].append(f"{r['later_migration_seconds']} s")
        lines[1].append(f"{d2['per_second']:,}")
        lines[2].append(f"{d2['postgres_cpu_us']}")
    out.append(table(heads, lines))
    out.append(
        f"\n(a backlog of {args.transitions:,} transitions drained by one persister into the filled table)\n"
    )
    out.append("## The page over HTTP (one API process, granian)\n")
    p = r["page"]
    rows = [[name, f"{v['p50_ms']:.2f}", f"{v['p99_ms']:.2f}", f"{v.get('bytes', '-'):,}" if isinstance(v.get('bytes'), int) else "-"]
            for name, v in p.items() if isinstance(v, dict)]  # fmt: skip
    out.append(table(["request", "p50 ms", "p99 ms", "bytes"], rows))
    out.append(
        f"\nThe page is {p['page_bytes']:,} bytes (one document). Loading it costs the document, "
        "one stream (a frame a second, built once per API process whatever the number of "
        "pages open: the first frame's time above is that build) and the view's first "
        "request; keeping it open costs the frames, the events of the jobs in flight on the "
        "screen (pushed, never polled), one listing query every 5 s with 'refresh' ticked, and "
        "on the workers view one `GET /v1/admin/workers` every 2 s.\n"
    )
    out.append("## The listing endpoint under load (locust)\n")
    out.append(
        f"{args.operators} operators paging through the filters above (a page every second "
        f"each, one in five a next page), alone (the baseline), then with {args.users} more "
        f"users of the poller mix (pollers and submitters, closed loop); {args.locust_seconds} s "
        "each. Locust is a closed loop: these tails are lower bounds (see loadtest/run.sh).\n"
    )
    rows = []
    for run, stats in (("alone", r["locust_alone"]), ("under the poller mix", r["locust_mix"])):
        for name, s in stats.items():
            if name.startswith("GET /v1/admin/jobs") or (
                run != "alone" and name in ("Aggregated",)
            ):
                rows.append([run, name, f"{s['requests']:,}", str(s["failures"]), f"{s['per_second']}",
                             f"{s['p50_ms']:.0f}", f"{s['p95_ms']:.0f}", f"{s['p99_ms']:.0f}", f"{s['max_ms']:.0f}"])  # fmt: skip
    out.append(
        table(
            [
                "run",
                "request",
                "requests",
                "failures",
                "req/s",
                "p50 ms",
                "p95 ms",
                "p99 ms",
                "max ms",
            ],
            rows,
        )
    )
    out.append(f"\nLoad average at the end: {' / '.join(map(str, r['load_average_end']))}.\n")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--reps", type=int, default=50, help="runs of each listing query")
    parser.add_argument("--baseline-reps", type=int, default=5, help=f"runs before {AFTER:04d}")
    parser.add_argument(
        "--before",
        metavar="REV",
        default="4ffac07",
        help=f"the git revision whose migrations 0001-{AFTER:04d} make the schema in steps",
    )
    parser.add_argument("--transitions", type=int, default=60_000, help="backlog drained")
    parser.add_argument("--locust-seconds", type=int, default=60)
    parser.add_argument("--users", type=int, default=40, help="poller-mix users")
    parser.add_argument("--operators", type=int, default=10, help="console users")
    parser.add_argument(
        "--name", default="console", help="results file name (bench/results/NAME.*)"
    )
    args = parser.parse_args()
    env = environment()
    result = bench(args)
    markdown = report(result, env, args)
    print(markdown)
    json_path, md_path = save(args.name, {"environment": env, "result": result}, markdown)
    print(f"saved {json_path} and {md_path}")


if __name__ == "__main__":
    main()
