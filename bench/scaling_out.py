"""Scaling out: the CPU each role spends per job against a 1-master and a 3-master Redis
Cluster, the cost of ``WAIT 1`` per submit, and what 10K and 100K jobs/s would need.

Two measurements, then a projection:

* **Per job, per role** (``--rate`` jobs/s offered for ``--seconds``, after a warm-up): the
  real ``jobtier api`` and ``jobtier worker`` processes (no-op tasks, concurrency 50) against
  a cluster of one master (every slot on one node) and of three, the two topologies
  interleaved in each of ``--runs`` runs. Each submit (``POST /v1/jobs``) is followed by one
  status read of its job (``GET /v1/jobs/{id}``). CPU is read from /proc/<pid>/stat for the
  API (with its children), the worker and every Redis node; per job is that CPU over the
  jobs submitted in the window (the workers keep up at this rate: the backlog at the end is
  recorded). Medians over the runs.
* **WAIT 1 per submit**: a master with one replica (AOF everysec on both); submits of one job
  each (``Queue.submit_many``, one connection), sequential, alone and each followed by
  ``WAIT 1 1000`` on the same connection, interleaved; this process's CPU plus the master's
  per submit, and the latency of each submit (with its WAIT).
* **Projection** (``sizing``): per role, cores = rate x CPU per job / (1 - headroom), each of
  the API, worker and Redis master processes using one core at most (they are single
  threaded); from this run's per-job CPU, and from the headline set's
  (``bench/results/compare-e9c8c99.json``: Redis and the worker at saturation, the persister
  and Postgres per transition, times ``--transitions-per-job``). The assumptions are saved
  with the figures.

    .venv/bin/python bench/scaling_out.py                  # ~4 min
    .venv/bin/python bench/scaling_out.py --runs 5 --rate 400

Results: bench/results/scaling_out.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import redis as syncredis

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RESULTS,
    environment,
    fmt,
    header_markdown,
    median,
    percentile,
    proc_cpu,
    save,
    table,
    tree_cpu,
)

from chaos import API_KEY, TENANT, Proc
from jobtier.config import Settings
from jobtier.core.model import JobSpec
from jobtier.dev.local_redis import LocalRedis, free_port
from jobtier.dev.local_replicas import LocalCluster
from jobtier.engine.queue import Queue

HERE = Path(__file__).resolve().parent
# per-job CPU at saturation (one producer process submitting in batches, one worker), and the
# persister's and Postgres's per transition with the jobs flowing: the headline set
BATCHED_FILE = "compare-e9c8c99"
EVENTS_FILE = "api_scaling"  # an API process's CPU per status event
RATES = (10_000, 100_000)
TOPOLOGIES = (1, 3)


# --- Redis -------------------------------------------------------------------------------------
def one_master_cluster(folder: Path) -> tuple[list[LocalRedis], str]:
    """A cluster of one node serving every slot (redis-cli makes no cluster under three)."""
    node = LocalRedis(folder / "node0", cluster=True).start()
    with syncredis.Redis(port=node.port) as r:
        r.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        deadline = time.monotonic() + 30
        while b"cluster_state:ok" not in r.execute_command("CLUSTER", "INFO"):
            if time.monotonic() > deadline:
                node.stop()
                raise RuntimeError("a one-node cluster did not come up")
            time.sleep(0.05)
    return [node], node.url


@contextlib.contextmanager
def cluster(masters: int, folder: Path) -> Any:
    """(the nodes, a URL) of a fresh cluster of ``masters`` masters, no replicas."""
    if masters == 1:
        nodes, url = one_master_cluster(folder)
        try:
            yield nodes, url
        finally:
            for node in nodes:
                node.stop()
        return
    group = LocalCluster(folder, masters=masters).start()
    try:
        yield group.nodes, group.url
    finally:
        group.stop()


# --- one cell: api + worker against one topology ------------------------------------------------
class Load:
    """Submits at a fixed rate over HTTP/1.1 keep-alive connections, each submit followed by
    a status read of its job on the same connection. Open loop: a submit is due every
    1/rate seconds whatever the answers' pace; due submits wait for a free connection.

    Raw requests on asyncio streams, not an HTTP client library: at these rates a client
    library's own CPU would take a good part of this 2-core machine from what is measured."""

    def __init__(self, port: int, rate: float, connections: int = 32) -> None:
        self.port, self.rate, self.connections = port, rate, connections
        self.submitted = 0
        self.reads = 0
        self.failed = 0
        self.done = 0  # submits answered, with their read
        auth = f"authorization: Bearer {API_KEY}\r\n".encode()
        self._post_head = b"POST /v1/jobs HTTP/1.1\r\nhost: 127.0.0.1\r\n" + auth
        self._get_head = b"host: 127.0.0.1\r\n" + auth + b"\r\n"

    async def _answer(self, reader: asyncio.StreamReader) -> tuple[int, bytes]:
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        return status, await reader.readexactly(length)

    async def _connection(self, due: asyncio.Queue[int]) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            while True:
                n = await due.get()
                body = b'{"type":"noop","payload":{"n":%d}}' % n
                writer.write(
                    self._post_head
                    + b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
                    + body
                )
                status, answer = await self._answer(reader)
                if status not in (200, 202):
                    self.failed += 1
                    self.done += 1
                    continue
                self.submitted += 1
                at = answer.index(b'"id":"') + 6
                job_id = answer[at : answer.index(b'"', at)]
                writer.write(b"GET /v1/jobs/" + job_id + b" HTTP/1.1\r\n" + self._get_head)
                status, _ = await self._answer(reader)
                if status == 200:
                    self.reads += 1
                else:
                    self.failed += 1
                self.done += 1
        finally:
            writer.close()

    async def run(self, seconds: float) -> None:
        """Offer ``rate`` submits a second for ``seconds``, then wait (10 s at most) for
        those due to be answered."""
        loop = asyncio.get_running_loop()
        due: asyncio.Queue[int] = asyncio.Queue()
        workers = [asyncio.create_task(self._connection(due)) for _ in range(self.connections)]
        try:
            start, n = loop.time(), 0
            while (now := loop.time()) < start + seconds:
                at = start + n / self.rate
                if at > now:
                    await asyncio.sleep(at - now)
                due.put_nowait(n)
                n += 1
            deadline = loop.time() + 10
            while self.done < n and loop.time() < deadline:
                await asyncio.sleep(0.05)
        finally:
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)


async def until_ready(url: str, timeout: float = 60.0) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=2.0) as client:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get("/healthz")).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError("the API did not come up")
            await asyncio.sleep(0.1)


async def backlog(queue: Queue) -> int:
    """Jobs not yet terminal (queued or running), over the cluster."""
    total = (await queue.admin.stats())["total"]
    return int(total.get("queued", 0)) + int(total.get("running", 0))


async def until_drained(queue: Queue, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while await backlog(queue):
        if time.monotonic() > deadline:
            raise RuntimeError("the workers did not drain the warm-up's jobs")
        await asyncio.sleep(0.2)


async def cell(masters: int, args: argparse.Namespace) -> dict[str, Any]:
    """One topology: the processes started, warmed up, measured, stopped."""
    with (
        tempfile.TemporaryDirectory(prefix="jobtier-scaling-") as tmp,
        cluster(masters, Path(tmp) / "redis") as (nodes, redis_url),
    ):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
            "JOBTIER_REDIS_URL": redis_url,
            "JOBTIER_REDIS_CLUSTER": "1",
            "JOBTIER_SHARDS": "16",
            "JOBTIER_API_KEYS": f"{API_KEY}:{TENANT}",
            "JOBTIER_ADMIN_KEY": "scaling-admin",
            "JOBTIER_API_PORT": str(port),
            "JOBTIER_LOG_LEVEL": "WARNING",
        }
        logs = Path(tmp) / "logs"
        logs.mkdir()
        cli = [sys.executable, "-m", "jobtier.cli"]
        api = Proc("api", "api", [*cli, "api"], env, logs)
        worker_argv = [*cli, "worker", "chaos_tasks", "--concurrency", "50"]
        worker = Proc("worker", "worker", worker_argv, env, logs)
        queue: Queue | None = None
        try:
            api.start()
            worker.start()
            try:
                await until_ready(url)
            except RuntimeError as exc:
                raise RuntimeError(
                    f"the API did not come up:\n{api.tail()}\n{worker.tail()}"
                ) from exc
            settings = Settings.from_env({}, redis_url=redis_url, redis_cluster=True, shards=16)
            queue = await Queue.connect(
                settings, catalog=False
            )  # to see the backlog (not while measured)
            await Load(port, args.rate).run(args.warmup)
            pids = [n.pid for n in nodes if n.pid is not None]

            def cpu() -> tuple[float, float, list[float]]:
                assert api.proc is not None and worker.proc is not None
                return (
                    tree_cpu(api.proc.pid),
                    proc_cpu(worker.proc.pid),
                    [proc_cpu(p) for p in pids],
                )

            # idle: what the processes spend with no jobs (pings, polls, heartbeats), per second
            await until_drained(queue)
            idle0, t_idle = cpu(), time.monotonic()
            await asyncio.sleep(args.idle)
            idle1, idle_s = cpu(), time.monotonic() - t_idle
            cpu0 = cpu()
            load = Load(port, args.rate)
            t0 = time.monotonic()
            await load.run(args.seconds)
            elapsed = max(time.monotonic() - t0, args.seconds)
            cpu1 = cpu()
            left = await backlog(queue)
        finally:
            if queue is not None:
                await queue.close()
            worker.stop()
            api.stop()
        jobs = max(load.submitted, 1)
        redis_each = [1e6 * (b - a) / jobs for a, b in zip(cpu0[2], cpu1[2], strict=True)]
        idle = {
            "api": (idle1[0] - idle0[0]) / idle_s,
            "worker": (idle1[1] - idle0[1]) / idle_s,
            "redis": (sum(idle1[2]) - sum(idle0[2])) / idle_s,
        }

        def marginal(total_us: float, role: str) -> float:
            """CPU per job less the idle CPU of the same span, spread over the jobs."""
            return round(float(total_us - 1e6 * idle[role] * elapsed / jobs), 1)

        return {
            "masters": masters,
            "jobs": load.submitted,
            "reads": load.reads,
            "failed": load.failed,
            # over the window and the wait for the last answers
            "jobs_per_second": round(load.submitted / elapsed, 1),
            "backlog_at_end": left,
            "api_cpu_us_per_job": round(1e6 * (cpu1[0] - cpu0[0]) / jobs, 1),
            "worker_cpu_us_per_job": round(1e6 * (cpu1[1] - cpu0[1]) / jobs, 1),
            "redis_cpu_us_per_job": round(sum(redis_each), 1),
            "redis_cpu_us_per_job_per_node": [round(x, 1) for x in redis_each],
            "idle_cpu_share": {k: round(v, 4) for k, v in idle.items()},
            "api_marginal_us_per_job": marginal(1e6 * (cpu1[0] - cpu0[0]) / jobs, "api"),
            "worker_marginal_us_per_job": marginal(1e6 * (cpu1[1] - cpu0[1]) / jobs, "worker"),
            "redis_marginal_us_per_job": marginal(sum(redis_each), "redis"),
        }


# --- WAIT 1 -------------------------------------------------------------------------------------
async def wait_cost(args: argparse.Namespace) -> dict[str, Any]:
    """Submits alone and each followed by WAIT 1 on one connection, interleaved rounds."""
    with tempfile.TemporaryDirectory(prefix="jobtier-wait-") as tmp:
        master = LocalRedis(Path(tmp) / "master").start()
        replica = LocalRedis(
            Path(tmp) / "replica", options={"replicaof": ("127.0.0.1", master.port)}
        )
        try:
            replica.start()
            with syncredis.Redis(port=master.port) as r:
                deadline = time.monotonic() + 30
                while r.info("replication").get("slave0", {}).get("state") != "online":
                    if time.monotonic() > deadline:
                        raise RuntimeError("the replica did not connect")
                    time.sleep(0.05)
            settings = Settings.from_env(
                {}, redis_url=master.url, shards=16, redis_max_connections=1
            )
            queue = await Queue.connect(settings, catalog=False)
            try:
                samples: dict[str, dict[str, list[float]]] = {
                    v: {"lat": [], "client": [], "redis": [], "replica": []}
                    for v in ("submit", "submit+WAIT")
                }
                for round_ in range(args.wait_rounds * 2):
                    variant = ("submit", "submit+WAIT")[round_ % 2]
                    await wait_round(queue, master, replica, variant, args, samples[variant])
            finally:
                await queue.close()
        finally:
            replica.stop()
            master.stop()
    out: dict[str, Any] = {}
    for variant, s in samples.items():
        out[variant] = {
            "latency_p50_us": round(percentile(s["lat"], 50), 1),
            "latency_p99_us": round(percentile(s["lat"], 99), 1),
            "client_cpu_us": round(median(s["client"]), 1),
            "master_cpu_us": round(median(s["redis"]), 1),
            "replica_cpu_us": round(median(s["replica"]), 1),
        }
    a, b = out["submit"], out["submit+WAIT"]
    out["wait_adds"] = {
        "client_cpu_us": round(b["client_cpu_us"] - a["client_cpu_us"], 1),
        "master_cpu_us": round(b["master_cpu_us"] - a["master_cpu_us"], 1),
        "latency_p50_us": round(b["latency_p50_us"] - a["latency_p50_us"], 1),
        "latency_p99_us": round(b["latency_p99_us"] - a["latency_p99_us"], 1),
    }
    return out


async def wait_round(
    queue: Queue,
    master: LocalRedis,
    replica: LocalRedis,
    variant: str,
    args: argparse.Namespace,
    samples: dict[str, list[float]],
) -> None:
    """``args.wait_submits`` sequential submits; per-submit CPU of this process and of the
    master (median of rounds), and every submit's latency."""
    redis = queue.redis
    spec = [JobSpec(type="noop", payload={"n": 1})]
    assert master.pid is not None and replica.pid is not None
    c0, m0, r0 = time.process_time(), proc_cpu(master.pid), proc_cpu(replica.pid)
    for _ in range(args.wait_submits):
        t = time.perf_counter()
        [sub] = await queue.submit_many(spec, tenant=TENANT)
        assert not isinstance(sub, Exception)
        if variant == "submit+WAIT":
            acked = await redis.execute_command("WAIT", 1, 1000)
            assert int(acked) >= 1
        samples["lat"].append(1e6 * (time.perf_counter() - t))
    n = args.wait_submits
    samples["client"].append(1e6 * (time.process_time() - c0) / n)
    samples["redis"].append(1e6 * (proc_cpu(master.pid) - m0) / n)
    samples["replica"].append(1e6 * (proc_cpu(replica.pid) - r0) / n)


# --- projection ---------------------------------------------------------------------------------
def batched_costs() -> dict[str, Any]:
    """Per-job CPU of Redis and the worker, and per-transition CPU of the persister and
    Postgres, from the headline set (medians of its runs, AOF everysec)."""
    data = json.loads((RESULTS / f"{BATCHED_FILE}.json").read_text())["summary"]
    alone, persist = data["jobtier"]["everysec"], data["jobtier-persist"]["everysec"]
    return {
        "source": f"bench/results/{BATCHED_FILE}.json summary, everysec",
        "redis_cpu_us_per_job": round(alone["redis_cpu_us_per_job"], 1),
        "worker_cpu_us_per_job": round(alone["worker_cpu_us_per_job"], 1),
        "persister_cpu_us_per_transition": round(persist["persister_cpu_us_per_transition"], 1),
        "postgres_cpu_us_per_transition": round(persist["postgres_cpu_us_per_transition"], 1),
    }


def event_cost() -> dict[str, Any]:
    """CPU an API process spends on one status event (a job it does not cache), from
    ``bench/results/api_scaling.json``: every process receives every shard's events."""
    data = json.loads((RESULTS / f"{EVENTS_FILE}.json").read_text())
    return {
        "source": f"bench/results/{EVENTS_FILE}.json event_us_absent",
        "event_us": round(data["event_us_absent"], 2),
    }


def processes(rate: int, us: float, usable: float, share: float = 0.0) -> int | None:
    """Single-threaded processes for ``rate`` jobs/s at ``us`` CPU each, a core each, of which
    ``usable`` may be used and ``share`` goes to work every process does whatever its load
    (status events); None when that work alone takes the usable part."""
    if share >= usable:
        return None
    return math.ceil(rate * us / 1e6 / (usable - share))


def sizing(
    per_job: dict[str, float],
    wait: dict[str, float],
    batched: dict[str, Any],
    events: dict[str, Any],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Processes (cores) per role at 10K and 100K jobs/s, from two per-job costs: this run's
    3-master marginal CPU (``measured``: submits one by one over HTTP at ``--rate``, each
    script call alone) and the headline set's (``batched``: the same scripts at saturation,
    claims and completions batched). The API has only the first (the headline set has no
    API). Durable submit adds WAIT 1's client CPU to the API and its master CPU to Redis.

    Every API process receives every status event (one a transition, ``--transitions-per-job``
    a job): that share of its core is taken first, at each rate."""
    usable = 1.0 - args.headroom
    tpj = args.transitions_per_job
    persister = tpj * batched["persister_cpu_us_per_transition"]
    postgres = tpj * batched["postgres_cpu_us_per_transition"]
    redis, api = per_job["redis_marginal_us_per_job"], per_job["api_marginal_us_per_job"]
    roles: dict[str, tuple[float, float]] = {
        "Redis masters": (redis, batched["redis_cpu_us_per_job"]),
        "Redis masters, durable submit (WAIT 1)": (
            redis + wait["master_cpu_us"],
            batched["redis_cpu_us_per_job"] + wait["master_cpu_us"],
        ),
        "API processes": (api, api),
        "API processes, durable submit (WAIT 1)": (
            api + wait["client_cpu_us"],
            api + wait["client_cpu_us"],
        ),
        "worker processes (no-op tasks)": (
            per_job["worker_marginal_us_per_job"],
            batched["worker_cpu_us_per_job"],
        ),
        "persisters": (persister, persister),
        "Postgres cores": (postgres, postgres),
    }
    share = {rate: rate * tpj * events["event_us"] / 1e6 for rate in RATES}
    out: dict[str, Any] = {
        "api_events_core_share": {f"at_{r // 1000}k": round(share[r], 3) for r in RATES}
    }
    for role, costs in roles.items():
        out[role] = {}
        for name, us in zip(("measured", "batched"), costs, strict=True):
            api = role.startswith("API")
            out[role][name] = {
                "cpu_us_per_job": round(us, 1),
                **{
                    f"at_{rate // 1000}k": processes(rate, us, usable, share[rate] if api else 0)
                    for rate in RATES
                },
            }
    return out


# --- main ---------------------------------------------------------------------------------------
async def bench(args: argparse.Namespace) -> dict[str, Any]:
    env = environment()
    runs: list[dict[str, Any]] = []
    for i in range(args.runs):
        order = TOPOLOGIES if i % 2 == 0 else TOPOLOGIES[::-1]
        run = {}
        for masters in order:
            print(f"run {i + 1}/{args.runs}: {masters} master(s)", flush=True)
            run[str(masters)] = await cell(masters, args)
            print("  ", run[str(masters)], flush=True)
        runs.append(run)
    medians = {
        str(m): {
            key: round(median([r[str(m)][key] for r in runs]), 1)
            for key in (
                "api_cpu_us_per_job", "worker_cpu_us_per_job", "redis_cpu_us_per_job",
                "api_marginal_us_per_job", "worker_marginal_us_per_job",
                "redis_marginal_us_per_job", "jobs_per_second", "backlog_at_end",
            )
        }
        for m in TOPOLOGIES
    }  # fmt: skip
    print("WAIT 1 per submit", flush=True)
    wait = await wait_cost(args)
    batched = batched_costs()
    events = event_cost()
    assumptions = {
        "headroom": args.headroom,
        "transitions_per_job": args.transitions_per_job,
        "status_reads_per_job": 1,
        "per_core": "figures are CPU on this machine's cores; one API, worker or Redis master "
        "process uses one core at most",
        "shards": "16 shards spread evenly over the masters; submits spread evenly over shards",
        "tasks": "no-op tasks: a real task's own CPU adds to the workers",
        "near_cache": "one status read per submit, right after it (a near-cache miss mostly); "
        "more reads of a job between its changes are near-cache hits, costing the API only",
    }
    return {
        **env,
        "args": dict(vars(args)),
        "runs": runs,
        "medians": medians,
        "wait": wait,
        "batched": batched,
        "assumptions": assumptions,
        "events": events,
        "sizing": sizing(medians["3"], wait["wait_adds"], batched, events, args),
    }


def report(data: dict[str, Any]) -> str:
    out = [header_markdown("Scaling out: CPU per job per role, WAIT 1, sizing", data)]
    a = data["args"]
    out.append(
        f"\n## CPU per job ({a['rate']} jobs/s offered for {a['seconds']} s, one status read "
        f"per submit; medians of {a['runs']} interleaved runs)\n"
    )
    rows = [
        [
            f"{m} master(s)",
            f"{fmt(med['api_cpu_us_per_job'], 1)} / {fmt(med['api_marginal_us_per_job'], 1)}",
            f"{fmt(med['worker_cpu_us_per_job'], 1)} / {fmt(med['worker_marginal_us_per_job'], 1)}",
            f"{fmt(med['redis_cpu_us_per_job'], 1)} / {fmt(med['redis_marginal_us_per_job'], 1)}",
            fmt(med["jobs_per_second"], 1),
            fmt(med["backlog_at_end"], 0),
        ]
        for m, med in data["medians"].items()
    ]
    out.append(
        table(
            [
                "Redis",
                "API µs/job",
                "worker µs/job",
                "Redis µs/job (all nodes)",
                "jobs/s",
                "backlog at end",
            ],
            rows,
        )
    )
    out.append(
        "\nEach CPU cell: all the process's CPU over the jobs / marginal (less its idle CPU "
        "over the same span: pings, polls, heartbeats)."
    )
    w = data["wait"]
    out.append("\n## WAIT 1 per submit (a master with one replica, one connection, sequential)\n")
    out.append(
        table(
            [
                "",
                "latency p50 µs",
                "latency p99 µs",
                "client CPU µs",
                "master CPU µs",
                "replica CPU µs",
            ],
            [
                [
                    v,
                    fmt(w[v]["latency_p50_us"], 1),
                    fmt(w[v]["latency_p99_us"], 1),
                    fmt(w[v]["client_cpu_us"], 1),
                    fmt(w[v]["master_cpu_us"], 1),
                    fmt(w[v]["replica_cpu_us"], 1),
                ]
                for v in ("submit", "submit+WAIT")
            ],
        )
    )
    add = w["wait_adds"]
    out.append(
        f"\nWAIT 1 adds {fmt(add['client_cpu_us'], 1)} µs of client CPU, "
        f"{fmt(add['master_cpu_us'], 1)} µs of the master's and {fmt(add['latency_p50_us'], 1)} µs at p50 ({fmt(add['latency_p99_us'], 1)} µs "
        "at p99) per submit.\n"
    )
    b = data["batched"]
    out.append(
        f"\n## Sizing: processes (cores) at 10K and 100K jobs/s, headroom "
        f"{data['assumptions']['headroom']}\n\n"
        "measured: this run's 3-master marginal CPU per job (submits one by one over HTTP). "
        f"batched: from `{b['source']}` (Redis {b['redis_cpu_us_per_job']} µs and the worker "
        f"{b['worker_cpu_us_per_job']} µs per job at saturation; the persister "
        f"{b['persister_cpu_us_per_transition']} µs and Postgres "
        f"{b['postgres_cpu_us_per_transition']} µs per transition, "
        f"{data['assumptions']['transitions_per_job']} transitions per job, in both columns); "
        "the API's cost is this run's in both.\n"
    )
    share = data["sizing"]["api_events_core_share"]
    out.append(
        f"Every API process handles every status event ({data['events']['event_us']} µs each, "
        f"from `{data['events']['source']}`): {fmt(100 * share['at_10k'], 1)}% of its core at "
        f"10K jobs/s, {fmt(100 * share['at_100k'], 1)}% at 100K, taken before its requests. "
        "`none`: the events alone take the usable part of every process's core.\n"
    )

    def n(value: int | None) -> str:
        return "none" if value is None else str(value)

    rows = []
    for role, both in data["sizing"].items():
        if role == "api_events_core_share":
            continue
        m, bb = both["measured"], both["batched"]
        rows.append([
            role, fmt(m["cpu_us_per_job"], 1), n(m["at_10k"]), n(m["at_100k"]),
            fmt(bb["cpu_us_per_job"], 1), n(bb["at_10k"]), n(bb["at_100k"]),
        ])  # fmt: skip
    out.append(
        table(
            [
                "role",
                "measured µs/job",
                "10K jobs/s",
                "100K jobs/s",
                "batched µs/job",
                "10K jobs/s",
                "100K jobs/s",
            ],
            rows,
        )
    )
    out.append("\nAssumptions:\n")
    out += [f"- {k}: {v}" for k, v in data["assumptions"].items()]
    return "\n".join(out)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--rate", type=float, default=300.0, help="jobs/s offered")
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--idle", type=float, default=3.0, help="seconds of idle CPU measured")
    p.add_argument("--wait-rounds", type=int, default=5)
    p.add_argument("--wait-submits", type=int, default=2000)
    p.add_argument("--headroom", type=float, default=0.5, help="share of each core kept free")
    p.add_argument("--transitions-per-job", type=int, default=3)
    p.add_argument("--name", default="scaling_out")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    # a SIGTERM unwinds like Ctrl-C: the cells' finally blocks stop the processes and servers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    data = asyncio.run(bench(args))
    markdown = report(data)
    print(markdown)
    for path in save(args.name, data, markdown):
        print(f"saved {path}")


if __name__ == "__main__":
    main()
