"""Benchmark: jobtier beside BullMQ, SAQ, arq, Celery, RQ and Dramatiq, all measured here.

Every system runs the same workload through its own client and worker, on the same Redis:
``--jobs`` (20K) no-op jobs, one worker process at concurrency 50 where the system has the
notion, the producer in a process of its own. For each (system, Redis mode, run):

* a fresh ``redis-server`` (loopback, its own temporary folder and free port; ``noeviction``)
  with the append-only file off or ``everysec`` (``--modes``). jobtier refuses a Redis without
  AOF unless ``JOBTIER_REDIS_REQUIRE_AOF=0``, which the AOF-off mode sets;
* enqueue: the producer alone (no worker running) enqueues every job by the system's fastest
  documented method (bulk where it exists); jobs/s from its first enqueue to its last
  returning. Redis is then emptied (FLUSHALL, AOF rewritten small: ``common.fresh``);
* end to end: the worker process is started and left idle (0.5 s after it says it is ready),
  then the producer enqueues the jobs again; jobs/s from the first enqueue to the last job
  finished as the system itself reports it (its completion event or hook, in the worker);
* Redis's side of the end-to-end phase (``common.RedisMeter``), per job: CPU (INFO cpu,
  ``used_cpu_user`` + ``used_cpu_sys``); commands (INFO commandstats: commands run inside Lua
  scripts count, as they do in INFO stats ``total_commands_processed``; the bench's own INFO
  and CONFIG are left out); AOF bytes: what the redis-server process wrote to files
  (``/proc/<pid>/io`` wchar less the bytes it sent to clients), which keeps counting across
  an AOF rewrite, ~0 with AOF off;
* the worker process's CPU over the same phase (``/proc/<pid>/stat``; jobtier's from the
  worker itself).

Runs are interleaved round-robin (run 1: every system in every mode, then run 2, ...) so a
slow spell on this shared machine lands on all of them; figures are medians of the runs, and
each system's end-to-end rate is also given against BullMQ's in the same mode: the median of
the per-run ratios (run i against run i; ``ratios.py``), each run's ratio kept in the JSON.

The peers are driven by small programs of ours under ``bench/compare/`` written against their
documented APIs; each file's docstring says how it enqueues and what it counts as finished:

* BullMQ (``compare/bullmq/``, Node; pinned in ``package-lock.json``): ``Queue.addBulk``, 500
  per call; ``Worker`` at concurrency 50, its ``completed`` event. Node and npm come from
  Debian (``apt-get install nodejs npm``) when missing; ``npm ci`` on first use.
* SAQ, arq, Celery, RQ, Dramatiq (``compare/drivers/``): each in a virtualenv of its own,
  ``compare/.venv/<peer>/``, from ``compare/requirements/<peer>.txt`` (every version pinned),
  made on first use: their dependencies conflict with each other (arq needs redis-py < 6,
  Celery's kombu >= 6.4) and never mix with jobtier's.
* jobtier: ``throughput.py``'s enqueue and end-to-end measurements (``submit_many`` 500 per
  call; one ``Worker`` process at concurrency 50, 16 shards; the last job's ``succeeded``
  transition in the shard logs).

A system that fails or exceeds ``--timeout`` in a run is reported as such, and the others go
on. Every redis-server and driver process is stopped on every way out (process groups).

    .venv/bin/python bench/compare.py                    # 20K jobs, 3 runs, both modes
    .venv/bin/python bench/compare.py --quick            # 2K jobs, 1 run: a smoke test
    .venv/bin/python bench/compare.py --systems jobtier,bullmq --modes everysec --runs 5
    jobtier bench compare --quick                        # the same, through the CLI

Results: bench/results/compare.json and bench/results/compare.md.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvloop
from redis.asyncio import Redis

sys.path.insert(0, str(Path(__file__).resolve().parent))

import throughput
from common import (
    RedisMeter,
    baseline_tree,
    environment,
    fmt,
    fresh,
    header_markdown,
    local_redis,
    median,
    proc_cpu,
    save,
    table,
    tree_cpu,
)
from ratios import median_ratio, per_run_ratios

from jobtier.config import Settings, env_name
from jobtier.dev.local_redis import LocalRedis
from jobtier.engine.queue import Queue

HERE = Path(__file__).resolve().parent / "compare"
VENVS = HERE / ".venv"
BULLMQ = HERE / "bullmq"
BASELINE = "jobtier-baseline"  # jobtier at another git revision (--baseline), same run
PERSIST = "jobtier-persist"  # jobtier with its persister writing to Postgres (--persister)
# (--what-if no-by-state) the same, without the triggers that keep jobs_by_state
NO_BY_STATE = f"{PERSIST}-no-by-state"
# (--what-if hold) the same, live jobs' rows held a second (JOBTIER_PERSIST_HOLD_SECONDS=1)
HOLD = f"{PERSIST}-hold"
# (--persister-env NAME=VALUE,...) the same, its persister run with these settings
PERSIST_ENV = f"{PERSIST}-env"
# (--pg-settings NAME=VALUE,...) the same, on a Postgres with these settings added
PG_SET = f"{PERSIST}-pg"
# what the bench gives the persister itself (PersistHook.start)
BENCH_SETS = frozenset(
    {"JOBTIER_REDIS_URL", "JOBTIER_DATABASE_URL", "JOBTIER_SHARDS", "JOBTIER_REDIS_REQUIRE_AOF",
     "JOBTIER_LOG_LEVEL"}
)  # fmt: skip
BY_STATE_TRIGGERS = ("jobs_by_state_inserted", "jobs_by_state_updated", "jobs_by_state_deleted")
LAG_SAMPLE = 0.05  # s between write-behind lag samples
SYSTEMS = ("jobtier", "bullmq", "saq", "arq", "celery", "rq", "dramatiq")
MODES = ("off", "everysec")
SHARDS = 16  # jobtier's default
SETTLE = 0.5  # s a started worker is left idle before the end-to-end phase
STOP_GRACE = 5.0  # s between SIGTERM and SIGKILL for a driver's process group
# the peer, its redis client and the accelerators its virtualenv holds: reported with results
PEER_PACKAGES = {
    "saq": ("saq", "redis", "hiredis", "uvloop"),
    "arq": ("arq", "redis", "hiredis", "uvloop"),
    "celery": ("celery", "kombu", "redis", "hiredis"),
    "rq": ("rq", "redis", "hiredis"),
    "dramatiq": ("dramatiq", "redis", "hiredis"),
}


@dataclass(frozen=True)
class System:
    name: str
    label: str
    config: str  # how it is set up here, for the report


def systems(args: argparse.Namespace) -> dict[str, System]:
    c, b = args.concurrency, args.batch
    known = {
        s.name: s
        for s in (
            System(
                "jobtier", "jobtier",
                f"`Queue.submit_many`, {b} per call; 1 `Worker` process at concurrency {c}, "
                f"{SHARDS} shards, uvloop",
            ),
            System(
                "bullmq", "BullMQ",
                f"`Queue.addBulk`, {b} per call; `Worker` at concurrency {c}; defaults "
                "otherwise (completed jobs kept)",
            ),
            System(
                "saq", "SAQ",
                f"`Queue.enqueue`, {c} in flight (no bulk enqueue); `Worker` at concurrency "
                f"{c}; uvloop",
            ),
            System(
                "arq", "arq",
                f"`enqueue_job`, {c} in flight (no bulk enqueue); `Worker` max_jobs {c}, "
                "poll_delay 10 ms (default 0.5 s); uvloop",
            ),
            System(
                "celery", "Celery",
                "`apply_async`, one at a time through one producer (no bulk publish); "
                "`solo` pool, prefetch multiplier 4, no result backend",
            ),
            System(
                "rq", "RQ",
                f"`Queue.enqueue_many`, {b} per call; `SimpleWorker` (one job at a time)",
            ),
            System(
                "dramatiq", "Dramatiq",
                f"`Actor.send`, one at a time (no bulk enqueue); `Worker` with {c} threads, "
                "worker_timeout 100 ms (default 1 s)",
            ),
        )
    }  # fmt: skip
    for name, collation in args.persist_systems.items():
        if name == NO_BY_STATE:
            known[name] = System(
                name,
                "jobtier + persister, no jobs_by_state (what-if)",
                "the same as jobtier + persister, with the triggers that keep `jobs_by_state` "
                "disabled (`--what-if no-by-state`): what the write-behind would cost were the "
                "live jobs listed by state from elsewhere. Not a set-up jobtier offers: its "
                "listings by state are then wrong",
            )
            continue
        if name == HOLD:
            known[name] = System(
                name,
                "jobtier + persister, hold 1 s",
                "the same as jobtier + persister, with `JOBTIER_PERSIST_HOLD_SECONDS=1` "
                "(`--what-if hold`): a live job's row (its claim) held up to a second for its "
                "end to take its place unwritten",
            )
            continue
        if name == PERSIST_ENV:
            assigned = ", ".join(f"{k}={v}" for k, v in args.persister_env.items())
            known[name] = System(
                name,
                f"jobtier + persister, {assigned}",
                f"the same as jobtier + persister, its persister run with `{assigned}` "
                "(`--persister-env`), on a Postgres of its own",
            )
            continue
        if name == PG_SET:
            assigned = ", ".join(f"{k} = {v}" for k, v in args.pg_settings.items())
            known[name] = System(
                name,
                f"jobtier + persister, Postgres {assigned}",
                f"the same as jobtier + persister, on a Postgres of its own whose configuration "
                f"adds `{assigned}` (`--pg-settings`)",
            )
            continue
        named = len(args.collations) > 1 or collation != "C"  # C: as `jobtier run` makes it
        collated = f" created with LC_COLLATE `{collation}`" if named else ""
        known[name] = System(
            name,
            "jobtier + persister" + (f" ({collation})" if named else ""),
            "the same as jobtier, with `jobtier persister` (one process) writing every "
            f"transition to a durable Postgres (fsync on){collated} on this machine during the "
            "run",
        )
    # every jobtier process reads them: said of each jobtier system, but what it sets itself
    overrides = {HOLD: {"JOBTIER_PERSIST_HOLD_SECONDS"}, PERSIST_ENV: set(args.persister_env)}
    for name, s in list(known.items()):
        if name != "jobtier" and name not in args.persist_systems:
            continue
        inherited = sorted(set(args.inherited_env) - overrides.get(name, set()))
        if inherited:
            shell = ", ".join(f"`{k}={args.inherited_env[k]}`" for k in inherited)
            known[name] = System(s.name, s.label, f"{s.config}; from the shell: {shell}")
    if args.baseline:
        known[BASELINE] = System(
            BASELINE, f"jobtier at `{args.baseline}`",
            f"the same as jobtier, the code of git revision `{args.baseline}` (`--baseline`)",
        )  # fmt: skip
    for name, extra in args.driver_args.items():
        s = known[name]
        known[name] = System(s.name, s.label, f"{s.config}; driver arguments `{shlex.join(extra)}`")
    return known


# --- processes ----------------------------------------------------------------------------------
_groups: set[int] = set()  # process groups of live drivers: the atexit hook's safety net


@atexit.register
def _kill_leftovers() -> None:
    for pgid in list(_groups):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        _groups.discard(pgid)


class Driver:
    """One driver process in a session (process group) of its own.

    It reports on stdout in lines ``compare: {json}``; the rest of its stdout is read and
    dropped, its stderr goes to ``log``. ``stop()`` ends the whole group: SIGTERM, then SIGKILL.
    """

    def __init__(self, name: str, cmd: list[str], log: Path) -> None:
        self.name, self.cmd, self.log = name, cmd, log
        self.messages: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    async def start(self) -> Driver:
        with self.log.open("ab") as err:
            self.proc = await asyncio.create_subprocess_exec(
                *self.cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
                start_new_session=True,
                limit=1 << 20,
            )
        _groups.add(self.proc.pid)
        self._reader = asyncio.create_task(self._read())
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for line in self.proc.stdout:
            if line.startswith(b"compare: "):
                self.messages.put_nowait(json.loads(line[len(b"compare: ") :]))
        self.messages.put_nowait(None)

    async def expect(self, key: str) -> dict[str, Any]:
        """The next message that has ``key``; an error if the process ends first."""
        while True:
            message = await self.messages.get()
            if message is None:
                code = await self.proc.wait()
                raise RuntimeError(f"{self.name} exited with {code}: {self.log_tail()}")
            if key in message:
                return message

    async def finish(self) -> int:
        return await self.proc.wait()

    async def stop(self) -> None:
        pgid = self.proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), STOP_GRACE)
        except TimeoutError:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)  # stragglers of the group, and a leader that hung
        await self.proc.wait()
        _groups.discard(pgid)
        self._reader.cancel()

    def log_tail(self, lines: int = 3) -> str:
        text = self.log.read_text(errors="replace").strip().splitlines()
        return " / ".join(text[-lines:]) or "(no output on stderr)"


@contextlib.asynccontextmanager
async def driver(name: str, cmd: list[str], log: Path) -> AsyncIterator[Driver]:
    d = Driver(name, cmd, log)
    try:
        yield await d.start()
    finally:
        if hasattr(d, "proc"):
            await asyncio.shield(d.stop())


# --- setting the peers up -----------------------------------------------------------------------
def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _run(cmd: list[str], **kw: Any) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if out.returncode != 0:
        tail = (out.stderr or out.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {' / '.join(tail)}")


def python_peer(name: str) -> Path:
    """The peer's virtualenv python, made or brought up to its requirements file first."""
    venv = VENVS / name
    requirements = HERE / "requirements" / f"{name}.txt"
    python, stamp = venv / "bin" / "python", venv / ".installed"
    digest = _digest(requirements)
    if not (python.exists() and stamp.exists() and stamp.read_text() == digest):
        print(f"setting up {name} in {venv} ...", file=sys.stderr, flush=True)
        _run([sys.executable, "-m", "venv", "--clear", str(venv)])
        _run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
              "-r", str(requirements)])  # fmt: skip
        stamp.write_text(digest)
    return python


def node() -> str:
    """node, with BullMQ's packages installed (``npm ci``) from the committed lock file."""
    if not (shutil.which("node") and shutil.which("npm")):
        if os.geteuid() != 0:
            raise RuntimeError("node and npm are missing: `apt-get install nodejs npm`")
        print("installing nodejs and npm from Debian ...", file=sys.stderr, flush=True)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        _run(["apt-get", "update", "-q"], env=env)
        _run(["apt-get", "install", "-y", "-q", "nodejs", "npm"], env=env)
    stamp = BULLMQ / "node_modules" / ".compare-installed"
    digest = _digest(BULLMQ / "package-lock.json")
    if not (stamp.exists() and stamp.read_text() == digest):
        print("npm ci for BullMQ ...", file=sys.stderr, flush=True)
        _run(["npm", "ci", "--no-audit", "--no-fund"], cwd=BULLMQ)
        stamp.write_text(digest)
    return shutil.which("node") or "node"


def peer_versions(name: str, program: str) -> dict[str, str]:
    if name == "bullmq":
        out = subprocess.run([program, "--version"], capture_output=True, text=True)
        found = {"node": out.stdout.strip().lstrip("v")}
        for package in ("bullmq", "ioredis", "msgpackr"):
            meta = BULLMQ / "node_modules" / package / "package.json"
            found[package] = json.loads(meta.read_text())["version"] if meta.exists() else "-"
        return found
    code = (
        "import json, importlib.metadata as m\n"
        f"print(json.dumps({{p: m.version(p) for p in {PEER_PACKAGES[name]!r}}}))"
    )
    out = subprocess.run([program, "-c", code], capture_output=True, text=True, check=True)
    return dict(json.loads(out.stdout))


def command(name: str, program: str, role: str, url: str, args: argparse.Namespace) -> list[str]:
    common = ["--url", url, "--jobs", str(args.jobs), "--concurrency", str(args.concurrency),
              "--batch", str(args.batch)]  # fmt: skip
    extra = args.driver_args.get(name, [])
    if name == "bullmq":
        return [program, str(BULLMQ / "bench.mjs"), role, *common, *extra]
    script = HERE / "drivers" / f"drive_{name}.py"
    return [program, str(script), role, *common, "--in-flight", str(args.concurrency), *extra]


# --- one measurement ----------------------------------------------------------------------------
async def measure_peer(
    name: str, program: str, server: LocalRedis, args: argparse.Namespace
) -> dict[str, Any]:
    """Enqueue, then end to end, for one peer on a fresh Redis."""
    assert server.proc is not None
    n, url = args.jobs, server.url
    log = server.folder / f"{name}.log"
    produce = command(name, program, "enqueue", url, args)
    work = command(name, program, "worker", url, args)
    redis = Redis.from_url(url)
    try:
        await fresh(redis)
        async with driver(f"{name} producer", produce, log) as producer:
            enqueue = await producer.expect("t0")
            if await producer.finish():
                raise RuntimeError(f"{name} producer failed: {producer.log_tail()}")
        await fresh(redis)
        async with driver(f"{name} worker", work, log) as worker:
            await worker.expect("ready")
            await asyncio.sleep(SETTLE)
            meter = RedisMeter(redis, server.proc.pid)
            await meter.start()
            cpu0 = proc_cpu(worker.pid)
            async with driver(f"{name} producer", produce, log) as producer:
                submitted = await producer.expect("t0")
                if await producer.finish():
                    raise RuntimeError(f"{name} producer failed: {producer.log_tail()}")
            done = await worker.expect("done")
            redis_side = await meter.stop(n)
            cpu1 = proc_cpu(worker.pid)
        if done["completed"] != n:
            raise RuntimeError(
                f"{done['completed']} of {n} jobs completed, {done['failed']} failed"
            )
    finally:
        await redis.aclose()
    return {
        "enqueue_jobs_per_s": n / (enqueue["t1"] - enqueue["t0"]),
        "e2e_jobs_per_s": n / (done["done"] - submitted["t0"]),
        "e2e_seconds": done["done"] - submitted["t0"],
        "e2e_submit_jobs_per_s": n / (submitted["t1"] - submitted["t0"]),
        "worker_cpu_us_per_job": 1e6 * (cpu1 - cpu0) / n,
        "producer_cpu_us_per_job": 1e6 * submitted["cpu"] / n,
        **redis_side,
    }


class PersistHook:
    """(``--persister``) The persister beside the end-to-end phase: ``jobtier persister`` in
    a process of its own on the bench's Postgres (tables emptied first), and the write-behind
    lag sampled every ``LAG_SAMPLE`` s from the first submit until every transition is in
    Postgres: the age of the oldest transition not yet written (``streams.group.lag``), so each
    sample bounds the lag of every transition waiting then."""

    def __init__(
        self, queue: Queue, server: LocalRedis, args: argparse.Namespace, aof: bool, system: str
    ):
        self.queue, self.server, self.args, self.aof = queue, server, args, aof
        self.dsn, self.postgres_pid = args.postgres[system]  # its own Postgres (--collations)
        self.system = system
        self.samples: list[tuple[float, float]] = []  # (monotonic time, age in s) each
        self.proc: asyncio.subprocess.Process | None = None
        self.task: asyncio.Task[None] | None = None
        self.done = asyncio.Event()

    async def start(self) -> None:
        import asyncpg

        dsn = self.dsn
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute("TRUNCATE jobs, jobs_by_state, job_transitions, job_results CASCADE")
            self.updates0 = await job_updates(conn)
        finally:
            await conn.close()
        env = {
            **os.environ, "JOBTIER_REDIS_URL": self.server.url, "JOBTIER_DATABASE_URL": dsn,
            "JOBTIER_SHARDS": str(SHARDS), "JOBTIER_REDIS_REQUIRE_AOF": "1" if self.aof else "0",
            "JOBTIER_LOG_LEVEL": "WARNING",
        }  # fmt: skip
        if self.system == HOLD:
            env["JOBTIER_PERSIST_HOLD_SECONDS"] = "1"
        if self.system == PERSIST_ENV:
            env.update(self.args.persister_env)
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "jobtier.cli", "persister", env=env, start_new_session=True
        )
        _groups.add(self.proc.pid)
        group = self.queue.keys.persist_group()

        async def ready() -> bool:  # its consumer group exists on every shard's log
            for s in range(SHARDS):
                try:
                    groups = await self.queue.redis.xinfo_groups(self.queue.keys.log(s))
                except Exception:
                    return False
                if not any(g["name"] in (group, group.encode()) for g in groups):
                    return False
            return True

        async with asyncio.timeout(30):
            while not await ready():
                await asyncio.sleep(0.05)
        # where the CPU goes while it writes (its start-up not counted): the persister's, and
        # Postgres's (postmaster, backends, background processes)
        self.cpu0 = (time.monotonic(), proc_cpu(self.proc.pid), tree_cpu(self.postgres_pid))
        self.task = asyncio.create_task(self._sample())

    async def _sample(self) -> None:
        from jobtier.streams.group import oldest_waiting

        while not self.done.is_set():
            # the age only, no count: no entry read where one is pending (log_lag.lua).
            # Counting up to 100 waiting entries per shard cost Redis 41 us a job here (a fifth
            # of its CPU in these runs), and reading the oldest and the newest pending entry
            # whole, the age's way until 2026-12-06, about 5 ms of Redis a sample with entries
            # of 50 transitions: Redis CPU the persister and the jobs then went without.
            _, age = await oldest_waiting(self.queue.redis, self.queue.keys)
            self.samples.append((time.monotonic(), age))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.done.wait(), LAG_SAMPLE)

    async def stop(self, end: float) -> dict[str, Any]:
        from jobtier.streams.group import oldest_waiting

        deadline = time.monotonic() + self.args.timeout
        while time.monotonic() < deadline:
            waiting, _ = await oldest_waiting(self.queue.redis, self.queue.keys)
            if not waiting:
                break
            await asyncio.sleep(LAG_SAMPLE)
        persisted = time.time()
        assert self.task is not None and self.proc is not None
        t0, persister0, postgres0 = self.cpu0
        seconds = time.monotonic() - t0
        persister_cpu = proc_cpu(self.proc.pid) - persister0
        postgres_cpu = tree_cpu(self.postgres_pid) - postgres0
        self.done.set()  # the sampler ends at its next turn (no cancel inside a Redis call)
        try:
            await asyncio.wait_for(asyncio.shield(self.task), 60)
        except TimeoutError:  # a lag() call that never returns: cancel it after all
            self.task.cancel()
            print("persister step slow: the lag sampler did not stop in 60 s", file=sys.stderr)
        sampler_stopped = time.time()
        os.killpg(self.proc.pid, signal.SIGTERM)
        await self.proc.wait()
        _groups.discard(self.proc.pid)
        batches = await self._batches()
        updates, hot = await self._updates_since_start()
        steps = {
            "all written": persisted - end,
            "sampler stopped": sampler_stopped - persisted,
            "persister exited": time.time() - sampler_stopped,
        }
        if any(took > 5 for took in steps.values()):  # a stall seen in earlier sets: where
            took = ", ".join(f"{name} after {seconds:.1f} s" for name, seconds in steps.items())
            print(f"persister step slow: {took}", file=sys.stderr, flush=True)
        ordered = sorted(age for _, age in self.samples)
        first = self.samples[0][0] if self.samples else 0.0

        def pct(q: float) -> float:
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0

        return {
            "lag_p50_ms": 1000 * pct(0.50),
            "lag_p99_ms": 1000 * pct(0.99),
            "lag_max_ms": 1000 * (ordered[-1] if ordered else 0.0),
            "lag_samples": len(ordered),
            # where in the run the lag peaked: [s since the first sample, lag ms] per sample
            "lag_series": [[round(t - first, 3), round(1000 * age)] for t, age in self.samples],
            "persisted_after_last_job_s": persisted - end,
            "persister_cpu_us_per_transition": 1e6 * persister_cpu / (3 * self.args.jobs),
            "postgres_cpu_us_per_transition": 1e6 * postgres_cpu / (3 * self.args.jobs),
            "persister_cores": persister_cpu / seconds,
            "postgres_cores": postgres_cpu / seconds,
            "hot_update_share": hot / updates if updates else None,
            # how often a job's row was updated after its insert: 1 when each job's claim
            # reached Postgres in the batch of its end, 2 when every claim had a batch of its own
            "row_updates_per_job": updates / self.args.jobs,
            **batches,
        }

    async def _batches(self) -> dict[str, float | None]:
        """The persister's own account of its batches, from the metrics snapshot it published
        as it stopped: how many, their mean size, and on average how old a batch's oldest
        transition was when its write began (in the log, then waiting for a connection) and
        how long the write took. None where it published none (an older revision)."""
        from jobtier.metrics.histogram import merge
        from jobtier.metrics.snapshot import read_snapshots

        snaps = await read_snapshots(self.queue.redis, self.queue.keys)
        hists = merge(
            {name: h for name, per in s.histograms.items() for h in per.values()}
            for s in snaps
            if s.role == "persister"
        )

        def mean(name: str, scale: float = 1.0) -> float | None:
            h = hists.get(name)
            return scale * h["sum"] / h["count"] if h and h.get("count") else None

        sizes = hists.get("persister_batch_size")
        return {
            "batches": sizes["count"] if sizes else None,
            "batch_mean_size": mean("persister_batch_size"),
            "batch_wait_mean_ms": mean("persister_batch_wait_seconds", 1000),
            "batch_write_mean_ms": mean("persister_batch_write_seconds", 1000),
        }

    async def _updates_since_start(self) -> tuple[int, int]:
        """(updates, heap-only updates) of ``jobs`` rows since ``start``: what Postgres counted.
        The persister's sessions report theirs now and then and as they end, which may land
        just after its process has exited: read until the count holds for half a second."""
        import asyncpg

        conn = await asyncpg.connect(self.dsn)
        try:
            counted, steady = await job_updates(conn), 0
            for _ in range(50):
                await asyncio.sleep(0.1)
                now = await job_updates(conn)
                steady = steady + 1 if now == counted else 0
                counted = now
                if steady == 5:
                    break
        finally:
            await conn.close()
        return counted[0] - self.updates0[0], counted[1] - self.updates0[1]


async def job_updates(conn: Any) -> tuple[int, int]:
    """(updates, heap-only updates) of ``jobs`` in the database so far (pg_stat_user_tables)."""
    row = await conn.fetchrow(
        "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'jobs'"
    )
    return int(row["n_tup_upd"]), int(row["n_tup_hot_upd"])


async def measure_jobtier(
    server: LocalRedis, args: argparse.Namespace, aof: bool, persist: str | None = None
) -> dict[str, Any]:
    """throughput.py's enqueue and end-to-end measurements, with its worker processes;
    ``persist``: a persister system's name, to have the persister on during the end-to-end
    phase (PersistHook), writing to that system's Postgres."""
    env = {} if aof else {"JOBTIER_REDIS_REQUIRE_AOF": "0"}
    settings = Settings.from_env(env, redis_url=server.url, shards=SHARDS)
    targs = argparse.Namespace(
        jobs=args.jobs, batch=args.batch, timeout=args.timeout, workers=1, shards=SHARDS,
        concurrency=args.concurrency, queues=1, queue_names=throughput.queue_names(1),
        queue_concurrency=None, queue_rate=None,
    )  # fmt: skip
    # nothing looked up (as the producer process's Queue): the enqueue phase runs before
    # any worker has advertised the bench's task
    async with await Queue.connect(settings, catalog=False) as queue:
        enqueue = await throughput.measure_enqueue(queue, targs, single=False)
        hook = PersistHook(queue, server, args, aof, persist) if persist else None
        e2e = await throughput.measure_run(
            queue, server, targs, "jobtier", prefill=False, hook=hook
        )
    return {
        "enqueue_jobs_per_s": enqueue,
        "e2e_jobs_per_s": e2e["jobs_per_s"],
        "e2e_seconds": e2e["seconds"],
        "e2e_submit_jobs_per_s": e2e["submit_jobs_per_s"],
        **{k: e2e[k] for k in (
            "worker_cpu_us_per_job", "producer_cpu_us_per_job", "redis_cpu_us_per_job",
            "aof_bytes_per_job", "aof_rewrites", "redis_commands_per_job", "commands",
        )},
        **{k: v for k, v in e2e.items() if k.startswith(("lag_", "persisted_", "persister_", "postgres_", "hot_", "row_", "batch"))},
    }  # fmt: skip


async def measure_baseline(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """jobtier at ``--baseline``: that revision's own compare.py measures it, in a process
    whose imports (the scripts, the worker processes it starts) all come from that tree."""
    tree = Path(args.baseline_tree)
    code = (
        "import argparse, json, sys, uvloop\n"
        "import compare\n"
        f"ns = argparse.Namespace(**json.loads({json.dumps(json.dumps(NS_KEYS(args)))}))\n"
        "ns.driver_args = {}\n"
        "ns.persist_systems = {}\n"  # read by measure() since --collations
        f"print(json.dumps(uvloop.run(compare.measure('jobtier', None, {mode!r}, ns))))\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tree / 'src'}:{tree / 'bench'}"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, cwd=tree / "bench", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    if proc.returncode != 0:
        return {"error": f"baseline exited {proc.returncode}: {err.decode()[-800:]}"}
    return dict(json.loads(out.decode().strip().splitlines()[-1]))


def NS_KEYS(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in ("jobs", "batch", "timeout", "concurrency")}


async def measure(
    name: str, program: str | None, mode: str, args: argparse.Namespace
) -> dict[str, Any]:
    """One (system, mode, run) on a Redis of its own; failures become ``{"error": ...}``."""
    if name == BASELINE:
        return await measure_baseline(mode, args)
    persisting = args.persist_systems  # set by parse(), and by measure_baseline() for its child
    if program is None and name != "jobtier" and name not in persisting:
        return {"error": "not set up"}
    aof = mode == "everysec"
    t0 = time.monotonic()
    try:
        with local_redis(aof=aof) as server:
            async with asyncio.timeout(args.timeout):
                if name == "jobtier" or name in persisting:
                    persist = None if name == "jobtier" else name
                    return await measure_jobtier(server, args, aof, persist)
                assert program is not None
                return await measure_peer(name, program, server, args)
    except TimeoutError:
        return {"error": f"timed out after {time.monotonic() - t0:.0f} s"}
    except Exception as exc:  # a failing peer is a result, not a crash of the bench
        return {"error": f"{type(exc).__name__}: {exc}"[:1000]}


# --- summary ------------------------------------------------------------------------------------
HEADERS = (
    "system", "Redis", "enqueue jobs/s", "end-to-end jobs/s", "e2e vs BullMQ", "Redis CPU µs/job",
    "AOF bytes/job", "Redis commands/job", "worker CPU µs/job", "status",
)  # fmt: skip
FIELDS = (
    "enqueue_jobs_per_s", "e2e_jobs_per_s", "redis_cpu_us_per_job", "aof_bytes_per_job",
    "redis_commands_per_job", "worker_cpu_us_per_job", "producer_cpu_us_per_job",
)  # fmt: skip


LAG_FIELDS = (
    "lag_p50_ms", "lag_p99_ms", "lag_max_ms", "persisted_after_last_job_s",
    "persister_cpu_us_per_transition", "postgres_cpu_us_per_transition", "persister_cores",
    "postgres_cores", "hot_update_share", "row_updates_per_job", "batches", "batch_mean_size", "batch_wait_mean_ms",
    "batch_write_mean_ms",
)  # fmt: skip


def hot_cell(s: dict[str, Any]) -> str:
    """'<HOT share> of <updates a job>'; the share alone (or '-') from an older result."""
    share, updates = s.get("hot_update_share"), s.get("row_updates_per_job")
    if share is None:
        return "-"
    return f"{100 * share:.0f} %" + ("" if updates is None else f" of {updates:.2f} a job")


def cpu_cell(s: dict[str, Any], who: str) -> str:
    """'<µs a transition> (<cores>)' for the persister or Postgres; '-' from an older result."""
    us, cores = s.get(f"{who}_cpu_us_per_transition"), s.get(f"{who}_cores")
    if us is None or cores is None:
        return "-"
    return f"{fmt(us)} ({cores:.2f})"


def batch_cell(s: dict[str, Any]) -> str:
    """'<batches> (<mean size>): <wait> + <write>' (means, ms); '-' from an older result."""
    got = [s.get(k) for k in ("batches", "batch_mean_size", "batch_wait_mean_ms",
                              "batch_write_mean_ms")]  # fmt: skip
    if any(v is None for v in got):
        return "-"
    batches, size, wait, write = got
    return f"{fmt(batches)} ({fmt(size)}): {fmt(wait)} + {fmt(write)}"


def ratio_table(
    summary: dict[str, Any], args: argparse.Namespace, known: dict[str, System]
) -> list[str]:
    """jobtier's end-to-end rate (alone, at --baseline, with the persister) over each other
    system's: the median of the per-run ratios, the ratio of the two medians, then the
    ratios run by run."""
    rows = []
    for mode in args.modes:
        for name in args.systems:
            vs = summary.get(name, {}).get(mode, {}).get("e2e_vs") or {}
            for other, got in vs.items():
                ours = summary[name][mode].get("e2e_jobs_per_s")
                theirs = summary.get(other, {}).get(mode, {}).get("e2e_jobs_per_s")
                of_medians = f"{ours / theirs:.2f}x" if ours and theirs else "-"
                rows.append([
                    known[name].label, known[other].label,
                    "AOF off" if mode == "off" else "AOF everysec",
                    f"{got['median']:.2f}x", of_medians, ", ".join(f"{r:.2f}" for r in got["runs"]),
                ])  # fmt: skip
    if not rows:
        return []
    return [
        "End to end, one system over another: the median of the per-run ratios (run i "
        "against run i), which is the one to judge by; the ratio of the two medians (which "
        "pairs runs from different spells of a shared machine); then each run's ratio in run "
        "order.\n",
        table(
            ["system", "over", "Redis", "median of per-run ratios", "ratio of medians", "per run"],
            rows,
        )
        + "\n",
    ]


def capacity(
    summary: dict[str, Any], args: argparse.Namespace, known: dict[str, Any], cores: int
) -> list[str]:
    """What keeping up at jobtier's own end-to-end rate would take of this machine's
    ``cores``: the CPU a job costs on its path (Redis, worker, producer: the `jobtier` row)
    and in the write-behind (persister and Postgres, three transitions: the persister row),
    at the rate jobtier ran without the persister in the same runs."""
    rows = []
    for mode, name in [(m, n) for m in args.modes for n in args.persist_systems]:
        alone, persisted = summary.get("jobtier", {}).get(mode), summary.get(name, {}).get(mode)
        if not alone or not persisted or persisted.get("postgres_cpu_us_per_transition") is None:
            continue
        rate = alone["e2e_jobs_per_s"]
        path = sum(alone[f] for f in ("redis_cpu_us_per_job", "worker_cpu_us_per_job",
                                      "producer_cpu_us_per_job"))  # fmt: skip
        behind = 3 * (
            persisted["persister_cpu_us_per_transition"]
            + persisted["postgres_cpu_us_per_transition"]
        )
        if not all(math.isfinite(x) for x in (rate, path, behind)):  # no run of one went well
            continue
        more_redis = persisted["redis_cpu_us_per_job"] - alone["redis_cpu_us_per_job"]
        rows.append([
            known[name].label, "AOF off" if mode == "off" else "AOF everysec", fmt(rate),
            f"{fmt(path)} ({rate * path / 1e6:.2f})", f"{fmt(behind)} ({rate * behind / 1e6:.2f})",
            fmt(more_redis), f"{rate * (path + behind) / 1e6:.2f} of {cores}",
            fmt(cores * 1e6 / (path + behind)),
        ])  # fmt: skip
    if not rows:
        return []
    return [
        "What keeping up at jobtier's own rate takes: the CPU a job costs on its path (Redis, "
        "the worker and the producer, from the `jobtier` row) and in the write-behind (the "
        "persister and Postgres for its three transitions, from the persister row), in cores "
        "at the rate jobtier ran end to end without the persister (medians of the same runs). "
        "Left out of it: the Redis CPU the persister's reads and acknowledgements cost, so the "
        "write-behind's column is a floor; the column beside it is how much more Redis CPU a "
        "job took in the persister row than in the `jobtier` row (their reads and "
        "acknowledgements, the lag sampler's reads, and whatever sharing the cores with "
        "Postgres and the persister costs Redis; bench/persist.py splits it by command). Where the two need more than the machine's "
        "cores, the persister cannot keep up at that rate here: the run with it on goes "
        "slower, and the lag follows from how the cores are shared. The last column is an "
        "upper bound: the rate the machine's cores would allow with the write-behind if every "
        "one of them were kept busy, which the path alone does not do (it waits on Redis, "
        "one thread, as one persister is one process).\n",
        table(["system", "Redis", "jobtier alone, jobs/s", "job path µs a job (cores)",
               "write-behind µs a job (cores)", "Redis µs a job more with the persister",
               "cores needed", "jobs/s the cores allow, at most"],
              rows) + "\n",
    ]  # fmt: skip


def summarise(runs: list[dict[str, dict[str, dict[str, Any]]]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for run in runs:
        for name, modes in run.items():
            for mode, result in modes.items():
                summary.setdefault(name, {}).setdefault(mode, {"ok": [], "errors": []})
                cell = summary[name][mode]
                (cell["errors"] if "error" in result else cell["ok"]).append(result)
    out: dict[str, Any] = {}
    for name, modes in summary.items():
        for mode, cell in modes.items():
            s: dict[str, Any] = {f: median([r[f] for r in cell["ok"]]) for f in FIELDS}
            for f in LAG_FIELDS:
                got = [r[f] for r in cell["ok"] if r.get(f) is not None]
                s[f] = median(got) if got else None
            s["runs_ok"] = len(cell["ok"])
            s["errors"] = [r["error"] for r in cell["errors"]]
            out.setdefault(name, {})[mode] = s
    ours = [n for n in out if n == "jobtier" or n == BASELINE or n.startswith(PERSIST)]
    for name, modes in out.items():
        for mode, s in modes.items():
            # each run against BullMQ's in the same run, then the median of those ratios (a
            # ratio of medians would pair runs from different spells of this shared machine)
            got = per_run_ratios(runs, name, "bullmq", mode)
            s["e2e_vs_bullmq_runs"] = got
            s["e2e_vs_bullmq"] = median_ratio(got)
            bull = out.get("bullmq", {}).get(mode, {}).get("e2e_jobs_per_s", float("nan"))
            of_medians = s["e2e_jobs_per_s"] / bull if bull else float("nan")
            s["e2e_vs_bullmq_of_medians"] = of_medians if math.isfinite(of_medians) else None
            if name not in ours:
                continue
            s["e2e_vs"] = {}  # every other system of the set, as in "jobtier 5x SAQ"
            for other in out:
                ratios = per_run_ratios(runs, name, other, mode) if other != name else []
                if ratios:
                    s["e2e_vs"][other] = {"median": median_ratio(ratios), "runs": ratios}
    return out


def render(
    summary: dict[str, Any],
    args: argparse.Namespace,
    env: dict[str, Any],
    known: dict[str, System],
) -> str:
    out = [header_markdown("Compare: jobtier and other Redis job systems, measured here", env)]
    peers = env["versions"].get("peers", {})
    if peers:
        out.append(
            "- peers: "
            + "; ".join(
                f"{known[n].label}: " + ", ".join(f"{p} {v}" for p, v in vs.items())
                for n, vs in peers.items()
            )
            + "\n"
        )
    if args.quick:
        out.append(
            f"> **Smoke run** (`--quick`: {args.jobs:,} jobs, 1 run): it shows that every "
            "system runs end to end through this harness. Not figures to cite: take those "
            "from a full run (`bench/compare.py`, 20K jobs, 3 runs) on a quiet machine.\n",
        )
    out.append(
        f"{args.jobs:,} no-op jobs per phase, one worker process, concurrency "
        f"{args.concurrency} where the system has the notion; producer in a process of its "
        f"own. A fresh redis-server per (system, mode, run): AOF off or `everysec`, "
        f"`noeviction`. {args.runs} interleaved run(s); medians, and each ratio the median of the "
        "per-run ratios (run i of one system over run i of the other, same mode). Enqueue: producer alone, "
        "first enqueue to last. End to end: worker started and idle, then the producer; first "
        "enqueue to the last job finished as the system reports it. Redis CPU, commands "
        "(inside Lua scripts included) and AOF bytes (the redis-server process's file writes) "
        "over the end-to-end phase, per job; worker CPU likewise.\n"
    )
    rows = []
    for mode in args.modes:
        for name in args.systems:
            s = summary.get(name, {}).get(mode)
            if s is None:
                continue
            ratio = s["e2e_vs_bullmq"]
            status = "ok"
            if s["errors"]:  # the whole message is in the .json file
                status = f"{s['runs_ok']}/{s['runs_ok'] + len(s['errors'])} ok; "
                status += textwrap.shorten(s["errors"][-1], 90, placeholder=" ...")
            label = f"**{known[name].label}**" if name == "jobtier" else known[name].label
            if name == BASELINE:
                label = f"*{known[name].label}*"
            rows.append(
                [
                    label,
                    "AOF off" if mode == "off" else "AOF everysec",
                    fmt(s["enqueue_jobs_per_s"]),
                    fmt(s["e2e_jobs_per_s"]),
                    "-" if ratio is None else f"{ratio:.2f}x",
                    fmt(s["redis_cpu_us_per_job"]),
                    fmt(s["aof_bytes_per_job"]),
                    fmt(s["redis_commands_per_job"], 1),
                    fmt(s["worker_cpu_us_per_job"]),
                    status.replace("|", "/"),
                ]
            )
    out.append(table(HEADERS, rows) + "\n")
    out.extend(ratio_table(summary, args, known))
    lag_rows = []
    for mode, name in [(m, n) for m in args.modes for n in args.persist_systems]:
        s = summary.get(name, {}).get(mode)
        if s is None or s.get("lag_p99_ms") is None:
            continue
        lag_rows.append([
            known[name].label, "AOF off" if mode == "off" else "AOF everysec",
            fmt(s["e2e_jobs_per_s"]), fmt(3 * s["e2e_jobs_per_s"]), fmt(s["lag_p50_ms"]),
            fmt(s["lag_p99_ms"]), fmt(s["lag_max_ms"]), fmt(s["persisted_after_last_job_s"], 2),
            cpu_cell(s, "persister"), cpu_cell(s, "postgres"),
            hot_cell(s),
            batch_cell(s),
        ])  # fmt: skip
    if lag_rows:
        out.append(
            "Write-behind with the persister on (the `jobtier + persister` rows above): the "
            f"age of the oldest transition not yet in Postgres, sampled every {LAG_SAMPLE * 1000:.0f} ms "
            "from the first submit until all are written (so each sample bounds the lag of "
            "every transition waiting then); medians over the runs. CPU: the persister "
            "process's, and Postgres's (every server process), from the persister's start to "
            "the last transition written, per transition, and the cores that makes on average "
            f"(the machine has {env['machine']['nproc']}, shared with Redis, the worker and the "
            "producer). HOT: the "
            "share of the updates of job rows that were heap-only (no index entry written; "
            "Postgres's own count), of how many updates a job's row had after its insert (1 "
            "when a job's claim reached Postgres in the batch of its end, 2 when in one of its "
            "own). Batches: how many the persister committed (their mean "
            "size), and on average how old a batch's oldest transition was when its write "
            "began (in the log, then in the persister until one of its concurrent writes was free) plus "
            "how long the write took, commit included: about the lag of that transition when "
            "committed (the persister's own metrics).\n"
        )
        out.append(
            table(["system", "Redis", "jobs/s", "transitions/s", "lag p50 ms", "lag p99 ms",
                   "lag max ms",
                   "all in Postgres after the last job, s",
                   "persister CPU µs a transition (cores)",
                   "Postgres CPU µs a transition (cores)", "HOT updates of the row updates",
                   "batches (mean size): waited + written, ms"], lag_rows) + "\n"
        )  # fmt: skip
        out.extend(capacity(summary, args, known, env["machine"]["nproc"] or 1))
    out.append("How each system is driven (our code under `bench/compare/`):\n")
    out.extend(f"- {known[n].label}: {known[n].config}" for n in args.systems)
    out.append(
        "\nCompare ratios within one run set rather than absolute figures across days: other "
        "work on this machine moves every figure (see the load average above).\n"
    )
    return "\n".join(out)


# --- main ---------------------------------------------------------------------------------------
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"subset of {','.join(SYSTEMS)}")
    p.add_argument("--modes", default=",".join(MODES), help="Redis AOF modes: off,everysec")
    p.add_argument("--jobs", type=int, default=20_000, help="jobs per phase (20000)")
    p.add_argument("--runs", type=int, default=3, help="interleaved runs; medians (3)")
    p.add_argument("--concurrency", type=int, default=50, help="per worker (50)")
    p.add_argument("--batch", type=int, default=500, help="jobs per bulk enqueue call (500)")
    p.add_argument(
        "--timeout", type=float, default=300.0, help="bound on one system in one mode and run, s"
    )
    p.add_argument(
        "--driver-args",
        action="append",
        default=[],
        metavar="SYSTEM=ARGS",
        help="more arguments for a peer's driver, to try another set-up (e.g. "
        "'celery=--pool threads'; see its --help); repeatable, shown in the report",
    )
    p.add_argument(
        "--baseline",
        metavar="REV",
        help="also measure jobtier at this git revision, in the same interleaved runs (before "
        "and after a change, beside the peers)",
    )
    p.add_argument(
        "--persister",
        action="store_true",
        help="also measure jobtier with its persister writing to a durable Postgres (started "
        "by the bench), and the write-behind lag meanwhile",
    )
    p.add_argument(
        "--collations",
        default="C",
        metavar="NAME,...",
        help="with --persister: the LC_COLLATE its Postgres is created with (C, as `jobtier "
        "run` does). More than one: one Postgres each, and the persister measured on each in "
        "the same interleaved runs, the first as jobtier-persist, the others as "
        "jobtier-persist@NAME (e.g. C,C.UTF-8)",
    )
    p.add_argument(
        "--what-if",
        choices=["no-by-state", "hold"],
        help="with --persister: also measure it on a Postgres of its own whose jobs_by_state "
        "triggers are disabled (no-by-state), what the listing by state costs the write-behind, "
        "not a set-up jobtier offers; or with JOBTIER_PERSIST_HOLD_SECONDS=1 (hold), live jobs' "
        "rows held a second",
    )
    p.add_argument(
        "--persister-env",
        metavar="NAME=VALUE,...",
        help="with --persister: also measure it with its persister run with these settings "
        "(JOBTIER_* environment variables, e.g. JOBTIER_PERSIST_BATCH_SIZE=8000), on a Postgres "
        "of its own, in the same interleaved runs: a setting against its default",
    )
    p.add_argument(
        "--pg-settings",
        metavar="NAME=VALUE,...",
        help="with --persister: also measure it on a Postgres of its own whose configuration "
        "adds these settings (e.g. wal_compression=lz4,max_wal_size=4GB), in the same "
        "interleaved runs: Postgres's tuning against the configuration the bench gives it",
    )
    p.add_argument("--quick", action="store_true", help="2,000 jobs, 1 run: a smoke test")
    p.add_argument("--no-save", action="store_true", help="print only; keep results files")
    args = p.parse_args(argv)
    if args.quick:
        args.jobs, args.runs = min(args.jobs, 2_000), 1
    args.systems = [s for s in args.systems.split(",") if s]
    args.collations = list(dict.fromkeys(c for c in args.collations.split(",") if c)) or ["C"]
    args.persist_systems = {}  # system name: its Postgres's collation
    if args.collations != ["C"] and not args.persister:
        p.error("--collations is for the persister's Postgres: add --persister")
    if args.what_if and not args.persister:
        p.error("--what-if is about the persister: add --persister")
    for option, what, prefix, form in (  # NAME=VALUE,... as a dict
        ("persister_env", "the persister", "JOBTIER_", "JOBTIER_NAME=VALUE"),
        ("pg_settings", "the persister's Postgres", "", "name=value"),
    ):
        flag = "--" + option.replace("_", "-")
        items = [a for a in (getattr(args, option) or "").split(",") if a]
        pairs = dict(a.split("=", 1) for a in items if "=" in a)
        setattr(args, option, pairs)
        if items and not args.persister:
            p.error(f"{flag} is about {what}: add --persister")
        if len(pairs) != len(items) or not all(k.startswith(prefix) for k in pairs):
            p.error(f"{flag} takes {form} assignments, comma-separated")
    if set_here := sorted(set(args.persister_env) & BENCH_SETS):
        p.error(f"--persister-env: the bench sets {', '.join(set_here)} itself")
    # settings every jobtier process here reads from the shell (shown in the report, secrets
    # masked), but those the bench gives them itself
    secret = {env_name(f) for f in dataclasses.fields(Settings) if f.metadata.get("secret")}
    args.inherited_env = {
        k: "***" if k in secret else v
        for k, v in os.environ.items()
        if k.startswith("JOBTIER_") and k not in BENCH_SETS
    }
    if args.persister:
        args.persist_systems = {
            PERSIST: args.collations[0],
            **{f"{PERSIST}@{c}": c for c in args.collations[1:]},
            **({NO_BY_STATE: args.collations[0]} if args.what_if == "no-by-state" else {}),
            **({HOLD: args.collations[0]} if args.what_if == "hold" else {}),
            **({PERSIST_ENV: args.collations[0]} if args.persister_env else {}),
            **({PG_SET: args.collations[0]} if args.pg_settings else {}),
        }
        at = args.systems.index("jobtier") + 1 if "jobtier" in args.systems else 0
        args.systems[at:at] = list(args.persist_systems)
    args.baseline_tree = None
    if args.baseline:
        args.baseline_tree = str(baseline_tree(args.baseline))
        args.systems.insert(args.systems.index("jobtier") + 1 if "jobtier" in args.systems
                            else 0, BASELINE)  # fmt: skip
    args.modes = [m for m in args.modes.split(",") if m]
    extra = dict(d.split("=", 1) for d in args.driver_args if "=" in d)
    args.driver_args = {name: shlex.split(value) for name, value in extra.items()}
    unknown = set(args.systems) - {*SYSTEMS, BASELINE, *args.persist_systems}
    unknown |= set(args.modes) - set(MODES)
    unknown |= set(args.driver_args) - set(SYSTEMS[1:])
    if unknown:
        p.error(f"unknown systems or modes: {', '.join(sorted(unknown))}")
    return args


def set_up(args: argparse.Namespace) -> tuple[dict[str, str | None], dict[str, Any]]:
    """Each peer's program (node, or its virtualenv's python) and versions; None if it failed."""
    programs: dict[str, str | None] = {}
    versions: dict[str, Any] = {}
    for name in args.systems:
        if name in ("jobtier", BASELINE) or name in args.persist_systems:
            continue
        try:
            program = node() if name == "bullmq" else str(python_peer(name))
            versions[name] = peer_versions(name, program)
            programs[name] = program
        except Exception as exc:
            print(f"{name}: setup failed: {exc}", file=sys.stderr, flush=True)
            programs[name] = None
            versions[name] = {"setup failed": str(exc)[:300]}
    return programs, versions


def in_turn(systems: list[str], alternated: list[str], i: int) -> list[str]:
    """The order of run ``i``: ``systems``, with those in ``alternated`` (the persister on
    each collation's Postgres, next to each other) reversed among themselves on odd runs, so
    that none always runs just after another's Postgres wrote (its checkpoint, autovacuum)."""
    if i % 2 == 0 or len(alternated) < 2:
        return list(systems)
    turned = iter(reversed([s for s in systems if s in alternated]))
    return [next(turned) if s in alternated else s for s in systems]


async def main(
    args: argparse.Namespace,
    programs: dict[str, str | None],
    finish: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """Every run; ``finish`` gets the results (prints and saves them) before this returns,
    inside the event loop: a loop that then hangs in its teardown loses nothing (seen twice,
    the loop idle in libuv after every process had stopped; the cause is not known)."""
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    runs: list[dict[str, dict[str, dict[str, Any]]]] = []
    for i in range(args.runs):
        run: dict[str, dict[str, dict[str, Any]]] = {}
        for name in in_turn(args.systems, list(args.persist_systems), i):
            for mode in args.modes:
                result = await measure(name, programs.get(name), mode, args)
                run.setdefault(name, {})[mode] = result
                brief = result.get("error") or (
                    f"enqueue {result['enqueue_jobs_per_s']:,.0f}/s, "
                    f"e2e {result['e2e_jobs_per_s']:,.0f}/s"
                )
                print(f"run {i + 1}/{args.runs} {name} AOF {mode}: {brief}", file=sys.stderr,
                      flush=True)  # fmt: skip
        runs.append(run)
    results = {"runs": runs, "summary": summarise(runs)}
    finish(results)
    return results


def run(argv: list[str] | None = None, report: Callable[[str], None] = print) -> None:
    args = parse(argv)
    env = environment()
    programs, versions = set_up(args)
    env["versions"]["peers"] = versions
    servers: list[Any] = []  # the Postgres servers started here (--persister)
    args.postgres = {}  # persister system: (dsn, postmaster pid)

    def finish(results: dict[str, Any]) -> None:
        known = systems(args)
        text = render(results["summary"], args, env, known)
        report(text)
        if not args.no_save:
            data = {
                **env,
                "smoke_run": args.quick,
                "arguments": vars(args),
                "configs": {n: known[n].config for n in args.systems},
                **results,
            }
            paths = save("compare", data, text)
            report(f"\nsaved {paths[0]} and {paths[1]}")

    try:
        for name, collation in args.persist_systems.items():
            from jobtier.dev.local_postgres import LocalPostgres
            from jobtier.persist.db import migrate

            folder = Path(tempfile.mkdtemp(prefix="jobtier-compare-pg-"))
            atexit.register(shutil.rmtree, folder, True)
            settings = args.pg_settings if name == PG_SET else None
            try:
                pg = LocalPostgres(folder, durable=True, collation=collation, settings=settings)
            except ValueError as exc:
                raise SystemExit(f"--pg-settings: {exc}") from None
            servers.append(pg)
            pg.start()
            args.postgres[name] = (pg.dsn, pg.pid)
            uvloop.run(migrate(pg.dsn))
            if name == NO_BY_STATE:
                for trigger in BY_STATE_TRIGGERS:
                    pg.psql(f"ALTER TABLE jobs DISABLE TRIGGER {trigger}", database=pg.database)
        uvloop.run(main(args, programs, finish))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted: every process it started is stopped; nothing saved", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        for pg in servers:
            pg.stop()


if __name__ == "__main__":
    run()
