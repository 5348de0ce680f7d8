"""HTTP bench helpers: an API server process, the two load generators, request files, and
a workload to serve (jobs of several tenants, jobs that keep changing).

Not a library: pieces that keep ``status_read.py`` about what it measures.

* ``ApiProcess``: ``python -m jobtier.cli api`` with a given environment, optionally pinned to
  CPUs with ``taskset``; its CPU time and resident memory read from ``/proc``.
* ``run_wrk``: wrk (closed loop) with ``wrk_rotate.lua``, which replays a file of raw HTTP
  requests round-robin and prints its summary as JSON (p99.9 included).
* ``run_openloop``: ``openloop.c`` (open loop at a fixed rate, latency from the intended send
  time), compiled on first use with gcc.
* ``write_requests``: the raw request file both generators read: complete HTTP/1.1
  requests, each followed by a NUL byte.
* ``Counters``: what a run cost the server (CPU, memory) and Redis (commands, CPU), and how
  busy each CPU was.
* ``fill`` / ``churn`` / ``StalenessProbe``: jobs to read; jobs moved through their states by
  a worker process (``python common_http.py --churn-worker URL SECONDS``) while they are read;
  a check that the API never serves a version older than Redis's for longer than an event
  takes to arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import httpx
import redis

from jobtier.config import Settings
from jobtier.core.keys import Keys
from jobtier.core.model import JobSpec
from jobtier.dev.local_redis import wait_port
from jobtier.engine.queue import Queue
from jobtier.status.reader import parse_version
from jobtier.store import format as job_format
from jobtier.store.calls import fail_call
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import TaskRegistry, task
from jobtier.worker.runner import Worker

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import drop_ready  # noqa: E402  (bench/ is not a package)

TICKS = os.sysconf("SC_CLK_TCK")
PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024

# wrk replays the request file round-robin, each thread from its own random offset; done()
# prints one JSON line (latencies in microseconds) that run_wrk parses.
WRK_LUA = r"""
local reqs, n, i = {}, 0, 0
function init(args)
  local f = assert(io.open(args[1], "rb"))
  local data = f:read("*a")
  f:close()
  local pos = 1
  while true do
    local z = string.find(data, "\0", pos, true)
    if not z then break end
    n = n + 1
    reqs[n] = string.sub(data, pos, z - 1)
    pos = z + 1
  end
  i = math.random(n) - 1
end
function request()
  i = i % n + 1
  return reqs[i]
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests": %d, "duration_us": %d, "bytes": %d, "errors": {"connect": %d, ' ..
    '"read": %d, "write": %d, "status": %d, "timeout": %d}, "latency_us": {"mean": %.1f, ' ..
    '"p50": %d, "p90": %d, "p99": %d, "p99.9": %d, "max": %d}}\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status,
    e.timeout, latency.mean, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency:percentile(99.9), latency.max))
end
"""


def write_requests(path: Path, requests: Iterable[bytes]) -> Path:
    with path.open("wb") as f:
        for raw in requests:
            f.write(raw)
            f.write(b"\0")
    return path


def http_request(
    method: str, target: str, key: str, body: bytes = b"", port: int = 0, **headers: str
) -> bytes:
    """A complete HTTP/1.1 request (keep-alive) as bytes."""
    lines = [
        f"{method} {target} HTTP/1.1",
        f"Host: 127.0.0.1:{port}",
        f"Authorization: Bearer {key}",
    ]
    lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    if body or method in ("POST", "PUT"):
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


# --- processes -------------------------------------------------------------------------------
def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [
                    int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()
                ]
        except OSError:
            pass
    return out


def proc_cpu(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS


def proc_rss_kb(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE_KB
    except OSError:
        return 0


class ApiProcess:
    """``jobtier api`` in a child process (its own session), pinned with taskset if asked."""

    def __init__(
        self,
        port: int,
        env: Mapping[str, str],
        *,
        server: str = "granian",
        cpus: str | None = None,
        log: Path | None = None,
    ) -> None:
        self.port = port
        self.server = server
        cmd = [
            sys.executable,
            "-m",
            "jobtier.cli",
            "api",
            "--server",
            server,
            "--port",
            str(port),
        ]
        if cpus is not None and shutil.which("taskset"):
            cmd = ["taskset", "-c", cpus, *cmd]
        self.log = log
        out = log.open("ab") if log else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            cmd,
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.url = f"http://127.0.0.1:{port}"

    def wait_ready(self, timeout: float = 30.0) -> ApiProcess:
        """Wait for /healthz (not /readyz: that one also wants Postgres); on failure the
        server is stopped, so a failed start leaves no process behind."""
        try:
            wait_port(self.port, timeout, proc=self.proc)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(self.url + "/healthz", timeout=2).status_code == 200:
                        return self
                time.sleep(0.05)
            raise TimeoutError(f"the API on port {self.port} is not ready (see {self.log})")
        except BaseException:
            self.stop()
            raise

    def pids(self) -> list[int]:
        return _descendants(self.proc.pid)

    def serving_pids(self) -> list[int]:
        """The processes that run the app: granian's workers (not its supervisor), or
        uvicorn's single process."""
        pids = self.pids()
        return [p for p in pids if p != self.proc.pid] or pids

    def cpu(self) -> float:
        """CPU seconds used so far by the server and all its processes."""
        return sum(proc_cpu(p) for p in self.pids())

    def rss_kb(self) -> int:
        return sum(proc_rss_kb(p) for p in self.serving_pids())

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def cpu_busy_ticks() -> list[tuple[int, int]]:
    """(busy, total) clock ticks of each CPU since boot, from /proc/stat."""
    out = []
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu") and line[3].isdigit():
            ticks = [int(x) for x in line.split()[1:]]
            idle = ticks[3] + ticks[4]  # idle + iowait
            out.append((sum(ticks) - idle, sum(ticks)))
    return out


class Counters:
    """What one load-generator run cost: the server's CPU (and its share of a core), Redis
    commands (INFO commandstats: commands run inside scripts count too) and Redis CPU, how
    busy each CPU of the machine was (other tenants of a shared machine show up there), and
    the server's resident memory before and after."""

    # our own bookkeeping between snapshots: INFO, and the admin stats call's queue stats
    BOOKKEEPING = frozenset(
        {"info", "llen", "zcard", "hgetall", "hlen", "hget", "xlen", "xinfo|groups", "xpending"}
    )

    def __init__(self, api: ApiProcess, redis: Any) -> None:
        self.api, self.redis = api, redis
        self.before = self._snapshot()

    def _snapshot(self) -> dict[str, Any]:
        info = self.redis.info("commandstats")
        cpu = self.redis.info("cpu")
        return {
            "t": time.monotonic(),
            "cmds": {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items()},
            "redis_cpu": float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]),
            "cpu": self.api.cpu(),
            "rss_kb": self.api.rss_kb(),
            "ticks": cpu_busy_ticks(),
            "load": os.getloadavg()[0],
        }

    def done(self, requests: int) -> dict[str, Any]:
        a, b = self.before, self._snapshot()
        per = max(requests, 1)
        cmds = {k: v - a["cmds"].get(k, 0) for k, v in b["cmds"].items()}
        cmds = {k: v for k, v in cmds.items() if v > 0 and k not in self.BOOKKEEPING}
        seconds = b["t"] - a["t"]
        busy = [
            (b1 - b0) / (t1 - t0) if t1 > t0 else None
            for (b0, t0), (b1, t1) in zip(a["ticks"], b["ticks"], strict=True)
        ]
        return {
            "requests": requests,
            "redis_cmds_per_req": sum(cmds.values()) / per,
            "redis_cmds": cmds,
            "server_cpu_us_per_req": (b["cpu"] - a["cpu"]) * 1e6 / per,
            "server_cpu_share": (b["cpu"] - a["cpu"]) / seconds if seconds > 0 else None,
            "redis_cpu_us_per_req": (b["redis_cpu"] - a["redis_cpu"]) * 1e6 / per,
            "cpu_busy": busy,
            "rss_mb_before": a["rss_kb"] / 1024,
            "rss_mb_after": b["rss_kb"] / 1024,
            "loadavg": [a["load"], b["load"]],
        }


# --- load generators -------------------------------------------------------------------------
def build_openloop(folder: Path) -> Path:
    binary = folder / "openloop"
    subprocess.run(
        ["gcc", "-O2", "-Wall", "-o", str(binary), str(HERE / "openloop.c")],
        check=True,
    )
    return binary


def run_openloop(
    binary: Path,
    port: int,
    requests: Path,
    rate: float,
    duration: float,
    *,
    warmup: float = 2.0,
    connections: int = 200,
    drain: float = 5.0,
    cpus: str | None = None,
) -> dict[str, Any]:
    cmd = [
        str(binary), "-p", str(port), "-r", str(rate), "-d", str(duration), "-w", str(warmup),
        "-c", str(connections), "-t", str(drain), "-f", str(requests),
    ]  # fmt: skip
    if cpus is not None:
        cmd = ["taskset", "-c", cpus, *cmd]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    result: dict[str, Any] = json.loads(out)
    result["generator"] = "openloop"
    lat = result["latency_ms"]
    for k, v in lat.items():
        if v is not None and v < 0:
            lat[k] = None  # beyond what was answered: requests unsent or unanswered
    return result


def run_wrk(
    port: int,
    requests: Path,
    duration: float,
    *,
    connections: int = 50,
    threads: int = 1,
    cpus: str | None = None,
    script_dir: Path,
) -> dict[str, Any]:
    script = script_dir / "wrk_rotate.lua"
    if not script.exists():
        script.write_text(WRK_LUA)
    cmd = [
        "wrk", f"-t{threads}", f"-c{connections}", f"-d{max(1, round(duration))}s", "--timeout", "10s",
        "-s", str(script), f"http://127.0.0.1:{port}/", "--", str(requests),
    ]  # fmt: skip
    if cpus is not None:
        cmd = ["taskset", "-c", cpus, *cmd]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("WRKJSON "))
    raw = json.loads(line.removeprefix("WRKJSON "))
    non2xx = 0
    for ln in out.splitlines():
        if "Non-2xx or 3xx responses" in ln:
            non2xx = int(ln.rsplit(":", 1)[1])
    seconds = raw["duration_us"] / 1e6
    errors = raw["errors"]
    return {
        "generator": "wrk",
        "connections": connections,
        "duration": seconds,
        "responses": raw["requests"],
        "achieved_rps": raw["requests"] / seconds,
        "errors": {k: errors[k] for k in ("connect", "read", "write", "timeout")},
        "non_2xx_3xx": non2xx,
        "latency_ms": {k: v / 1000 for k, v in raw["latency_us"].items()},
    }


def get_json(url: str, key: str) -> Any:
    reply = httpx.get(url, headers={"authorization": f"Bearer {key}"}, timeout=10)
    reply.raise_for_status()
    return reply.json()


# --- the status workload: tenants, jobs to serve, jobs that move ------------------------------
SHARDS = 16
TENANTS = {f"bench-key-{i}": f"tenant{i}" for i in range(4)}
KEY_OF = {t: k for k, t in TENANTS.items()}
HOT = 5
REQUESTS_PER_FILE = 100_000


# --- tasks run by the fill and the churn worker -----------------------------------------------
@task(name="bench.noop", retries=0)
async def noop(ctx: JobContext, payload: Any) -> None:
    return None


@task(name="bench.hot", retries=0)
async def hot(ctx: JobContext, payload: Any) -> None:
    """Report progress until ``payload["until"]`` (Unix time): a new version every ~0.2 s
    (the worker sends progress at most every 0.2 s)."""
    i = 0
    while time.time() < payload["until"]:
        i += 1
        ctx.progress(i)
        await asyncio.sleep(0.05)


@task(name="bench.step", retries=0)
async def step(ctx: JobContext, payload: Any) -> dict[str, int]:
    await asyncio.sleep(random.uniform(0.2, 0.6))
    ctx.progress(50)
    await asyncio.sleep(random.uniform(0.2, 0.6))
    return {"done": 1}


REGISTRY = TaskRegistry([noop, hot, step])


def settings_for(url: str, **extra: Any) -> Settings:
    return Settings.from_env({}, redis_url=url, shards=SHARDS, **extra)


# --- filling ----------------------------------------------------------------------------------
async def fill(url: str, n: int) -> list[tuple[str, str]]:
    """``n`` jobs over the tenants: 60% run to success by a burst worker, 40% scheduled a
    month ahead (no scheduler runs, so nothing claims them). Returns (id, tenant) pairs."""
    queue = await Queue.connect(settings_for(url), REGISTRY)
    out: list[tuple[str, str]] = []
    tenants = list(KEY_OF)
    try:
        done = int(n * 0.6)
        for start in range(0, n, 1000):
            size = min(1000, n - start)
            tenant = tenants[(start // 1000) % len(tenants)]
            delay = None if start < done else 30 * 86400.0
            specs = [
                JobSpec(type="bench.noop", payload={"i": start + i}, delay=delay)
                for i in range(size)
            ]
            for result in await queue.submit_many(specs, tenant=tenant):
                assert not isinstance(result, Exception)
                out.append((result.job_id, tenant))
            if start + size == done:
                await Worker(queue.store, REGISTRY, concurrency=500, burst=True).run()
    finally:
        await queue.close()
    return out


async def submit_churn(
    url: str, seconds: float, steps: int
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """The churn mix's moving jobs: ``HOT`` progress-reporting jobs and ``steps`` step jobs."""
    queue = await Queue.connect(settings_for(url), REGISTRY)
    tenants = list(KEY_OF)
    try:
        until = time.time() + seconds
        hot_ids = []
        for i in range(HOT):
            job = await queue.submit("bench.hot", {"until": until}, tenant=tenants[i % 4])
            hot_ids.append((job.job_id, tenants[i % 4]))
        step_ids = []
        for start in range(0, steps, 1000):
            tenant = tenants[(start // 1000) % 4]
            specs = [JobSpec(type="bench.step") for _ in range(min(1000, steps - start))]
            for result in await queue.submit_many(specs, tenant=tenant):
                assert not isinstance(result, Exception)
                step_ids.append((result.job_id, tenant))
        return hot_ids, step_ids
    finally:
        await queue.close()


def churn_worker_main(url: str, seconds: float) -> None:
    """(child process) Run the churn jobs for ``seconds``, then stop."""
    import uvloop

    from jobtier import logs

    logs.setup("WARNING")

    async def run() -> None:
        queue = await Queue.connect(settings_for(url), REGISTRY)
        worker = Worker(queue.store, REGISTRY, concurrency=50, shutdown_grace=0.5)
        asyncio.get_running_loop().call_later(seconds, worker.stop)
        await worker.run()
        await queue.close()

    uvloop.run(run())


@contextlib.contextmanager
def churn(
    url: str, seconds: float, steps: int
) -> Iterator[tuple[list[tuple[str, str]], list[tuple[str, str]]]]:
    hot_ids, step_ids = asyncio.run(submit_churn(url, seconds, steps))
    proc = subprocess.Popen(
        [sys.executable, __file__, "--churn-worker", url, str(seconds)], stdin=subprocess.DEVNULL
    )
    try:
        yield hot_ids, step_ids
    finally:
        proc.wait(seconds + 30)
        # leftover step jobs stay queued: drop the ready queues so the next churn cell's
        # worker starts on its own jobs (bench cleanup only; the hashes remain readable)
        r = redis.Redis.from_url(url)
        keys = Keys("jt", SHARDS)
        drop_ready(r, keys)
        r.close()


class StalenessProbe(threading.Thread):
    """Compares, for random churning jobs, the version in Redis with the one the API serves
    right after. Older than Redis on the first read: ``lagging`` (the event may not have
    arrived yet); still older 100 ms later: ``stale`` (an event was lost: a bug)."""

    def __init__(self, url: str, port: int, ids: list[tuple[str, str]]) -> None:
        super().__init__(daemon=True)
        self.url, self.port, self.ids = url, port, ids
        self.stop_flag = threading.Event()
        self.probes = self.lagging = self.stale = self.errors = 0

    def run(self) -> None:
        r = redis.Redis.from_url(self.url)
        keys = Keys("jt", SHARDS)
        with httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=5) as client:
            while not self.stop_flag.wait(0.02):
                job_id, tenant = random.choice(self.ids)
                auth = {"authorization": f"Bearer {KEY_OF[tenant]}"}
                try:
                    held = cast(
                        list[bytes | None],
                        r.hmget(keys.job(job_id), job_format.small_fields("version")),
                    )
                    in_redis = int(job_format.small_field(held, "version") or 0)
                    served = int(
                        client.get(f"/v1/jobs/{job_id}", headers=auth).headers["etag"].strip('"')
                    )
                    self.probes += 1
                    if served < in_redis:
                        self.lagging += 1
                        time.sleep(0.1)
                        again = client.get(f"/v1/jobs/{job_id}", headers=auth)
                        if int(again.headers["etag"].strip('"')) < in_redis:
                            self.stale += 1
                except (httpx.HTTPError, redis.RedisError, KeyError, ValueError):
                    self.errors += 1
        r.close()


async def make_dead(url: str, n: int) -> list[tuple[str, str]]:
    """``n`` dead-lettered jobs (submitted with one attempt, claimed and failed for good by
    the scripts directly), for the replay probe. Call it when no other job is ready (between
    churn cells): the claims take whatever is ready in the shards."""
    queue = await Queue.connect(settings_for(url), REGISTRY)
    tenants = list(KEY_OF)
    out: list[tuple[str, str]] = []
    try:
        for start in range(0, n, 500):
            tenant = tenants[(start // 500) % 4]
            specs = [JobSpec(type="bench.noop", max_attempts=1) for _ in range(min(500, n - start))]
            for result in await queue.submit_many(specs, tenant=tenant):
                assert not isinstance(result, Exception)
                out.append((result.job_id, tenant))
        error = b'{"type":"ValueError","message":"made dead for the replay probe"}'
        for shard in range(SHARDS):
            while True:
                batch = await queue.scripts.claim(shard, "bench-dead", 500, 600_000)
                if not batch.jobs:
                    break
                items = [(j.id, j.lease_version, error, -1) for j in batch.jobs]
                await queue.scripts.call_many([fail_call(shard, "bench-dead", 86400, items)])
    finally:
        await queue.close()
    return out


class ReplayProbe(threading.Thread):
    """Replays dead-lettered jobs that the API has just served (so its near cache holds
    their terminal document), then reads them again: served older than Redis 100 ms after
    the replay is ``stale`` (the replay's event was lost, or a terminal document outlived a
    change: a bug). The replayed jobs then run (the churn worker has their task) and
    finish: terminal again, each change published."""

    def __init__(self, url: str, port: int, ids: list[tuple[str, str]]) -> None:
        super().__init__(daemon=True)
        self.url, self.port, self.ids = url, port, list(ids)
        self.stop_flag = threading.Event()
        self.replays = self.stale = self.errors = 0

    def run(self) -> None:
        from jobtier.store.scripts import Script

        script = Script("replay").text
        r = redis.Redis.from_url(self.url)
        keys = Keys("jt", SHARDS)
        with httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=5) as client:
            while self.ids and not self.stop_flag.wait(0.05):
                job_id, tenant = self.ids.pop()
                auth = {"authorization": f"Bearer {KEY_OF[tenant]}"}
                try:
                    client.get(f"/v1/jobs/{job_id}", headers=auth)  # cached: failed (final)
                    shard = keys.shard_of(job_id)
                    code, doc = r.eval(script, 1, keys.log(shard), keys.base(shard), "", job_id)
                    if code != 0:
                        self.errors += 1
                        continue
                    self.replays += 1
                    time.sleep(0.1)
                    served = client.get(f"/v1/jobs/{job_id}", headers=auth)
                    if int(served.headers["etag"].strip('"')) < parse_version(doc):
                        self.stale += 1
                except (httpx.HTTPError, redis.RedisError, KeyError, ValueError):
                    self.errors += 1
        r.close()


# --- request files ----------------------------------------------------------------------------
def get_requests(ids: list[tuple[str, str]], n: int, seed: int, port: int) -> Iterator[bytes]:
    rng = random.Random(seed)
    for _ in range(n):
        job_id, tenant = ids[rng.randrange(len(ids))]
        yield http_request("GET", f"/v1/jobs/{job_id}", KEY_OF[tenant], port=port)


def churn_requests(
    hot_ids: list[tuple[str, str]],
    step_ids: list[tuple[str, str]],
    fill_ids: list[tuple[str, str]],
    port: int,
) -> Iterator[bytes]:
    rng = random.Random(7)
    for _ in range(REQUESTS_PER_FILE):
        x = rng.random()
        pool = hot_ids if x < 0.8 else step_ids if x < 0.9 else fill_ids
        job_id, tenant = pool[rng.randrange(len(pool))]
        yield http_request("GET", f"/v1/jobs/{job_id}", KEY_OF[tenant], port=port)


if __name__ == "__main__":  # the churn worker process: common_http.py --churn-worker URL SECONDS
    if len(sys.argv) == 4 and sys.argv[1] == "--churn-worker":
        churn_worker_main(sys.argv[2], float(sys.argv[3]))
