"""Helpers shared by the bench programs: a local Redis, process CPU, tables, saved results.

Not a library: small pieces that keep ``throughput.py`` and ``pickup.py`` about what they
measure. Every bench starts its own Redis (``LocalRedis``: AOF on, ``noeviction``, as
production requires) in a temporary folder, so a run never depends on a server started by
hand and never touches one.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from jobtier.config import Settings
from jobtier.core.keys import Keys
from jobtier.dev.local_redis import LocalRedis
from jobtier.engine.queue import Queue
from jobtier.store import format as job_format
from jobtier.store.context import Store
from jobtier.store.redis import RedisClient

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
TICKS = os.sysconf("SC_CLK_TCK")


def git_lua(rev: str, name: str) -> str:
    """The Lua file ``name`` at git revision ``rev``, wherever that revision kept its scripts
    (src/jobtier/store/lua, or src/jobtier/lua before the store package)."""
    for folder in ("src/jobtier/store/lua", "src/jobtier/lua"):
        done = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{rev}:{folder}/{name}"],
            capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode == 0:
            return done.stdout
    raise subprocess.CalledProcessError(128, ["git", "show", f"{rev}:{name}"])


def baseline_tree(rev: str) -> Path:
    """The project's files (src, bench) at git revision ``rev`` (``git archive``), in a
    temporary folder removed at exit: a bench runs that revision's code beside the working
    tree's, in the same run (``compare.py --baseline``, ``persist.py --before``)."""
    folder = Path(tempfile.mkdtemp(prefix="jobtier-baseline-"))
    atexit.register(shutil.rmtree, folder, True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "src", "bench"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


# --- Redis ----------------------------------------------------------------------------------
@contextlib.contextmanager
def local_redis(aof: bool = True) -> Iterator[LocalRedis]:
    """A fresh redis-server in a temporary folder, stopped (and the folder removed) at exit.

    ``aof=False`` turns the append-only file off after start: a side figure only, jobtier
    refuses such a Redis unless ``JOBTIER_REDIS_REQUIRE_AOF=0``.
    """
    with tempfile.TemporaryDirectory(prefix="jobtier-bench-") as folder:
        server = LocalRedis(Path(folder)).start()
        try:
            if not aof:
                cli = shutil.which("redis-cli") or "redis-cli"
                subprocess.run(
                    [cli, "-p", str(server.port), "config", "set", "appendonly", "no"],
                    check=True,
                    stdout=subprocess.DEVNULL,
                )
            yield server
        finally:
            server.stop()


def drop_ready(r: Any, keys: Any) -> None:
    """Forget every ready job (bench cleanup between cells: the job hashes stay readable).
    The ready lists, the tenant rings and the queue counters go together, so the counters
    still match the lists."""
    for s in range(keys.shards):
        names = [k for pattern in ("q:*", "ring:*") for k in r.scan_iter(keys.base(s) + pattern)]
        r.delete(keys.queue_counts(s), *names)


async def script_queue(redis: Redis, url: str, fmt: int = job_format.NEWEST) -> Queue:
    """A Queue on ``redis`` (16 shards) for programs that call the scripts directly rather
    than through ``Queue.connect``, its shards marked format ``fmt`` (``set_format``).
    ``flush`` keeps the marks from phase to phase."""
    queue = Queue(Store(Settings(redis_url=url, shards=16), redis), require_known=False)
    await set_format(redis, queue.keys, fmt)
    return queue


async def set_format(redis: Redis, keys: Keys, fmt: int) -> None:
    """Mark every shard format ``fmt`` (``jt:{s}:fmt``). This jobtier's scripts write format
    3 whatever the mark; a baseline's scripts from before it (bench/transitions.py
    ``git_sources``) write the format the mark names, as that jobtier did."""
    if fmt == job_format.NEWEST:  # done too, so that a process of this jobtier starts on it
        await job_format.mark(redis, keys)
        return
    pipe = redis.pipeline(transaction=False)
    for shard in range(keys.shards):
        pipe.set(keys.job_format(shard), str(fmt))
    await pipe.execute()


async def flush(redis: RedisClient) -> None:
    """FLUSHALL, keeping each shard's job format mark (``set_format``): a baseline's scripts
    read it at every call, and emptying Redis between phases must not turn them to format 1
    (no mark) under the bench."""
    marks = {
        key: await redis.get(key)
        for pattern in ("*:fmt", "*:fmt:done")
        async for key in redis.scan_iter(match=pattern)
    }
    await redis.flushall()
    if marks:
        pipe = redis.pipeline(transaction=False)
        for key, value in marks.items():
            assert value is not None  # SCAN found the key, nothing else writes to this Redis
            pipe.set(key, value)
        await pipe.execute()


async def fresh(redis: RedisClient) -> None:
    """Empty Redis and make its append-only file small again before a measured phase.

    Without the rewrite, the AOF of earlier phases grows past Redis's auto-rewrite threshold
    and a background rewrite (a fork, and a second writer on the disk) lands in the middle of
    a later phase: noise that has nothing to do with what is measured.
    """
    await flush(redis)
    await redis.config_resetstat()
    persistence = await redis.info("persistence")
    if persistence.get("aof_enabled"):
        await wait_aof_rewrite(redis)
        await redis.bgrewriteaof()
        await asyncio.sleep(0.05)
        await wait_aof_rewrite(redis)


async def wait_aof_rewrite(redis: RedisClient) -> None:
    for _ in range(600):
        p = await redis.info("persistence")
        if not p.get("aof_rewrite_in_progress") and not p.get("aof_rewrite_scheduled"):
            return
        await asyncio.sleep(0.05)


async def commandstats(redis: RedisClient) -> dict[str, int]:
    """Calls per command since the last CONFIG RESETSTAT (commands run by scripts included)."""
    info = await redis.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items()}


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    out = {k: v - before.get(k, 0) for k, v in after.items()}
    return {k: v for k, v in out.items() if v}


async def redis_cpu(redis: RedisClient) -> float:
    """Seconds of CPU the Redis server has used (user + system, main and background)."""
    info = await redis.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def disk_writes(redis: RedisClient, pid: int) -> tuple[int, int]:
    """(bytes Redis has written to files, AOF rewrites so far): its write() bytes from
    /proc/<pid>/io less what it sent to clients. Unlike ``aof_current_size`` this keeps
    counting across an AOF rewrite (which starts a new, small file)."""
    wchar = _wchar(pid)
    stats = await redis.info("stats")
    persistence = await redis.info("persistence")
    return wchar - int(stats["total_net_output_bytes"]), int(persistence.get("aof_rewrites", 0))


def _wchar(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    return 0


# what a bench itself sends to Redis around a measured phase, left out of the command counts
BOOKKEEPING = frozenset({"info", "config|resetstat", "flushall", "bgrewriteaof"})


class RedisMeter:
    """Redis's side of one measured phase: CPU, bytes written to files, commands run.

    ``start()`` resets the command statistics and takes the CPU and write counters;
    ``stop(jobs)`` returns the deltas per job: ``redis_cpu_us_per_job`` (INFO cpu, user +
    system), ``aof_bytes_per_job`` (``disk_writes``: the process's file writes, so across an
    AOF rewrite too), ``redis_commands_per_job`` (INFO commandstats: commands run inside Lua
    scripts included, ``BOOKKEEPING`` and ``ignore`` left out) and the per-command counts.
    """

    def __init__(self, redis: RedisClient, pid: int, ignore: frozenset[str] = frozenset()) -> None:
        self.redis, self.pid = redis, pid
        self.ignore = BOOKKEEPING | ignore

    async def start(self) -> None:
        await self.redis.config_resetstat()
        self.cpu0 = await redis_cpu(self.redis)
        self.disk0, self.rewrites0 = await disk_writes(self.redis, self.pid)

    async def stop(self, jobs: int) -> dict[str, Any]:
        commands = delta(await commandstats(self.redis), {})
        cpu1 = await redis_cpu(self.redis)
        disk1, rewrites1 = await disk_writes(self.redis, self.pid)
        work = {k: v for k, v in commands.items() if k not in self.ignore}
        return {
            "redis_cpu_us_per_job": 1e6 * (cpu1 - self.cpu0) / jobs,
            "aof_bytes_per_job": (disk1 - self.disk0) / jobs,
            "aof_rewrites": rewrites1 - self.rewrites0,
            "redis_commands_per_job": sum(work.values()) / jobs,
            "commands": work,
        }


def _stat(path: Path) -> list[str]:
    """A /proc/<pid>/stat's fields after the command name: [0] state, [1] parent pid, [11]
    utime, [12] stime, [13] cutime, [14] cstime (clock ticks)."""
    return path.read_text().rsplit(")", 1)[1].split()


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process has used, from /proc."""
    fields = _stat(Path(f"/proc/{pid}/stat"))
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def tree_cpu(pid: int) -> float:
    """CPU seconds a process and its children have used (a Postgres postmaster and its
    backends and background processes): its own and its children's that ended (cutime,
    cstime), and those of the children still running, from /proc."""
    fields = _stat(Path(f"/proc/{pid}/stat"))
    total = sum(int(fields[i]) for i in (11, 12, 13, 14))  # utime, stime, cutime, cstime
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            child = _stat(stat)
        except OSError:  # ended meanwhile
            continue
        if int(child[1]) == pid:  # its parent
            total += int(child[11]) + int(child[12])
    return total / TICKS


# --- statistics -----------------------------------------------------------------------------
def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of the values; nan for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, round(q / 100 * len(ordered) + 0.5 - 1e-9))
    return ordered[min(rank, len(ordered)) - 1]


# --- machine and versions --------------------------------------------------------------------
def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "-"


def environment() -> dict[str, Any]:
    """What a reader needs to compare a result: command, date, machine, versions, commit."""
    redis_version = subprocess.run(
        [shutil.which("redis-server") or "redis-server", "--version"],
        capture_output=True,
        text=True,
    ).stdout.split()
    cpu = "-"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {
            "nproc": os.cpu_count(),
            "cpu": cpu,
            "platform": platform.platform(),
            # other work on the machine moves every figure: say how busy it was
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        },
        "versions": {
            "python": platform.python_version(),
            "redis-server": next((w[2:] for w in redis_version if w.startswith("v=")), "-"),
            "jobtier": _version("jobtier"),
            "redis-py": _version("redis"),
            "hiredis": _version("hiredis"),
            "uvloop": _version("uvloop"),
            "msgspec": _version("msgspec"),
        },
        "commit": commit + ("+local changes" if dirty else ""),
    }


# --- output ---------------------------------------------------------------------------------
def fmt(value: Any, digits: int = 0) -> str:
    if isinstance(value, float):
        if value != value:  # nan
            return "-"
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table whose columns line up in a terminal too."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    out = [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in rows]
    return "\n".join(out)


def save(name: str, data: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    """Write bench/results/<name>.json and <name>.md; returns both paths."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    json_path, md_path = RESULTS / f"{name}.json", RESULTS / f"{name}.md"
    json_path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    md_path.write_text(markdown.rstrip() + "\n")
    return json_path, md_path


def header_markdown(title: str, env: dict[str, Any]) -> str:
    v = env["versions"]
    m = env["machine"]
    return (
        f"# {title}\n\n"
        f"- command: `{env['command']}`\n"
        f"- date: {env['date']}, commit {env['commit']}\n"
        f"- machine: {m['nproc']} CPUs ({m['cpu']}), {m['platform']}; load average at start "
        f"{' / '.join(str(x) for x in m['load_average_at_start'])} (1 / 5 / 15 min)\n"
        f"- versions: Python {v['python']}, redis-server {v['redis-server']}, "
        f"redis-py {v['redis-py']} + hiredis {v['hiredis']}, uvloop {v['uvloop']}, "
        f"msgspec {v['msgspec']}\n"
    )
