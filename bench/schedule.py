"""Benchmark: how late delayed jobs start, jobtier's scheduler against a 1 s poller.

Starts its own Redis (AOF on, ``noeviction``) and, per variant, one scheduler and one (or
``--workers K``) ``jobtier worker jobtier.demo`` process(es) (the real CLI, uvloop), all
separate processes as in production. The variants, measured in the same run:

* ``jobtier``: ``jobtier scheduler``, which sleeps until the earliest due time it knows of
  (learned from promote answers and from the shards' ``s <ms>`` wake messages);
* ``poll1s``: the baseline most job systems ship: a process (this file, ``--poller``) that
  runs the same ``promote.lua`` on every shard once per ``--poll-interval`` (again at once
  while a shard answers a full batch), and never listens for wakes;
* ``jobtier-b100`` (only when asked for): ``jobtier scheduler --batch 100``, which moves at
  most 100 jobs per shard per script call (the default is 200);
* ``poll10ms`` (only when asked for): the same poller every 10 ms. Not a design to ship (it
  costs CPU when idle); under a steady stream of due jobs it shows what promoting in passes
  at most every 10 ms, instead of one pass per due millisecond, would cost and buy.

Phases, each on an emptied Redis:

1. spread: ``--spread-jobs`` jobs due evenly over ``--spread-seconds`` (100K over a minute),
   all submitted (``submit_many``, 1,000 per call, in random order) before the first is due;
2. burst: ``--burst-jobs`` jobs (10K) due at the same millisecond;
3. idle: ``--idle`` seconds with nothing due and nothing queued: CPU of each process
   (``/proc/<pid>/stat``) and of Redis (``INFO cpu``).

Everything is read back from the shards' transition logs (``jt:{s}:log``) once the phase has
drained: an entry id's millisecond part is Redis's clock when the script made the
transition. start lateness = the ``running`` transition (``fr`` = queued) - run-at; it splits
into promote lateness (the ``queued`` transition, ``fr`` = scheduled, - run-at: the
scheduler's part) and queue wait (running - queued: the workers' part). run-at is set by this
process from the host clock, which is Redis's clock too (loopback). Burst drain: time from
run-at until the last of the jobs started, and jobs/s over it.

The machine is shared (2 cores; other people's benches run on it too), so each phase also
records what our processes waited for: the rest of the machine's CPU (``/proc/stat``), each
main thread's time runnable but waiting for a CPU (``/proc/<pid>/schedstat``), Redis's AOF
rewrites (a forked child busy on a CPU) and when they ran, Redis's SLOWLOG (> 5 ms) and
LATENCY events (> 10 ms), and in which seconds of the phase the jobs more than 50 ms late
were due. ``--quiet-wait S`` waits up to S seconds before each variant for the rest of the
machine to go under a quarter of a core.

Targets (issue 5): spread start lateness p99 < 50 ms; the burst drained at >= 10K jobs/s.

    .venv/bin/python bench/schedule.py                  # 100K spread, 10K burst, 3 runs
    .venv/bin/python bench/schedule.py --variants jobtier,jobtier-b100,poll1s,poll10ms \
        --quiet-wait 300                                # what bench/results/ holds
    .venv/bin/python bench/schedule.py --quick          # 10K over 10 s, 2K burst, 1 run
    .venv/bin/python bench/schedule.py --runs 1 --variants jobtier --profile /tmp/prof

``--profile DIR`` records ``py-spy`` (raw collapsed stacks) of the scheduler and worker
processes in every phase, and prints their hottest functions; it perturbs the timings, so
profiled runs are not saved as results.

Results: bench/results/schedule.json and bench/results/schedule.md (medians of the runs).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec

from jobtier.store.calls import parse_promote, promote_call

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RESULTS,
    TICKS,
    commandstats,
    delta,
    environment,
    fmt,
    fresh,
    header_markdown,
    local_redis,
    median,
    percentile,
    proc_cpu,
    redis_cpu,
    save,
    table,
)

from jobtier.config import Settings
from jobtier.core.model import JobSpec
from jobtier.dev.local_redis import terminate
from jobtier.engine.queue import Queue
from jobtier.streams.entries import split_fields

VARIANTS = ("jobtier", "jobtier-b100", "poll1s", "poll10ms")
DEFAULT_VARIANTS = ("jobtier", "poll1s")
LABEL = {
    "jobtier": "jobtier scheduler",
    "jobtier-b100": "jobtier scheduler --batch 100",
    "poll1s": "poll every 1 s (baseline)",
    "poll10ms": "poll every 10 ms",
}
# the scheduler wants a Postgres for recurring schedules; a refused port fails fast and it
# keeps promoting from Redis (a DSN that times out instead is another story: see the report)
NO_POSTGRES = "postgresql://jobtier@127.0.0.1:9/jobtier"
COMMANDS = ("fcall", "zrangebyscore", "spublish", "rpop", "xadd")  # fcall: the scripts
SLOWLOG_US = 5000  # Redis commands slower than this are kept in SLOWLOG during a phase


class _Doc(msgspec.Struct):
    id: str


_decode_doc = msgspec.json.Decoder(_Doc).decode


# --- processes ------------------------------------------------------------------------------
def _env(url: str, shards: int) -> dict[str, str]:
    return {
        **os.environ,
        "JOBTIER_REDIS_URL": url,
        "JOBTIER_SHARDS": str(shards),
        "JOBTIER_DATABASE_URL": NO_POSTGRES,
        "JOBTIER_LOG_LEVEL": "WARNING",
    }


def start_processes(
    variant: str, url: str, args: argparse.Namespace, logs: Path
) -> dict[str, subprocess.Popen[bytes]]:
    """The scheduler (or the poller) and the workers, each in its own process group."""
    env = _env(url, args.shards)
    cli = [sys.executable, "-m", "jobtier.cli"]
    commands: dict[str, list[str]] = {}
    if variant.startswith("jobtier"):
        batch = 100 if variant == "jobtier-b100" else args.scheduler_batch
        commands["scheduler"] = [*cli, "scheduler", "--batch", str(batch)]
    else:
        commands["scheduler"] = [
            sys.executable, __file__, "--poller", url, "--shards", str(args.shards),
            "--poll-interval", str(args.poll_interval if variant == "poll1s" else 0.01),
        ]  # fmt: skip
    for k in range(args.workers):
        commands[f"worker{k}"] = [
            *cli, "worker", "jobtier.demo", "--concurrency", str(args.concurrency)
        ]  # fmt: skip
    procs = {}
    for name, command in commands.items():
        out = (logs / f"{variant}-{name}.log").open("ab")
        procs[name] = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return procs


def check_alive(procs: dict[str, subprocess.Popen[bytes]], logs: Path, variant: str) -> None:
    for name, p in procs.items():
        if p.poll() is not None:
            tail = (logs / f"{variant}-{name}.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{name} exited with {p.returncode}:\n{tail}")


async def wait_subscribers(queue: Queue, count: int, timeout: float = 30.0) -> None:
    """Until ``count`` processes listen on every shard's wake channel (they are up)."""
    channels = [queue.keys.wake(s) for s in range(queue.keys.shards)]
    async with asyncio.timeout(timeout):
        while True:
            reply = await queue.redis.execute_command("PUBSUB", "SHARDNUMSUB", *channels)
            if all(int(n) >= count for n in reply[1::2]):
                return
            await asyncio.sleep(0.05)


class Profiler:
    """py-spy recording the given processes until ``stop()`` (only with ``--profile``)."""

    def __init__(self, folder: Path | None, tag: str, pids: dict[str, int]) -> None:
        self.procs: list[tuple[Path, subprocess.Popen[bytes]]] = []
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        if folder is None:
            return
        folder.mkdir(parents=True, exist_ok=True)
        for name, pid in pids.items():
            path = folder / f"{tag}-{name}.txt"
            command = [spy, "record", "--pid", str(pid), "--rate", "200", "--format", "raw"]
            command += ["--output", str(path), "--nonblocking"]
            proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.procs.append((path, proc))

    def stop(self) -> list[Path]:
        for _, proc in self.procs:
            proc.send_signal(signal.SIGINT)
        for _, proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        return [path for path, _ in self.procs]


def machine_busy() -> float:
    """CPU seconds every process on the machine has used (all CPUs, /proc/stat): the
    machine is shared, and what others use in a phase is time our processes wait."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / TICKS


def hottest(path: Path, top: int = 12) -> list[tuple[str, float, float]]:
    """(function, self share, inclusive share) from py-spy's collapsed stacks."""
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    if not path.exists():
        return []
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        count = int(n)
        total += count
        frames = [
            f.split(" (")[0] + " " + f.rsplit("/", 1)[-1].rstrip(")") for f in stack.split(";")
        ]
        own[frames[-1]] += count
        for frame in set(frames):
            incl[frame] += count
    if not total:
        return []
    return [(f, own[f] / total, incl[f] / total) for f, _ in own.most_common(top)]


# --- the baseline poller (runs as its own process: ``--poller URL``) ---------------------------
async def poll_loop(url: str, shards: int, interval: float, batch: int = 1000) -> None:
    """Promote due jobs on every shard every ``interval`` seconds, on a fixed grid."""
    settings = Settings.from_env({}, redis_url=url, shards=shards)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    async with await Queue.connect(settings, catalog=False) as queue:
        tick = time.monotonic()
        while not stopping.is_set():
            todo = list(range(shards))
            while todo:  # a full batch: more may be due now, go again at once
                calls = [promote_call(s, batch) for s in todo]
                replies = await queue.scripts.call_many(calls)
                todo = [
                    s for s, r in zip(todo, replies, strict=True) if parse_promote(r).moved >= batch
                ]
            tick += interval
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(tick - time.monotonic(), 0)):
                    await stopping.wait()


# --- phases ---------------------------------------------------------------------------------
async def submit(queue: Queue, run_ats: list[int], concurrency: int = 4) -> dict[str, int]:
    """Submit one ``echo`` job per run-at (ms), in random order, 1,000 per ``submit_many``;
    returns {job id: run-at ms}."""
    order = list(range(len(run_ats)))
    random.Random(len(run_ats)).shuffle(order)
    items, due = [], {}
    for i in order:
        at = datetime.fromtimestamp(run_ats[i] / 1000, UTC)
        item = queue.produce.prepare(JobSpec(type="echo", payload={"i": i}, run_at=at), "default")
        items.append(item)
        due[item.job_id] = item.run_at_ms
    size = queue.settings.max_batch
    chunks = [items[i : i + size] for i in range(0, len(items), size)]
    for i in range(0, len(chunks), concurrency):
        await asyncio.gather(
            *(queue.produce.submit_prepared(c) for c in chunks[i : i + concurrency])
        )
    return due


async def wait_drained(
    queue: Queue, first_ms: int, after_ms: int, timeout: float
) -> tuple[bool, list[list[float]]]:
    """Until nothing is scheduled, queued or running, and ``after_ms`` has passed. Also
    returns when Redis was rewriting its AOF (a forked child busy on a CPU): [from, to] in
    s after ``first_ms``, to set beside the late jobs."""
    deadline = time.monotonic() + timeout
    rewrites: list[list[float]] = []
    rewriting = False
    while time.monotonic() < deadline:
        now_s = (time.time() * 1000 - first_ms) / 1000
        busy = bool((await queue.redis.info("persistence")).get("aof_rewrite_in_progress"))
        if busy and not rewriting:
            rewrites.append([round(now_s, 1), float("nan")])
        elif rewriting and not busy:
            rewrites[-1][1] = round(now_s, 1)
        rewriting = busy
        if time.time() * 1000 > after_ms:
            total = (await queue.admin.stats())["total"]
            if total["scheduled"] + total["queued"] + total["running"] == 0:
                return True, rewrites
        await asyncio.sleep(0.05)
    return False, rewrites


async def read_log(
    queue: Queue, due: dict[str, int]
) -> tuple[list[int], list[int], list[int], list[tuple[int, int]]]:
    """(start lateness, promote lateness, queue wait) in ms per job, from the shard logs;
    and (run-at, start lateness) per job."""
    promoted: dict[str, int] = {}
    started: dict[str, int] = {}
    for shard in range(queue.keys.shards):
        key = queue.keys.log(shard)
        cursor = "-"
        while True:
            entries: Any = await queue.redis.xrange(key, cursor, "+", count=20000)
            for entry_id, whole in entries:
                for fields in split_fields(whole):  # (an entry holds a script call's)
                    frm = fields.get(b"fr")
                    if frm == b"scheduled":
                        target = promoted
                    elif frm == b"queued":
                        target = started
                    else:
                        continue
                    job_id = _decode_doc(fields[b"d"]).id
                    target.setdefault(job_id, int(entry_id.split(b"-", 1)[0]))
            if len(entries) < 20000:
                break
            last = entries[-1][0].decode()
            ms, seq = last.split("-")
            cursor = f"{ms}-{int(seq) + 1}"
    start, prom, wait, pairs = [], [], [], []
    for job_id, at in due.items():
        if job_id in started:
            start.append(started[job_id] - at)
            pairs.append((at, started[job_id] - at))
        if job_id in promoted:
            prom.append(promoted[job_id] - at)
            if job_id in started:
                wait.append(started[job_id] - promoted[job_id])
    return start, prom, wait, pairs


def late_seconds(pairs: list[tuple[int, int]], over: int = 50) -> dict[str, Any]:
    """Where in the phase the jobs later than ``over`` ms were due: one stall (a few
    seconds) or all along. Seconds counted from the first run-at."""
    if not pairs:
        return {"seconds_with_late": 0, "worst": []}
    first = min(at for at, _ in pairs)
    count: collections.Counter[int] = collections.Counter()
    worst: dict[int, int] = {}
    for at, late in pairs:
        if late > over:
            sec = (at - first) // 1000
            count[sec] += 1
            worst[sec] = max(worst.get(sec, 0), late)
    return {
        "seconds_with_late": len(count),
        "worst": [[sec, n, worst[sec]] for sec, n in count.most_common(8)],  # second, jobs, max
    }


async def redis_children_cpu(redis: Any) -> float:
    """CPU seconds of Redis's forked children (AOF rewrites) that have exited."""
    info = await redis.info("cpu")
    return float(info["used_cpu_user_children"]) + float(info["used_cpu_sys_children"])


def sched_wait(pid: int) -> float:
    """Seconds the process's main thread has spent runnable but waiting for a CPU."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return float("nan")


def spread_of(values: list[int]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "max": float(max(values)) if values else float("nan"),
        "min": float(min(values)) if values else float("nan"),
    }


async def slowlog(queue: Queue) -> list[dict[str, Any]]:
    out = []
    for entry in await queue.redis.slowlog_get(32):
        command = entry.get("command", b"")
        if isinstance(command, bytes):
            command = command.decode(errors="replace")
        out.append({"us": int(entry["duration"]), "command": command[:80]})
    return out


async def measure_phase(
    kind: str,
    queue: Queue,
    procs: dict[str, subprocess.Popen[bytes]],
    args: argparse.Namespace,
    rng: random.Random,
    profiler: Profiler,
    redis_pid: int,
) -> dict[str, Any]:
    """Submit the phase's jobs, wait until every one has run, read the logs back."""
    await fresh(queue.redis)
    await queue.redis.slowlog_reset()
    await queue.redis.execute_command("LATENCY", "RESET")
    if kind == "spread":
        n = args.spread_jobs
        lead = args.lead if args.lead is not None else 3.0 + n / 6000
        first = round(time.time() * 1000 + lead * 1000)
        span = args.spread_seconds * 1000
        run_ats = [first + round(i * span / n) for i in range(n)]
    else:
        n = args.burst_jobs
        lead = args.lead if args.lead is not None else 2.0 + n / 6000
        # a random phase against the poller's 1 s grid (the jobtier scheduler has none)
        first = round(time.time() * 1000 + (lead + rng.uniform(0, args.poll_interval)) * 1000)
        run_ats = [first] * n
    last = max(run_ats)
    due = await submit(queue, run_ats)
    submitted_ms = time.time() * 1000
    # CPU and Redis counters from just before the first job is due (not the submit's cost)
    await asyncio.sleep(max(first - 20 - time.time() * 1000, 0) / 1000)
    cpu0 = {name: proc_cpu(p.pid) for name, p in procs.items()}
    rcpu0 = await redis_cpu(queue.redis)
    busy0, own0 = machine_busy(), proc_cpu(os.getpid())
    pids = {**{name: p.pid for name, p in procs.items()}, "redis": redis_pid}
    waits0 = {name: sched_wait(pid) for name, pid in pids.items()}
    rewrites0 = int((await queue.redis.info("persistence")).get("aof_rewrites", 0))
    children0 = await redis_children_cpu(queue.redis)
    stats0 = await commandstats(queue.redis)
    t0 = time.monotonic()
    drained, rewriting = await wait_drained(
        queue, first, last + 200, timeout=args.spread_seconds + 180
    )
    window = time.monotonic() - t0
    waits = {name: sched_wait(pid) - waits0[name] for name, pid in pids.items()}
    cpu = {name: proc_cpu(p.pid) - cpu0[name] for name, p in procs.items()}
    rcpu = await redis_cpu(queue.redis) - rcpu0
    children = await redis_children_cpu(queue.redis) - children0  # AOF rewrites
    # everything else: other people's processes, and this one (polling stats)
    others = machine_busy() - busy0 - sum(cpu.values()) - rcpu - children
    others -= proc_cpu(os.getpid()) - own0
    calls = delta(await commandstats(queue.redis), stats0)
    profiles = profiler.stop()
    slow = await slowlog(queue)  # before reading the logs back (XRANGE is slow too)
    latency = await queue.redis.execute_command("LATENCY", "LATEST")
    persistence = await queue.redis.info("persistence")
    start, prom, wait, pairs = await read_log(queue, due)
    out: dict[str, Any] = {
        "jobs": n,
        "lead_ms": first - submitted_ms,  # > 0: every job was in before the first was due
        "drained": drained,
        "window_s": window,
        "cpu_s": cpu,
        "redis_cpu_s": rcpu,
        "others_cpu_s": others,
        "cpu_wait_s": waits,  # main threads runnable, waiting for a CPU (/proc/pid/schedstat)
        "commands": calls,
        "slowlog": slow,
        # Redis's own latency events over 10 ms: [event, last at, last ms, max ms]
        "redis_latency_events": [
            [e[0].decode() if isinstance(e[0], bytes) else e[0], *map(int, e[1:4])] for e in latency
        ],
        "aof_rewrites": int(persistence.get("aof_rewrites", 0)) - rewrites0,  # in the phase
        "aof_rewriting_s": rewriting,
        "redis_children_cpu_s": children,
        "late_over_50ms": late_seconds(pairs),
        "start_lateness_ms": spread_of(start),
        "promote_lateness_ms": spread_of(prom),
        "queue_wait_ms": spread_of(wait),
        "profiles": [str(p) for p in profiles],
    }
    if kind == "burst" and start:
        all_started = max(start)  # ms after run-at
        out["all_started_ms"] = all_started
        out["first_started_ms"] = min(start)
        out["all_promoted_ms"] = max(prom) if prom else float("nan")
        out["drain_jobs_per_s"] = len(start) / max(all_started, 1) * 1000
        # the same, from the first start: the rate workers take a full queue at
        out["drain_from_first_jobs_per_s"] = len(start) / max(all_started - min(start), 1) * 1000
    return out


async def measure_idle(
    queue: Queue, procs: dict[str, subprocess.Popen[bytes]], seconds: float
) -> dict[str, float]:
    await asyncio.sleep(2.0)  # the last reports and heartbeats settle
    before = {name: proc_cpu(p.pid) for name, p in procs.items()}
    rbefore = await redis_cpu(queue.redis)
    busy = machine_busy()
    await asyncio.sleep(seconds)
    out = {name: proc_cpu(p.pid) - before[name] for name, p in procs.items()}
    out["redis"] = await redis_cpu(queue.redis) - rbefore
    out["others"] = machine_busy() - busy - sum(out.values())
    return out


async def run_variant(variant: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    with local_redis(aof=True) as server, tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        settings = Settings.from_env({}, redis_url=server.url, shards=args.shards)
        async with await Queue.connect(settings, catalog=False) as queue:
            await queue.redis.config_set("slowlog-log-slower-than", SLOWLOG_US)
            await queue.redis.config_set("latency-monitor-threshold", 10)
            if args.no_aof_rewrite:  # AOF stays on; Redis just never rewrites it by itself
                await queue.redis.config_set("auto-aof-rewrite-percentage", 0)
            procs = start_processes(variant, server.url, args, logs)
            try:
                subscribers = args.workers + (1 if variant.startswith("jobtier") else 0)
                await wait_subscribers(queue, subscribers)
                await asyncio.sleep(1.0)
                result: dict[str, Any] = {"variant": variant}
                pids = {name: p.pid for name, p in procs.items()}
                redis_pid = server.proc.pid if server.proc else 0
                for kind in args.phases:
                    tag = f"{variant}-{kind}-run{seed}"
                    profiler = Profiler(args.profile, tag, pids)
                    result[kind] = await measure_phase(
                        kind, queue, procs, args, rng, profiler, redis_pid
                    )
                    check_alive(procs, logs, variant)
                result["idle_cpu_s"] = await measure_idle(queue, procs, args.idle)
                check_alive(procs, logs, variant)
            finally:
                for p in procs.values():
                    terminate(p)
    return result


# --- summary and output ---------------------------------------------------------------------
def _get(d: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        d = d[part]
    return d


def summarise(
    runs: list[dict[str, dict[str, Any]]], variants: list[str], phases: list[str]
) -> dict[str, Any]:
    """Medians over runs of every figure the tables show, per variant."""
    figures = [
        f"{phase}.{series}.{stat}"
        for phase in phases
        for series in ("start_lateness_ms", "promote_lateness_ms", "queue_wait_ms")
        for stat in ("p50", "p99", "max")
    ]
    figures += [
        f"{phase}.{k}"
        for phase in phases
        for k in (
            "window_s",
            "redis_cpu_s",
            "others_cpu_s",
            "lead_ms",
            "redis_children_cpu_s",
            "aof_rewrites",
        )
    ]
    if "burst" in phases:
        figures += [
            "burst.first_started_ms",
            "burst.all_started_ms",
            "burst.all_promoted_ms",
            "burst.drain_jobs_per_s",
            "burst.drain_from_first_jobs_per_s",
        ]
    out: dict[str, Any] = {}
    for v in variants:
        results = [r[v] for r in runs]
        s: dict[str, Any] = {f: median([_get(r, f) for r in results]) for f in figures}
        for phase in phases:
            for name in results[0][phase]["cpu_s"]:
                s[f"{phase}.cpu_s.{name}"] = median([r[phase]["cpu_s"][name] for r in results])
            for name in results[0][phase]["cpu_wait_s"]:
                s[f"{phase}.cpu_wait_s.{name}"] = median(
                    [r[phase]["cpu_wait_s"][name] for r in results]
                )
            s[f"{phase}.start_p99_runs"] = [r[phase]["start_lateness_ms"]["p99"] for r in results]
            s[f"{phase}.late_seconds"] = median(
                [r[phase]["late_over_50ms"]["seconds_with_late"] for r in results]
            )
            for cmd in COMMANDS:
                s[f"{phase}.commands.{cmd}"] = median(
                    [r[phase]["commands"].get(cmd, 0) for r in results]
                )
        for name in results[0]["idle_cpu_s"]:
            s[f"idle_cpu_s.{name}"] = median([r["idle_cpu_s"][name] for r in results])
        s["others_before_cores"] = median(
            [r.get("others_before_cores", float("nan")) for r in results]
        )
        s["drained_all"] = all(r[p]["drained"] for r in results for p in phases)
        s["submitted_ahead_all"] = all(r[p]["lead_ms"] > 0 for r in results for p in phases)
        out[v] = s
    return out


def verdict(summary: dict[str, Any], phases: list[str]) -> str:
    """The targets, met or missed, for the jobtier variants (medians)."""
    lines = []
    for v in (v for v in summary if v.startswith("jobtier")):
        s = summary[v]
        parts = []
        if "spread" in phases:
            p99 = s["spread.start_lateness_ms.p99"]
            parts.append(
                f"spread p99 {fmt(p99, 0)} ms (runs: "
                f"{', '.join(fmt(x, 0) for x in s['spread.start_p99_runs'])}), target "
                f"{'met' if p99 < 50 else 'missed'} "
                f"(the scheduler's part, promote p99: {fmt(s['spread.promote_lateness_ms.p99'], 0)}"
                f" ms; the rest of the machine used {s['spread.others_cpu_s'] / s['spread.window_s']:.2f}"
                " cores meanwhile)"
            )
        if "burst" in phases:
            rate = s["burst.drain_jobs_per_s"]
            parts.append(
                f"burst {fmt(rate, 0)} jobs/s from run-at, target {'met' if rate >= 10_000 else 'missed'}"
                f" (Redis CPU {fmt(s['burst.redis_cpu_s'], 2)} s for {fmt(s['burst.all_started_ms'], 0)}"
                " ms of drain)"
            )
        lines.append(f"- {LABEL[v]}: " + "; ".join(parts) + ".")
    return "\n".join(lines) + "\n"


def render(
    summary: dict[str, Any],
    args: argparse.Namespace,
    env: dict[str, Any],
    loads: list[str],
) -> str:
    variants = list(summary)
    phases = args.phases
    out = [header_markdown("Delayed jobs: start lateness, burst drain, idle CPU", env)]
    out.append(
        f"{args.shards} shards, Redis with AOF on (everysec"
        f"{'; automatic AOF rewrites OFF' if getattr(args, 'no_aof_rewrite', False) else ''}), "
        f"{args.workers} "
        f"`jobtier worker jobtier.demo --concurrency {args.concurrency}` process(es) running the "
        f"no-op `echo` task, one scheduler process. Spread: {args.spread_jobs:,} jobs due evenly "
        f"over {args.spread_seconds:g} s; burst: {args.burst_jobs:,} jobs due at the same "
        f"millisecond; all submitted before the first was due. Medians of {args.runs} run(s) "
        f"(variants alternate within a run); load average (1 min) after each run: "
        f"{', '.join(loads)}. Times on Redis's clock (transition log entry ids), 1 ms steps.\n"
    )
    if args.quiet_wait:
        waits = ", ".join(
            f"{LABEL[v]} {fmt(summary[v]['others_before_cores'], 2)}" for v in variants
        )
        out.append(
            f"The machine is shared: before each variant the bench waited (up to "
            f"{args.quiet_wait:g} s) for other processes to use under 0.25 of a core; median "
            f"share they used just before: {waits}. Their use during each phase is the "
            f"`others` row of the CPU table.\n"
        )
    out.append(
        "Targets (issue 5): spread start lateness p99 < 50 ms; burst drained at ≥ 10K jobs/s.\n"
    )
    out.append(verdict(summary, phases))
    out.append("## Start lateness (running - run-at), ms\n")
    rows = []
    for v in variants:
        s = summary[v]
        for phase in phases:
            rows.append(
                [LABEL[v], phase]
                + [
                    fmt(s[f"{phase}.{series}.{k}"], 0)
                    for series in ("start_lateness_ms", "promote_lateness_ms", "queue_wait_ms")
                    for k in ("p50", "p99", "max")
                ]
            )
    headers = ["variant", "phase"] + [
        f"{series} {k}"
        for series in ("start", "promote", "queue wait")
        for k in ("p50", "p99", "max")
    ]
    out.append(table(headers, rows) + "\n")
    out.append(
        "promote = the `queued` transition - run-at (the scheduler's part); queue wait = "
        "running - queued (the workers' part).\n"
    )
    if "burst" in phases:
        out.append(f"## Burst of {args.burst_jobs:,} jobs due at once\n")
        rows = [
            [
                LABEL[v],
                fmt(summary[v]["burst.first_started_ms"], 0),
                fmt(summary[v]["burst.all_promoted_ms"], 0),
                fmt(summary[v]["burst.all_started_ms"], 0),
                fmt(summary[v]["burst.drain_jobs_per_s"], 0),
                fmt(summary[v]["burst.drain_from_first_jobs_per_s"], 0),
            ]
            for v in variants
        ]
        headers = [
            "variant", "first started (ms after run-at)", "all promoted", "all started",
            "jobs/s from run-at", "jobs/s from the first start",
        ]  # fmt: skip
        out.append(table(headers, rows) + "\n")
    out.append("## CPU (seconds; % of one core over the phase)\n")
    rows = []
    for v in variants:
        s = summary[v]
        names = [k.split(".", 2)[2] for k in s if k.startswith(f"{phases[0]}.cpu_s.")]
        for name in [*names, "redis", "others"]:
            row = [LABEL[v], "poller" if name == "scheduler" and v.startswith("poll") else name]
            idle = s[f"idle_cpu_s.{name}"]
            row.append(f"{fmt(idle, 3)} ({100 * idle / args.idle:.2f} %)")
            for phase in phases:
                if name in ("redis", "others"):
                    cpu = s[f"{phase}.{name}_cpu_s"]
                else:
                    cpu = s[f"{phase}.cpu_s.{name}"]
                row.append(f"{fmt(cpu, 2)} ({100 * cpu / s[f'{phase}.window_s']:.0f} %)")
            rows.append(row)
    windows = [
        f"{phase} (~{median([summary[v][f'{phase}.window_s'] for v in variants]):.0f} s)"
        for phase in phases
    ]
    out.append(table(["variant", "process", f"idle, {args.idle:g} s", *windows], rows) + "\n")
    out.append(
        "Phase CPU: from just before the first job is due until every job has run (the "
        "submit's cost is not counted); idle: after the phases, nothing due, nothing "
        "queued. `others`: every other process on the machine (`/proc/stat`), this bench's "
        "own polling included: the machine is shared, and their CPU is time ours waited.\n"
    )
    out.append("## Contention: what our processes waited for\n")
    rows = []
    for v in variants:
        s = summary[v]
        for phase in phases:
            window = s[f"{phase}.window_s"]
            waiters = [k.split(".", 2)[2] for k in s if k.startswith(f"{phase}.cpu_wait_s.")]
            rows.append(
                [
                    LABEL[v],
                    phase,
                    f"{s[f'{phase}.others_cpu_s'] / window:.2f}",
                    ", ".join(f"{n} {fmt(s[f'{phase}.cpu_wait_s.{n}'], 1)}" for n in waiters),
                    f"{fmt(s[f'{phase}.aof_rewrites'], 0)} ({fmt(s[f'{phase}.redis_children_cpu_s'], 1)} s)",
                    fmt(s[f"{phase}.late_seconds"], 0),
                ]
            )
    headers = [
        "variant", "phase", "others (cores)", "main threads runnable, waiting for a CPU (s)",
        "AOF rewrites (their CPU)", "seconds with a job > 50 ms late",
    ]  # fmt: skip
    out.append(table(headers, rows) + "\n")
    out.append(
        "Waiting for a CPU: `/proc/<pid>/schedstat` of each process's main thread over the "
        "phase. AOF rewrites: Redis's automatic rewrites (a forked child, busy on a CPU) "
        "during the phase.\n"
    )
    out.append("## Redis commands per phase (commands run by scripts included)\n")
    rows = [
        [LABEL[v], phase, *(fmt(int(summary[v][f"{phase}.commands.{c}"])) for c in COMMANDS)]
        for v in variants
        for phase in phases
    ]
    headers = ["variant", "phase", *(c.upper() for c in COMMANDS)]
    out.append(table(headers, rows) + "\n")
    out.append(
        "ZRANGEBYSCORE ≈ promote script calls (reclaim's are a handful); RPOP ≈ claims of a "
        "non-empty queue; SPUBLISH = status events + wake messages.\n"
    )
    notes = []
    for v in variants:
        if not summary[v]["drained_all"]:
            notes.append(f"- {LABEL[v]}: some phase did not drain within its timeout.")
        if not summary[v]["submitted_ahead_all"]:
            notes.append(
                f"- {LABEL[v]}: in some run the submit ended after the first job was due "
                "(raise --lead)."
            )
    if notes:
        out.append("## Caveats\n\n" + "\n".join(notes) + "\n")
    return "\n".join(out)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spread-jobs", type=int, default=100_000, help="jobs due evenly (100000)")
    p.add_argument("--spread-seconds", type=float, default=60.0, help="over this many s (60)")
    p.add_argument("--burst-jobs", type=int, default=10_000, help="jobs due at once (10000)")
    p.add_argument("--workers", type=int, default=1, help="worker processes (1)")
    p.add_argument("--concurrency", type=int, default=50, help="per worker (50)")
    p.add_argument("--shards", type=int, default=16, help="logical shards (16)")
    p.add_argument("--idle", type=float, default=10.0, help="idle period measured, s (10)")
    p.add_argument("--runs", type=int, default=3, help="runs; medians are reported (3)")
    p.add_argument(
        "--scheduler-batch",
        type=int,
        default=200,
        help="jobtier scheduler --batch (200, its default)",
    )
    p.add_argument("--poll-interval", type=float, default=1.0, help="baseline poll, s (1)")
    p.add_argument(
        "--lead", type=float, default=None, help="s from submit to first due (auto: by job count)"
    )
    p.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help=f"comma-separated, of {', '.join(VARIANTS)} ({','.join(DEFAULT_VARIANTS)})",
    )
    p.add_argument("--phases", default="spread,burst", help="comma-separated: spread, burst (both)")
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=0.0,
        help="before each variant, wait up to this many s for the rest of the machine to go "
        "under a quarter of a core (0: don't)",
    )
    p.add_argument(
        "--no-aof-rewrite",
        action="store_true",
        help="diagnosis: keep AOF on but turn Redis's automatic AOF rewrites off",
    )
    p.add_argument("--profile", type=Path, help="record py-spy profiles into this folder")
    p.add_argument("--quick", action="store_true", help="10K jobs over 10 s, 2K burst, 1 run")
    p.add_argument("--no-save", action="store_true", help="print only; keep results files")
    p.add_argument("--dump", type=Path, help="also write the raw figures (JSON) here")
    p.add_argument("--poller", metavar="URL", help=argparse.SUPPRESS)  # the baseline process
    p.add_argument(
        "--rerender", action="store_true", help="rewrite the .md from the saved .json only"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.spread_jobs = min(args.spread_jobs, 10_000)
        args.spread_seconds = min(args.spread_seconds, 10.0)
        args.burst_jobs = min(args.burst_jobs, 2_000)
        args.idle, args.runs = 3.0, 1
    args.variants = [v for v in args.variants.split(",") if v]
    args.phases = [ph for ph in args.phases.split(",") if ph]
    if not set(args.phases) <= {"spread", "burst"}:
        p.error("phases are spread and burst")
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants: {', '.join(sorted(unknown))}")
    return args


def print_profiles(raw: list[dict[str, dict[str, Any]]]) -> None:
    for run in raw:
        for result in run.values():
            for phase in ("spread", "burst"):
                for path in result.get(phase, {}).get("profiles", []):
                    rows = [
                        [f[:90], f"{100 * own:.1f}", f"{100 * incl:.1f}"]
                        for f, own, incl in hottest(Path(path))
                    ]
                    if rows:
                        print(f"\n{path}\n" + table(["function", "self %", "incl %"], rows))


async def wait_quiet(limit: float, share: float = 0.25, sample: float = 2.0) -> float:
    """Wait up to ``limit`` s for the rest of the machine to use under ``share`` of a core
    (the machine is shared with other people's benches); returns that share when we go."""
    deadline = time.monotonic() + limit
    while True:
        busy = machine_busy()
        await asyncio.sleep(sample)
        used = (machine_busy() - busy) / sample
        if used < share or time.monotonic() >= deadline:
            return used
        await asyncio.sleep(1.0)


async def main(args: argparse.Namespace) -> tuple[list[dict[str, dict[str, Any]]], list[str]]:
    # SIGTERM (and SIGINT where a background shell set it to ignored) cancel the run, so the
    # finally blocks stop the processes and the Redis this run started
    task = asyncio.current_task()
    assert task is not None
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, task.cancel)
    runs: list[dict[str, dict[str, Any]]] = []
    loads = []
    for run in range(args.runs):
        order = args.variants if run % 2 == 0 else args.variants[::-1]
        results = {}
        for variant in order:
            quiet = await wait_quiet(args.quiet_wait) if args.quiet_wait else float("nan")
            print(
                f"run {run + 1}/{args.runs}: {variant} (others before: {quiet:.2f} cores) ...",
                file=sys.stderr,
                flush=True,
            )
            results[variant] = await run_variant(variant, args, seed=run)
            results[variant]["others_before_cores"] = quiet
            r = results[variant]
            for phase in args.phases:
                late = r[phase]["start_lateness_ms"]
                print(
                    f"  {phase}: start lateness p50/p99/max {late['p50']:.0f}/{late['p99']:.0f}/"
                    f"{late['max']:.0f} ms, promote p99 {r[phase]['promote_lateness_ms']['p99']:.0f}"
                    f" ms, load {os.getloadavg()[0]:.1f}",
                    file=sys.stderr,
                    flush=True,
                )
        runs.append(results)
        loads.append(f"{os.getloadavg()[0]:.1f}")
    return runs, loads


def rerender() -> None:
    """Write bench/results/schedule.md again from schedule.json (after a change to the
    tables; nothing is measured)."""
    data = json.loads((RESULTS / "schedule.json").read_text())
    args = argparse.Namespace(**data["arguments"])
    summary = summarise(data["raw"], args.variants, args.phases)
    data["summary"] = summary
    text = render(summary, args, data, data["load_average"])
    print(text)
    save("schedule", data, text)


def run(argv: list[str] | None = None) -> None:
    import uvloop

    args = parse(argv)
    if args.poller:
        uvloop.run(poll_loop(args.poller, args.shards, args.poll_interval))
        return
    if args.rerender:
        rerender()
        return
    env = environment()
    try:
        raw, loads = uvloop.run(main(args))
    except asyncio.CancelledError:
        sys.exit("interrupted: processes and Redis stopped, nothing saved")
    summary = summarise(raw, args.variants, args.phases)
    text = render(summary, args, env, loads)
    print(text)
    if args.profile:
        print_profiles(raw)
    if args.dump:
        args.dump.write_text(json.dumps({"arguments": str(vars(args)), "raw": raw}, indent=1))
    if not args.no_save and not args.profile:
        arguments = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        data = {
            **env,
            "arguments": arguments,
            "load_average": loads,
            "summary": summary,
            "raw": raw,
        }
        paths = save("schedule", data, text)
        print(f"\nsaved {paths[0]} and {paths[1]}")


if __name__ == "__main__":
    run()
