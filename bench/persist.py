"""Benchmark: the batched write-behind persister against a plain baseline, same run.

Starts its own Redis and a durable Postgres (fsync on) in a temporary folder, produces job
transitions with the real Lua scripts, and measures:

* throughput: a backlog of transitions already in the log, drained as fast as possible;
* lag at a sustained rate: transitions produced at a fixed rate by another process, lag of
  each = commit time - the log entry's id time (Redis's clock when the transition happened).

Variants: ``batched`` (the persister: one transaction per batch, COPY into staging tables,
one upsert per table), ``unnest`` (the same batches as array parameters: the alternative the
persister was measured against), ``baseline`` (one INSERT per transition, autocommit). These
run in the bench's own process.

``--before REV`` adds the persister as deployed: ``jobtier persister`` in a process of its own,
once with this tree's code and once with git revision REV's (its files in a temporary folder,
first on the child's PYTHONPATH), alternated in the same run on the same servers. Each drains
the same backlog; its CPU (the process's, from /proc) and Postgres's are counted from the
moment it is let go (it is started first and held with SIGSTOP while the backlog is made,
so start-up costs are left out).

    .venv/bin/python bench/persist.py                 # one run, all variants
    .venv/bin/python bench/persist.py --runs 3        # medians of three runs
    .venv/bin/python bench/persist.py --runs 3 --before main --variants batched

Results go to bench/results/persist.json and bench/results/persist.md (``--name`` to change).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import defaultdict, deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from redis.asyncio import Redis

from jobtier.store.calls import claim_call, complete_call, parse_claim, submit_call

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, baseline_tree, environment, proc_cpu

from jobtier.config import Settings
from jobtier.core.keys import Keys
from jobtier.dev.local_postgres import LocalPostgres
from jobtier.dev.local_redis import LocalRedis
from jobtier.persist.batch import (
    JOB_COLUMNS,
    TRANSITION_COLUMNS,
    collapse,
    job_records,
    split_created,
    transition_records,
)
from jobtier.persist.db import AnyConnection, Pool, create_pool, migrate, query
from jobtier.persist.persister import Persister
from jobtier.store import format as job_format
from jobtier.store.calls import SubmitItem
from jobtier.store.scripts import Scripts
from jobtier.streams.entries import LogEntry, parse_entries, transition_count
from jobtier.streams.group import oldest_waiting

SHARDS = 16
RESULTS = Path(__file__).parent / "results"
SPREAD = 0.3  # seconds between a job's submit, claim and completion at a sustained rate
Entries = list[tuple[bytes, dict[bytes, bytes]]]  # an XRANGE reply (decode_responses off)


# --- producing transitions --------------------------------------------------------------------
async def jobs_round(scripts: Scripts, keys: Keys, per_shard: dict[int, int]) -> int:
    """Submit, claim and complete per_shard[s] jobs in each shard; returns transitions made."""
    await submit(scripts, keys, per_shard)
    claimed = await claim(scripts, per_shard)
    await complete(scripts, claimed)
    return 3 * sum(per_shard.values())


async def submit(scripts: Scripts, keys: Keys, per_shard: dict[int, int]) -> None:
    calls = []
    for shard, n in per_shard.items():
        items = [
            SubmitItem(keys.new_id(shard), "t1", "bench", "normal", b'{"n":1}', 3, 0, 0, "", "")
            for _ in range(n)
        ]
        calls.append(submit_call(shard, items, 60_000))
    await scripts.call_many(calls)


async def claim(scripts: Scripts, per_shard: dict[int, int]) -> list[tuple[int, Any]]:
    shards = [s for s, n in per_shard.items() if n]
    replies = await scripts.call_many(
        [claim_call(s, "bench", per_shard[s], 600_000) for s in shards]
    )
    return [(s, parse_claim(s, r).jobs) for s, r in zip(shards, replies, strict=True)]


async def complete(scripts: Scripts, claimed: list[tuple[int, Any]]) -> None:
    calls = [
        complete_call(s, "bench", 3600, [(j.id, j.lease_version, b"1") for j in jobs])
        for s, jobs in claimed
        if jobs
    ]
    if calls:
        await scripts.call_many(calls)


async def prefill(redis_url: str, transitions: int) -> None:
    """A backlog: chunks of submits, then their claims, then completions (a job's three
    entries sit thousands of entries apart, as they do when jobs take a while)."""
    redis = Redis.from_url(redis_url)
    keys = Keys("jt", SHARDS)
    scripts = Scripts(redis, keys)
    await job_format.mark(redis, keys)  # as jobtier's producers mark a new deployment's shards
    jobs = transitions // 3
    chunk = 4000
    for start in range(0, jobs, chunk):
        n = min(chunk, jobs - start)
        await jobs_round(scripts, keys, {s: n // SHARDS + (s < n % SHARDS) for s in range(SHARDS)})
    await redis.aclose()


async def backlog(run: Run, transitions: int) -> list[LogEntry]:
    """A fresh backlog in Redis (``run``'s tables emptied), read back and decoded in log
    order: what the in-process profiles write batch by batch."""
    await run.reset()
    await prefill(run.redis_url, transitions)
    entries: list[LogEntry] = []
    for shard in range(SHARDS):
        for entry_id, fields in cast(Entries, await run.redis.xrange(run.keys.log(shard))):
            entries += parse_entries(shard, entry_id, fields)
    entries.sort(key=lambda e: (e.ms, e.entry_id))
    return entries


async def generate(redis_url: str, rate: float, seconds: float) -> None:
    """(Child process) transitions at `rate` per second for `seconds`: every 10 ms, submit
    the jobs due, claim those submitted SPREAD ago, complete those claimed SPREAD ago."""
    redis = Redis.from_url(redis_url)
    keys = Keys("jt", SHARDS)
    scripts = Scripts(redis, keys)
    await job_format.mark(redis, keys)  # as jobtier's producers mark a new deployment's shards
    started = time.monotonic()
    made, shard = 0, 0
    to_claim: deque[tuple[float, dict[int, int]]] = deque()
    to_complete: deque[tuple[float, list[tuple[int, Any]]]] = deque()
    while True:
        now = time.monotonic()
        if now - started < seconds:
            due = int(rate * (now - started) / 3) - made
            if due > 0:
                per_shard: dict[int, int] = defaultdict(int)
                for _ in range(due):
                    per_shard[shard] += 1
                    shard = (shard + 1) % SHARDS
                await submit(scripts, keys, per_shard)
                to_claim.append((now, per_shard))
                made += due
        elif not to_claim and not to_complete:
            break
        while to_claim and (to_claim[0][0] <= now - SPREAD or now - started >= seconds):
            to_complete.append((now, await claim(scripts, to_claim.popleft()[1])))
        while to_complete and (to_complete[0][0] <= now - SPREAD or now - started >= seconds):
            await complete(scripts, to_complete.popleft()[1])
        await asyncio.sleep(0.01)
    await redis.aclose()


# --- the variants -----------------------------------------------------------------------------
JOB_TYPES = (
    "text", "text", "text", "text", "text", "int", "int", "int", "timestamptz", "timestamptz",
    "timestamptz", "json", "text", "json", "int", "json", "json", "bool", "text", "bytea",
    "text", "text",
)  # fmt: skip
assert len(JOB_TYPES) == len(JOB_COLUMNS)
TRANSITION_TYPES = (
    "text",
    "int",
    "int",
    "text",
    "text",
    "timestamptz",
    "text",
    "int",
    "json",
    "json",
    "bool",
)


def _unnest(types: Sequence[str], columns: Sequence[str]) -> str:
    arrays = ", ".join(f"${i}::{t}[]" for i, t in enumerate(types, start=1))
    return f"FROM unnest({arrays}) AS s ({', '.join(columns)})"


# the persister's statements, reading from array parameters instead of the staging tables
UNNEST_JOBS = query("upsert_jobs").replace("FROM jobs_staging", _unnest(JOB_TYPES, JOB_COLUMNS))
UNNEST_FILL = query("fill_submitted").replace(
    "FROM jobs_staging AS s",
    _unnest(("text", "json", "text"), ("id", "payload", "idempotency_key")),
)
UNNEST_TRANSITIONS = query("insert_transitions").replace(
    "FROM transitions_staging", _unnest(TRANSITION_TYPES, TRANSITION_COLUMNS)
)


class UnnestPersister(Persister):
    """The same batches as array parameters (one array per column, unnest in SQL)."""

    async def persist(self, entries: Sequence[LogEntry], rows: Any = None) -> None:
        every = collapse(entries)  # every job's row: the variant holds none back
        job_cols = list(zip(*job_records(every), strict=True))
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(UNNEST_JOBS, *job_cols)
            await conn.execute(UNNEST_FILL, job_cols[0], job_cols[11], job_cols[12])
            await conn.execute(UNNEST_TRANSITIONS, *zip(*transition_records(entries), strict=True))
        self.stats.jobs += len(every)


BASELINE_SQL = f"""
WITH history AS (
    INSERT INTO job_transitions ({", ".join(TRANSITION_COLUMNS)})
    VALUES ($1, $6, $25, $23, $5, $10, $24, $7, $16, $17, $18)
    ON CONFLICT DO NOTHING
)
INSERT INTO jobs AS j ({", ".join(JOB_COLUMNS)})
VALUES ({", ".join(f"${i}" for i in range(1, len(JOB_COLUMNS) + 1))})
ON CONFLICT (id) DO UPDATE SET state = excluded.state, version = excluded.version,
    attempt = excluded.attempt, updated_at = excluded.updated_at, run_at = excluded.run_at,
    result = coalesce(excluded.result, j.result), result_size = excluded.result_size,
    error = excluded.error, progress = excluded.progress,
    cancel_requested = excluded.cancel_requested, worker = excluded.worker, doc = excluded.doc
WHERE j.version < excluded.version
"""


class BaselinePersister(Persister):
    """The plain way: one statement (history row + job row) per transition, autocommit."""

    async def persist(self, entries: Sequence[LogEntry], rows: Any = None) -> None:
        # every entry's row: the variant holds none back
        async with self.pool.acquire() as conn:
            for e in entries:
                await self._one(conn, e)
        self.stats.jobs += len(entries)

    @staticmethod
    async def _one(conn: AnyConnection, e: LogEntry) -> None:
        [params] = job_records(collapse([e]))
        await conn.execute(BASELINE_SQL, *params, e.from_state, e.actor, e.prev_version)


VARIANTS: dict[str, type[Persister]] = {
    "batched": Persister,
    "unnest": UnnestPersister,
    "baseline": BaselinePersister,
}


# --- measuring --------------------------------------------------------------------------------
class Run:
    def __init__(self, redis: LocalRedis, pg: LocalPostgres, pool: Pool, variant: str) -> None:
        self.redis_url, self.pg, self.pool, self.variant = redis.url, pg, pool, variant
        if redis.pid is None:
            raise RuntimeError("the bench's Redis is not running")
        self.redis_pid = redis.pid
        self.redis = Redis.from_url(redis.url)
        self.keys = Keys("jt", SHARDS)
        self.settings = Settings.from_env(
            {}, redis_url=redis.url, database_url=pg.dsn, shards=SHARDS
        )
        self.lags: list[float] = []
        self.committed: set[tuple[int, bytes]] = set()

    async def reset(self) -> None:
        await self.redis.flushall()
        await self.pool.execute(
            "TRUNCATE jobs, jobs_by_state, job_transitions, job_results CASCADE"
        )
        await self.pool.execute("VACUUM ANALYZE")

    def _persister(self) -> Persister:
        def on_commit(entries: Sequence[LogEntry], at: float) -> None:
            self.lags.extend(at - e.ms / 1000 for e in entries)
            self.committed.update((e.shard, e.entry_id) for e in entries)

        cls = VARIANTS[self.variant]
        # the other variants write every job's row of a batch: they hold none back
        held = self.settings if cls is Persister else self.settings.replace(persist_hold_seconds=0)
        return cls(held, self.redis, self.pool, "bench", on_commit=on_commit)

    async def throughput(self, transitions: int, budget: float) -> dict[str, Any]:
        await self.reset()
        await prefill(self.redis_url, transitions)
        persister = self._persister()
        await persister.consumer.setup()
        started, cpu, pg_cpu = time.monotonic(), time.process_time(), self.pg_cpu()
        task = asyncio.create_task(persister.run())
        while persister.stats.transitions < transitions and time.monotonic() - started < budget:
            await asyncio.sleep(0.01)
        elapsed = time.monotonic() - started
        # rows, not the persister's per-batch counter: the baseline commits row by row
        done = await self.pool.fetchval("SELECT count(*) FROM job_transitions")
        cpu, pg_cpu = time.process_time() - cpu, self.pg_cpu() - pg_cpu
        persister.stop()
        await task
        return {
            "transitions": done,
            "seconds": round(elapsed, 2),
            "per_second": round(done / elapsed),
            "complete": done >= transitions,
            "mean_batch": round(persister.stats.transitions / max(persister.stats.batches, 1)),
            # CPU per transition: steadier than rates on a shared, noisy machine
            "persister_cpu_us": round(cpu / done * 1e6, 1),
            "postgres_cpu_us": round(pg_cpu / done * 1e6, 1),
        }

    def pg_cpu(self) -> float:
        """CPU seconds used so far by this Postgres: the postmaster, its live children, and
        (cutime/cstime) the children it has reaped."""
        postmaster = int((self.pg.data / "postmaster.pid").read_text().split()[0])
        ticks = 0
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            pid, ppid = int(entry.name), int(stat[1])
            if pid == postmaster:
                ticks += sum(int(v) for v in stat[11:15])
            elif ppid == postmaster:
                ticks += int(stat[11]) + int(stat[12])
        return ticks / os.sysconf("SC_CLK_TCK")

    async def sustained(self, rate: float, seconds: float, drain_budget: float) -> dict[str, Any]:
        await self.reset()
        persister = self._persister()
        await persister.consumer.setup()
        self.lags, self.committed = [], set()
        task = asyncio.create_task(persister.run())
        gen = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--generate", self.redis_url, str(rate), str(seconds)
        )
        started = time.monotonic()
        await gen.wait()
        produced_in = time.monotonic() - started
        deadline = time.monotonic() + drain_budget
        while (await oldest_waiting(self.redis, self.keys))[0] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        persister.stop()
        await task
        # entries never committed count with their age so far: a lower bound of their lag
        now, left = time.time(), 0
        for s in range(SHARDS):
            for entry_id, fields in cast(Entries, await self.redis.xrange(self.keys.log(s))):
                if (s, entry_id) not in self.committed:
                    n = transition_count(fields)  # its transitions (an entry holds a call's)
                    left += n
                    self.lags += [now - int(entry_id.split(b"-")[0]) / 1000] * n
        lags = sorted(self.lags)
        return {
            "rate": rate,
            "transitions": len(lags),
            "achieved_rate": round(len(lags) / produced_in),
            "p50_ms": round(_pct(lags, 0.50) * 1000, 1),
            "p99_ms": round(_pct(lags, 0.99) * 1000, 1),
            "max_ms": round(lags[-1] * 1000, 1) if lags else 0.0,
            "unpersisted": left,
            "mean_batch": round(persister.stats.transitions / max(persister.stats.batches, 1)),
        }


# the persister's commands on Redis (streams/consumer.py, streams/acks.py, streams/group.py)
REDIS_COMMANDS = ("xreadgroup", "xack", "xtrim", "xautoclaim", "xpending", "xinfo|groups")


class PersisterProcess:
    """``jobtier persister`` in a process of its own, with the code of ``tree`` (None: this
    tree's), draining a backlog: what the persister costs as deployed, start-up left out."""

    def __init__(self, run: Run, tree: Path | None) -> None:
        self.run, self.tree = run, tree

    async def throughput(self, transitions: int, budget: float) -> dict[str, Any]:
        run = self.run
        await run.reset()
        src = (self.tree or ROOT) / "src"
        env = {
            **os.environ, "PYTHONPATH": str(src), "JOBTIER_REDIS_URL": run.redis_url,
            "JOBTIER_DATABASE_URL": run.pg.dsn, "JOBTIER_SHARDS": str(SHARDS),
            "JOBTIER_REDIS_REQUIRE_AOF": "0", "JOBTIER_LOG_LEVEL": "WARNING",
        }  # fmt: skip
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "jobtier.cli", "persister", "--name", "bench",
            env=env, start_new_session=True,
        )  # fmt: skip
        try:
            await self._wait_reading(proc)
            proc.send_signal(signal.SIGSTOP)  # held while the backlog is made
            await prefill(run.redis_url, transitions)
            await run.redis.config_resetstat()
            redis_cpu = proc_cpu(run.redis_pid)
            cpu, pg_cpu, started = proc_cpu(proc.pid), run.pg_cpu(), time.monotonic()
            proc.send_signal(signal.SIGCONT)
            while time.monotonic() - started < budget:
                # is anything left; not a count, which would cost Redis more than the
                # persister's own reads
                if not (await oldest_waiting(run.redis, run.keys))[0]:
                    break
                await asyncio.sleep(0.05)
            elapsed = time.monotonic() - started
            cpu, pg_cpu = proc_cpu(proc.pid) - cpu, run.pg_cpu() - pg_cpu
            redis_cpu = proc_cpu(run.redis_pid) - redis_cpu
            commands = await run.redis.info("commandstats")
        finally:
            if proc.returncode is None:
                os.killpg(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGTERM)
            await proc.wait()
        done = await run.pool.fetchval("SELECT count(*) FROM job_transitions")
        return {
            "transitions": done,
            "seconds": round(elapsed, 2),
            "per_second": round(done / elapsed),
            "complete": done >= transitions,
            "persister_cpu_us": round(cpu / done * 1e6, 1),
            "postgres_cpu_us": round(pg_cpu / done * 1e6, 1),
            # Redis's process, the bench's own lag checks (its EVALSHA) included
            "redis_cpu_us": round(redis_cpu / done * 1e6, 1),
            # time in each command (Redis's commandstats), per transition: inside the command
            # only (its reply written and the AOF fed after it are in redis_cpu_us alone)
            **{
                f"redis_{c}_us": round(commands.get(f"cmdstat_{c}", {}).get("usec", 0) / done, 2)
                for c in REDIS_COMMANDS
            },
        }

    async def _wait_reading(self, proc: asyncio.subprocess.Process) -> None:
        """Until the persister is a member of its group on every shard's log (it has read)."""
        group = self.run.keys.persist_group()
        async with asyncio.timeout(60):
            while True:
                if proc.returncode is not None:
                    raise RuntimeError(f"jobtier persister exited {proc.returncode}")
                try:
                    members = [
                        await self.run.redis.xinfo_consumers(self.run.keys.log(s), group)
                        for s in range(SHARDS)
                    ]
                except Exception:  # no group yet
                    members = []
                if members and all(m for m in members):
                    return
                await asyncio.sleep(0.05)


STAGED, DIRECT = "staged", "direct"  # the write paths --profile compares (postgres_profile)
# then the direct path without what the listings cost (the last things a bench does)
NO_LISTING = "direct, no jobs_by_state triggers"
NO_INDEX = "direct, neither those nor a secondary index on jobs"


async def _profiled_batch(
    conn: AnyConnection,
    chunk: list[LogEntry],
    path: str,
    ms: dict[str, float],
    wal: dict[str, float],
) -> None:
    """One batch's statements, in one transaction: ``STAGED`` as the persister wrote every
    batch until the straight COPY (every row COPYed into staging tables, then merged), or
    ``DIRECT`` as ``write_batch`` writes it now (the rows to merge staged, new jobs and the
    history COPYed straight in, each under a savepoint). COPY is timed from the client;
    the other statements run under EXPLAIN (ANALYZE, BUFFERS, WAL)."""

    async def timed_copy(label: str, table: str, records: Any, columns: Any) -> None:
        t0 = time.perf_counter()
        if path == DIRECT and table in ("jobs", "job_transitions"):
            async with conn.transaction():  # copy_new's savepoint
                await conn.copy_records_to_table(table, records=records, columns=columns)
        else:
            await conn.copy_records_to_table(table, records=records, columns=columns)
        ms[label] += (time.perf_counter() - t0) * 1000

    async def explained(name: str) -> None:
        plan = json.loads(
            await conn.fetchval("EXPLAIN (ANALYZE, BUFFERS, WAL, FORMAT JSON) " + query(name))
        )[0]
        ms[name] += plan["Execution Time"]
        wal[name] += plan["Plan"].get("WAL Bytes", 0)

    rows = collapse(chunk)
    merged, created = split_created(rows) if path == DIRECT else (rows, [])
    history = transition_records(sorted(chunk, key=lambda e: (e.status.id, e.status.version)))
    async with conn.transaction():
        await conn.execute(query("create_staging"))
        if merged:
            await timed_copy("COPY jobs_staging", "jobs_staging", job_records(merged), JOB_COLUMNS)
            await explained("upsert_jobs")
            if any(r.payload is not None for r in merged):
                await explained("fill_submitted")
        if created:
            await timed_copy("COPY jobs (new jobs)", "jobs", job_records(created), JOB_COLUMNS)
        if path == DIRECT:
            await timed_copy("COPY job_transitions", "job_transitions", history, TRANSITION_COLUMNS)
        else:
            await timed_copy(
                "COPY transitions_staging", "transitions_staging", history, TRANSITION_COLUMNS
            )
            await explained("insert_transitions")


async def postgres_profile(run: Run, transitions: int, batch: int) -> dict[str, Any]:
    """(``--profile``) Where Postgres's time per transition goes: a backlog written batch by
    batch, by the staged path and by the direct one (``_profiled_batch``), alternated, twice
    each; then the direct one without the triggers that keep ``jobs_by_state``, then also
    without the secondary indexes of ``jobs`` (this is the last thing a bench does with its
    database), to show what maintaining the listings costs. The WAL
    by record type comes from pg_walinspect; the CPU of the whole of Postgres, per
    transition, from /proc."""
    out: dict[str, Any] = {}
    run.pg.psql("CREATE EXTENSION IF NOT EXISTS pg_walinspect", database=run.pg.database)
    samples: dict[str, list[dict[str, Any]]] = defaultdict(list)
    order = [STAGED, DIRECT, DIRECT, STAGED, NO_LISTING, NO_INDEX]
    for label in order:
        path = STAGED if label == STAGED else DIRECT
        if label == NO_LISTING:
            for trigger in ("jobs_by_state_inserted", "jobs_by_state_updated"):
                await run.pool.execute(f"ALTER TABLE jobs DISABLE TRIGGER {trigger}")
        if label == NO_INDEX:
            for name in await run.pool.fetch(
                "SELECT indexname FROM pg_indexes WHERE tablename = 'jobs'"
                " AND indexname <> 'jobs_pkey'"
            ):
                await run.pool.execute(f'DROP INDEX "{name[0]}"')
        entries = await backlog(run, transitions)
        ms: dict[str, float] = defaultdict(float)
        wal: dict[str, float] = defaultdict(float)
        start = await run.pool.fetchval("SELECT pg_current_wal_lsn()::text")
        cpu = run.pg_cpu()
        async with run.pool.acquire() as conn:
            for i in range(0, len(entries), batch):
                await _profiled_batch(conn, entries[i : i + batch], path, ms, wal)
        cpu = run.pg_cpu() - cpu
        end = await run.pool.fetchval("SELECT pg_current_wal_lsn()::text")
        n = len(entries)
        by_kind = {}
        for line in run.pg.psql(
            'SELECT "resource_manager/record_type", count, record_size, fpi_size'
            f" FROM pg_get_wal_stats('{start}', '{end}', false) WHERE count > 0",
            database=run.pg.database,
        ).splitlines():
            kind, count, size, fpi = line.split("|")
            by_kind[kind] = {
                "records": round(int(count) / n, 2),
                "bytes": round((int(size) + int(fpi)) / n),
            }
        total = await run.pool.fetchval("SELECT $2::text::pg_lsn - $1::text::pg_lsn", start, end)
        sample = {
            "us": {k: round(v * 1000 / n, 2) for k, v in ms.items()},
            "wal_bytes": {k: round(v / n) for k, v in wal.items()},
            "wal_by_kind": by_kind,
            "wal_total_bytes": round(float(total) / n),
            "postgres_cpu_us": round(cpu / n * 1e6, 1),
        }
        samples[label].append(sample)
        print(f"profile {label}: {sample}")
    for label, got in samples.items():
        out[label] = _median_profile(got)
    return out


def _median_profile(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The per-key medians of a path's samples (the WAL by record type: the first's)."""
    first = samples[0]
    return {
        "us": {k: statistics.median(s["us"].get(k, 0) for s in samples) for k in first["us"]},
        "wal_bytes": {
            k: statistics.median(s["wal_bytes"].get(k, 0) for s in samples)
            for k in first["wal_bytes"]
        },
        "wal_by_kind": first["wal_by_kind"],
        "wal_total_bytes": statistics.median(s["wal_total_bytes"] for s in samples),
        "postgres_cpu_us": statistics.median(s["postgres_cpu_us"] for s in samples),
        "samples": len(samples),
    }


async def persister_steps(run: Run, transitions: int, batch: int) -> dict[str, float]:
    """(``--profile``) Where the persister's own CPU goes: each step of its work on a backlog
    in the log, timed apart in this process (CPU time, µs a transition; medians of three
    passes). Reading through redis-py as the persister reads (its replies parsed into a
    dict per entry); COPY's part is the client's, its encoding and sending (into temporary
    tables without index or trigger, so that Postgres's part stays small)."""
    await run.reset()
    await prefill(run.redis_url, transitions)
    keys, redis = run.keys, run.redis
    steps: dict[str, list[float]] = defaultdict(list)

    def took(step: str, since: float, n: int) -> float:
        now = time.process_time()
        steps[step].append((now - since) / n * 1e6)
        return now

    async with run.pool.acquire() as conn:
        await conn.execute(
            "CREATE TEMP TABLE IF NOT EXISTS bench_jobs (LIKE jobs);"
            " CREATE TEMP TABLE IF NOT EXISTS bench_transitions (LIKE job_transitions)"
        )
        for _ in range(3):
            t = time.process_time()
            raw: list[tuple[int, Any, Any]] = []
            for s in range(SHARDS):
                low = "-"
                while got := await redis.xrange(keys.log(s), min=low, count=batch // SHARDS):
                    raw += [(s, i, f) for i, f in got]
                    last = got[-1][0]
                    low = "(" + (last.decode() if isinstance(last, bytes) else str(last))
            n = sum(transition_count(f) for _, _, f in raw)  # transitions (an entry: a call's)
            t = took("read the log (redis-py)", t, n)
            entries = [e for s, i, f in raw for e in parse_entries(s, i, f)]
            t = took("decode entries (parse_entries)", t, n)
            chunks = [entries[i : i + batch] for i in range(0, n, batch)]
            rows = [collapse(c) for c in chunks]
            t = took("collapse per job", t, n)
            jobs = [job_records(r) for r in rows]
            t = took("job row records", t, n)
            history = [
                transition_records(sorted(c, key=lambda e: (e.status.id, e.status.version)))
                for c in chunks
            ]
            t = took("transition records (sorted)", t, n)
            for records in jobs:
                await conn.copy_records_to_table("bench_jobs", records=records, columns=JOB_COLUMNS)
            t = took("COPY job rows (client)", t, n)
            for records in history:
                await conn.copy_records_to_table(
                    "bench_transitions", records=records, columns=TRANSITION_COLUMNS
                )
            t = took("COPY transitions (client)", t, n)
            pipe = redis.pipeline(transaction=False)
            for s in range(SHARDS):
                ids = [i for shard, i, _ in raw if shard == s]
                for k in range(0, len(ids), batch):
                    pipe.xack(keys.log(s), keys.persist_group(), *ids[k : k + batch])
            await pipe.execute(raise_on_error=False)  # no group: only the client's part counts
            took("XACK (client)", t, n)
            await conn.execute("TRUNCATE bench_jobs, bench_transitions")
    return {k: round(statistics.median(v), 2) for k, v in steps.items()}


def _pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


BEFORE, AFTER = "process-before", "process-after"  # jobtier persister at --before / this tree


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    env = environment()  # the code measured and the machine: read before the runs, not after
    before_tree = baseline_tree(args.before) if args.before else None
    folder = Path(tempfile.mkdtemp(prefix="jobtier-bench-"))
    # a folder of its own: Postgres runs as another user, who cannot enter `folder` (0700)
    pg = LocalPostgres(Path(tempfile.mkdtemp(prefix="jobtier-bench-pg-")), durable=True)
    redis = LocalRedis(folder / "redis").start()
    try:
        pg.start()
        await migrate(pg.dsn)
        pool = await create_pool(pg.dsn, max_size=4)
        runs: list[dict[str, Any]] = []
        for i in range(args.runs):
            results: dict[str, Any] = {v: {} for v in args.variants}
            # The two batch writers, alternated (A B B A …) and measured `pairs` times each:
            # on a shared machine, load drifts within a run, and one sample each misleads.
            writers = [v for v in ("batched", "unnest") if v in args.variants]
            samples: dict[str, list[dict[str, Any]]] = {v: [] for v in writers}
            for p in range(args.pairs):
                for variant in writers if p % 2 == 0 else writers[::-1]:
                    run = Run(redis, pg, pool, variant)
                    samples[variant].append(await run.throughput(args.backlog, 60))
                    await run.redis.aclose()
            for variant, got in samples.items():
                results[variant]["throughput"] = _median_of(got)
                print(f"run {i + 1} {variant} throughput {results[variant]['throughput']}")
            if before_tree is not None:
                # `jobtier persister` at --before and at this tree, alternated the same way
                trees = {BEFORE: before_tree, AFTER: None}
                order = list(trees)
                got_p: dict[str, list[dict[str, Any]]] = {v: [] for v in order}
                for p in range(args.pairs):
                    for variant in order if p % 2 == 0 else order[::-1]:
                        run = Run(redis, pg, pool, "batched")
                        sample = await PersisterProcess(run, trees[variant]).throughput(
                            args.backlog, 120
                        )
                        sample["load_average"] = round(os.getloadavg()[0], 1)
                        got_p[variant].append(sample)
                        print(f"run {i + 1} {variant} sample {sample}")
                        await run.redis.aclose()
                for variant, got in got_p.items():
                    results[variant] = {"throughput": _median_of(got), "samples": got}
            for variant in [v for v in args.variants if v != "unnest"]:
                run = Run(redis, pg, pool, variant)
                if variant == "baseline":
                    results[variant]["throughput"] = await run.throughput(
                        args.backlog, args.seconds
                    )
                    print(f"run {i + 1} {variant} throughput {results[variant]['throughput']}")
                for rate in args.rates:
                    # the baseline cannot catch up: no point waiting the whole drain time
                    drain = args.drain if variant != "baseline" else min(args.drain, 2.0)
                    r = await run.sustained(rate, args.seconds, drain)
                    results[variant][f"sustained_{int(rate)}"] = r
                    print(f"run {i + 1} {variant} sustained {r}")
                await run.redis.aclose()
            results["load_average"] = {"1min": round(os.getloadavg()[0], 1)}  # others' work
            runs.append(results)
        profile = None
        if args.profile:
            run = Run(redis, pg, pool, "batched")
            size = Settings().persist_batch_size
            steps = await persister_steps(run, args.backlog // 2, size)
            print(f"persister steps: {steps}")
            profile = await postgres_profile(run, args.backlog // 2, size)
            profile["persister_steps"] = steps
            await run.redis.aclose()
        await pool.close()
    finally:
        redis.stop()
        pg.destroy()
        shutil.rmtree(folder, ignore_errors=True)
    return {
        "command": " ".join(["bench/persist.py", *sys.argv[1:]]),
        "date": env["date"],
        "machine": env["machine"],
        "versions": env["versions"],
        "commit": env["commit"],
        "before": args.before,
        "runs": runs,
        "medians": _medians(runs),
        "postgres_profile": profile,
    }


def _median_of(samples: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        k: statistics.median(s[k] for s in samples)
        if isinstance(v, int | float) and not isinstance(v, bool)
        else v
        for k, v in samples[0].items()
    }


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for variant, measures in runs[0].items():
        if variant == "load_average":
            continue
        out[variant] = {}
        for measure, values in measures.items():
            if not isinstance(values, dict):  # the samples behind a median
                continue
            out[variant][measure] = {
                k: statistics.median(r[variant][measure][k] for r in runs)
                for k, v in values.items()
                if isinstance(v, int | float) and not isinstance(v, bool)
            }
    return out


def report(result: dict[str, Any], args: argparse.Namespace) -> str:
    med = result["medians"]
    loads = ", ".join(str(r["load_average"]["1min"]) for r in result["runs"])
    lines = [
        "# Write-behind persister: batched vs baseline",
        "",
        f"`.venv/bin/python {result['command']}` at commit {result['commit']} on "
        f"{os.cpu_count()} cores "
        f"({platform.machine()}, Python {platform.python_version()}), {time.strftime('%Y-%m-%d')}"
        f"; load average after each run: {loads}."
        f" Redis and Postgres local, Postgres durable (fsync and synchronous_commit on),",
        f"{SHARDS} shards, batch size {Settings().persist_batch_size}, interval "
        f"{Settings().persist_interval}s. Medians of {args.runs} run(s); the backlog figures "
        f"are medians of {args.pairs} alternated samples per run.",
        "",
    ]
    if args.before:
        lines += _before_after(result, args)
    in_process = {v: m for v, m in med.items() if v in VARIANTS}
    if in_process:
        lines += _in_process(in_process, args)
    if result.get("postgres_profile"):
        lines += _profile(result["postgres_profile"], args)
    return "\n".join(lines) + "\n"


def _profile(profile: dict[str, Any], args: argparse.Namespace) -> list[str]:
    steps = profile.get("persister_steps")
    labels = [label for label in profile if label != "persister_steps"]
    lines = [
        "",
        "## Where Postgres's µs go, per statement, before and after (`--profile`)",
        "",
        f"A backlog of {args.backlog // 2:,} transitions written in batches of "
        f"{Settings().persist_batch_size:,}, by the path every batch took before the straight "
        "COPY (`staged`: each row COPYed into a staging table, then merged by `upsert_jobs` "
        "and `insert_transitions`) and by `write_batch`'s (`direct`: the rows of jobs Postgres "
        "has merged the same way, new jobs' rows and every transition COPYed straight into "
        "their tables), alternated in the same run (medians of the samples each got). "
        "Statements under EXPLAIN (ANALYZE, BUFFERS, WAL), their triggers included: execution "
        "time and WAL per transition; COPY timed from the client (its encoding and the "
        "triggers it fires included). Then the direct path without the triggers that keep "
        "`jobs_by_state` (the listing by state), then also without the secondary indexes of "
        "`jobs` (listings, console, retention), to show what maintaining them costs.",
        "",
        "| statement | " + " | ".join(f"{label}: µs / WAL bytes" for label in labels) + " |",
        "|---|" + "---|" * len(labels),
    ]
    names = list(dict.fromkeys(n for label in labels for n in profile[label]["us"]))
    for name in names:
        cells = []
        for label in labels:
            p = profile[label]
            if name in p["us"]:
                cells.append(f"{p['us'][name]:.1f} / {p['wal_bytes'].get(name, 0):,.0f}")
            else:
                cells.append("—")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append(
        "| all statements | "
        + " | ".join(f"{sum(profile[label]['us'].values()):.1f}" for label in labels)
        + " |"
    )
    lines.append(
        "| Postgres CPU, every server process (µs a transition) | "
        + " | ".join(f"{profile[label]['postgres_cpu_us']:.1f}" for label in labels)
        + " |"
    )
    lines.append(
        "| WAL written in all, by record type (records: bytes per transition) | "
        + " | ".join(
            f"{profile[label]['wal_total_bytes']:,.0f}: "
            + ", ".join(
                f"{k} {v['records']:.1f}: {v['bytes']:,}"
                for k, v in sorted(
                    profile[label]["wal_by_kind"].items(), key=lambda kv: -kv[1]["bytes"]
                )
                if v["bytes"] >= 5
            )
            for label in labels
        )
        + " |"
    )
    if steps:
        lines += [
            "",
            "## Where the persister's own µs go (`--profile`)",
            "",
            f"Each step of the persister's work on a backlog of {args.backlog // 2:,} transitions,"
            " timed apart in the bench's process: CPU µs a transition, medians of three passes. "
            "The code is the same before and after the straight COPY but for the write (COPY "
            "into staging tables, or straight into the tables: the client's part is the same). "
            "The persister process spends more in all (the `jobtier persister` table above): "
            "its event loop, asyncpg's protocol, its bookkeeping.",
            "",
            "| step | µs a transition |",
            "|---|---|",
            *(f"| {step} | {us:.2f} |" for step, us in steps.items()),
            f"| all these steps | {sum(steps.values()):.2f} |",
        ]
    return lines


def _before_after(result: dict[str, Any], args: argparse.Namespace) -> list[str]:
    med = result["medians"]
    lines = [
        f"## `jobtier persister` at `{args.before}` and at this tree",
        "",
        f"A backlog of {args.backlog:,} transitions (chunks of 4,000 jobs: submits, then their "
        "claims, then completions), drained by `jobtier persister` in a process of its own "
        "(held with SIGSTOP while the backlog is made; start-up not counted). CPU: the "
        "persister process's (/proc), Postgres's (every server process) and Redis's (its "
        "process: the persister's reads and acknowledgements, and the bench's checks of what "
        "is left, every 50 ms), per transition.",
        "",
        "| code | backlog drained (transitions/s) | CPU µs per transition: persister + Postgres "
        "+ Redis = total | load average at each sample |",
        "|---|---|---|---|",
    ]
    for variant, label in ((BEFORE, f"`{args.before}`"), (AFTER, "this tree")):
        t = med[variant]["throughput"]
        total = t["persister_cpu_us"] + t["postgres_cpu_us"] + t["redis_cpu_us"]
        samples = [
            str(r[variant]["samples"][k]["load_average"])
            for r in result["runs"]
            for k in range(len(r[variant]["samples"]))
        ]
        lines.append(
            f"| {label} | {t['per_second']:,.0f} | {t['persister_cpu_us']:.1f} + "
            f"{t['postgres_cpu_us']:.1f} + {t['redis_cpu_us']:.1f} = {total:.1f} | "
            f"{', '.join(samples)} |"
        )
    lines += [
        "",
        "Redis's side, command by command: the time spent inside each command per transition "
        "(`INFO commandstats`), which is wall time on Redis's clock, so it can exceed the "
        "process's CPU when the cores are shared; writing the replies and feeding the AOF "
        "happen outside the commands.",
        "",
        "| code | "
        + " | ".join(f"{c.replace('|', ' ')} µs" for c in REDIS_COMMANDS)
        + " | Redis process CPU µs |",
        "|---|" + "---|" * (len(REDIS_COMMANDS) + 1),
    ]
    for variant, label in ((BEFORE, f"`{args.before}`"), (AFTER, "this tree")):
        t = med[variant]["throughput"]
        cells = [f"{t[f'redis_{c}_us']:.2f}" for c in REDIS_COMMANDS]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {t['redis_cpu_us']:.1f} |")
    lines.append("")
    return lines


def _in_process(med: dict[str, Any], args: argparse.Namespace) -> list[str]:
    lines = [
        "## In-process variants",
        "",
        "| variant | backlog drained (transitions/s) | CPU µs per transition (persister + Postgres) | transitions per commit | "
        + " | ".join(f"lag p50 / p99 at {int(r)}/s" for r in args.rates)
        + " |",
        "|---|---|---|---|" + "---|" * len(args.rates),
    ]
    for variant, m in med.items():
        t = m["throughput"]
        cpu = f"{t['persister_cpu_us']:.0f} + {t['postgres_cpu_us']:.0f}"
        batch = "1 (autocommit)" if variant == "baseline" else f"{t['mean_batch']:,.0f}"
        cells = [variant, f"{t['per_second']:,.0f}", cpu, batch]
        for rate in args.rates:
            s = m.get(f"sustained_{int(rate)}")
            if s is None:
                cells.append("—")
            else:
                behind = (
                    f" ({s['unpersisted']:,.0f} left after the run)" if s["unpersisted"] else ""
                )
                cells.append(f"{s['p50_ms']:,.0f} ms / {s['p99_ms']:,.0f} ms{behind}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "In the bench's process: its bookkeeping of each commit (lags) is counted in the",
        "persister's CPU, and the process keeps Python's default collector settings.",
        "Lag = commit time - the log entry's id time (when the Lua script made the transition).",
        "Backlog: transitions already in the log, drained as fast as possible (the baseline is",
        f"given {args.seconds:.0f} s). Sustained: produced at the rate by another process for "
        f"{args.seconds:.0f} s; a",
        "baseline that cannot keep up leaves entries behind, counted with their age so far.",
        "`batched` writes each batch as the persister does (`write_batch`: binary COPY, straight",
        "into the tables or through staging tables); `unnest` merges every row by statements",
        "fed by array parameters instead.",
    ]
    if "batched" in med and "unnest" in med:
        c, u = med["batched"]["throughput"], med["unnest"]["throughput"]
        cpu_c = c["persister_cpu_us"] + c["postgres_cpu_us"]
        cpu_u = u["persister_cpu_us"] + u["postgres_cpu_us"]
        lines.append(
            f"COPY vs unnest: {c['per_second']:,.0f} vs {u['per_second']:,.0f} transitions/s, "
            f"{cpu_c:.0f} vs {cpu_u:.0f} µs of CPU per transition."
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--pairs", type=int, default=2, help="COPY/unnest samples per run")
    parser.add_argument("--backlog", type=int, default=120_000, help="transitions to drain")
    parser.add_argument("--rates", type=float, nargs="+", default=[5_000, 10_000])
    parser.add_argument("--seconds", type=float, default=8.0, help="length of sustained runs")
    parser.add_argument("--drain", type=float, default=10.0, help="wait for the rest after")
    parser.add_argument(
        "--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS),
        help="in-process variants to run (none: only the --before comparison)",
    )  # fmt: skip
    parser.add_argument(
        "--profile", action="store_true",
        help="also profile Postgres's side per statement (EXPLAIN ANALYZE, WAL), last",
    )  # fmt: skip
    parser.add_argument(
        "--before", metavar="REV",
        help="also run `jobtier persister` at git revision REV and at this tree, alternated",
    )  # fmt: skip
    parser.add_argument(
        "--name", default="persist", help="results file name in bench/results (persist)"
    )
    parser.add_argument("--generate", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.generate:
        url, rate, seconds = args.generate
        asyncio.run(generate(url, float(rate), float(seconds)))
        return
    result = asyncio.run(bench(args))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    md = report(result, args)
    (RESULTS / f"{args.name}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
