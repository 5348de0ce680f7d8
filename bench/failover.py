"""Failover bench: the whole deployment under load while Redis masters are SIGKILLed, audited.

For each set-up (``--setups``) and each durable-submit mode (``--durable``) it starts a fresh
deployment in a temporary folder: replicated Redis — a Redis Cluster of 3 masters with a
replica each (``cluster``), or a master, a replica and three Sentinels (``sentinel``,
JOBTIER_REDIS_SENTINELS) — a durable Postgres, and the processes of the chaos soak
(``chaos.py``: `jobtier api`, `jobtier scheduler`, two persisters and two workers, each in its
own process group, restarted by a supervisor only if one dies by itself). A producer submits
jobs over HTTP at a steady rate, each with an idempotency key (a refused submit is retried
with the same key, so a retry finds its job) and each acknowledged submit followed by a status
read. Then, ``--failovers`` times, it picks a master, waits until its replica is in sync,
SIGKILLs the master, waits until the replica is promoted (by the cluster or the sentinels:
nothing is restarted or reconfigured by hand), starts the killed node again as a replica of
the promoted one, and waits until submits on the lost master's shards succeed again.

After the last failover the load stops, everything settles, and the chaos soak's auditor
(``chaos_audit.py``) checks the deployment: acknowledged submits lost (a 2xx whose job neither
Redis nor Postgres holds at the end), jobs executed twice, history gaps, Postgres equal to
Redis, every job terminal. It reports, per run:

* acknowledged submits lost, with and without durable submit (JOBTIER_SUBMIT_REPLICAS=1);
* seconds to recover per failover, median and max: from the kill until a submit on the lost
  master's shards (a job id's suffix is its shard: shard -> slot -> node) succeeds again, and
  until a job submitted after the kill on those shards has completed;
* every response by status, submits and reads apart: 5xx split into 503 with Retry-After and
  other 5xx, each on the lost master's shards or on other shards (with Sentinel, one master
  holds every shard);
* jobs executed twice (claims beyond those the task's own failures explain).

Failed requests are counted, never a reason to stop: exit status 1 only when an invariant of
the audit does not hold (with durable submit off, lost jobs are a measurement, not a
violation), 2 when stopped by a signal. Bounded: ``--failovers`` kills at most, each wait
bounded, ``--max-seconds`` of failovers per run, ``--settle`` seconds to settle. Every
server and process it starts is stopped on every way out (Ctrl-C and SIGTERM too).

    .venv/bin/python bench/failover.py --failovers 3 --setups cluster   # a quick look
    .venv/bin/python bench/failover.py                                  # 30 per run, 4 runs

Results: bench/results/failover.md and failover.json (``--out DIR`` elsewhere), with the
command line. "Durable" relies on the JOBTIER_SUBMIT_REPLICAS setting; the program says
whether the code it runs knows that setting (when it does not, "on" runs exactly as "off").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import redis as syncredis
from redis.crc import key_slot

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chaos_audit import TERMINAL, audit, job_states
from common import environment, header_markdown, save, table

from chaos import TENANT, Producer, Stack, _cancellable, log_counts
from jobtier.config import Settings
from jobtier.core.keys import Keys
from jobtier.dev.local_redis import LocalRedis
from jobtier.dev.local_replicas import LocalCluster, LocalSentinels, poll
from jobtier.persist.db import create_pool
from jobtier.store import format as job_format
from jobtier.store.redis import connect
from jobtier.streams.group import lag

HERE = Path(__file__).resolve().parent
SETUPS = ("cluster", "sentinel")
DURABLE_ENV = "JOBTIER_SUBMIT_REPLICAS"
# the redis-py failure seen in the hand-run failover (issue 28's 500s): counted in the logs
WRITELINES = "object has no attribute 'writelines'"
LOST_SHARDS, OTHER_SHARDS = "lost master's shards", "other shards"


def log(message: str) -> None:
    print(f"[failover {time.strftime('%H:%M:%S')}] {message}", flush=True)


def durable_support() -> str:
    """Whether the code under test knows JOBTIER_SUBMIT_REPLICAS (another branch adds it)."""
    if "submit_replicas" in {f.name for f in dataclasses.fields(Settings)}:
        return f"{DURABLE_ENV} is a setting of this code (Settings.submit_replicas)"
    return (
        f"{DURABLE_ENV} is NOT a setting of this code: the processes ignore it, so "
        "'durable on' runs exactly as 'durable off'"
    )


# --- the deployment --------------------------------------------------------------------------
class FailoverStack(Stack):
    """The chaos soak's stack (Postgres, the jobtier processes, their supervisor) on
    replicated Redis: a 3 + 3 cluster, or a master, a replica and three sentinels."""

    def __init__(self, folder: Path, args: argparse.Namespace, setup: str, durable: bool):
        super().__init__(folder, args)  # its single LocalRedis is replaced, never started
        self.setup, self.durable = setup, durable
        self.servers: LocalCluster | LocalSentinels
        for name in ("JOBTIER_REDIS_CLUSTER", "JOBTIER_REDIS_SENTINELS", DURABLE_ENV):
            self.env.pop(name, None)  # the caller's own environment decides nothing here
        if setup == "cluster":
            self.servers = LocalCluster(
                folder / "cluster",
                masters=3,
                replicas=args.replicas,
                node_timeout_ms=args.node_timeout_ms,
            )
            redis_env = {"JOBTIER_REDIS_URL": self.servers.url, "JOBTIER_REDIS_CLUSTER": "1"}
            overrides: dict[str, Any] = {"redis_url": self.servers.url, "redis_cluster": True}
        else:
            self.servers = LocalSentinels(
                folder / "sentinels",
                replicas=args.replicas,
                down_after_ms=args.down_after_ms,
                failover_timeout_ms=args.failover_timeout_ms,
            )
            redis_env = {
                "JOBTIER_REDIS_URL": self.servers.url,
                "JOBTIER_REDIS_SENTINELS": self.servers.addresses,
                "JOBTIER_REDIS_SENTINEL_MASTER": self.servers.name,
            }
            overrides = {
                "redis_url": self.servers.url,
                "redis_sentinels": self.servers.addresses,
                "redis_sentinel_master": self.servers.name,
            }
        self.redis = self.servers  # type: ignore[assignment]  # Stack starts and stops it
        self.env.update(redis_env)  # the processes share this mapping
        if durable:
            self.env[DURABLE_ENV] = "1"
        self.settings = Settings.from_env(
            {}, database_url=self.pg.dsn, shards=args.shards, **overrides
        )
        self.keys = Keys(self.settings.prefix, self.settings.shards)

    def durable_as_seen(self) -> str:
        """What a process started with this environment takes for the setting."""
        try:
            value = getattr(Settings.from_env(self.env), "submit_replicas", None)
        except Exception as exc:
            return f"(settings refused: {exc})"
        return "unknown setting" if value is None else str(value)

    # --- failover steps (blocking: run them in a thread) --------------------------------------
    def pick_master(self, rng: random.Random) -> LocalRedis:
        if isinstance(self.servers, LocalCluster):
            return rng.choice(sorted(self.servers.masters(), key=lambda n: n.port))
        return self.servers.master()

    def shards_on(self, node: LocalRedis) -> list[int]:
        """The logical shards whose keys ``node`` serves (every shard for Sentinel)."""
        if isinstance(self.servers, LocalSentinels):
            return list(range(self.keys.shards))
        return [
            shard
            for shard in range(self.keys.shards)
            if self.servers.master_of_slot(key_slot(self.keys.base(shard).encode())) is node
        ]

    def wait_in_sync(self, master: LocalRedis, timeout: float) -> None:
        """Return once ``master`` has a replica online that has acknowledged every write the
        master had made when this was called (and, for Sentinel, every sentinel sees that
        replica up): its kill is then a real failover with a replica to promote."""
        target: int | None = None

        def in_sync() -> bool:
            nonlocal target
            with syncredis.Redis(port=master.port, socket_timeout=2.0) as client:
                info = client.info("replication")
            if target is None:
                target = int(info["master_repl_offset"])
            replicas = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
            caught_up = any(
                r.get("state") == "online" and int(r.get("offset", -1)) >= target for r in replicas
            )
            return caught_up and self._sentinels_see_replica()

        poll(in_sync, timeout, f"the replica of {master.port} was not in sync in {timeout:g}s")

    def _sentinels_see_replica(self) -> bool:
        if not isinstance(self.servers, LocalSentinels):
            return True
        for port in self.servers.sentinel_ports:
            try:
                with syncredis.Redis(port=port, socket_timeout=2.0) as client:
                    replicas = client.sentinel_slaves(self.servers.name)
            except syncredis.RedisError:
                return False
            if not any(
                not r.get("is_sdown") and not r.get("is_disconnected")
                and r.get("master-link-status") == "ok"
                for r in replicas
            ):  # fmt: skip
                return False
        return True


# --- load --------------------------------------------------------------------------------------
@dataclass(slots=True)
class Reply:
    """One HTTP request of the producer: a submit or a status read."""

    kind: str  # "submit" or "read"
    start: float  # monotonic
    end: float
    status: int  # 0: no HTTP answer (connection refused, timeout)
    retry_after: bool
    shard: int
    job_id: str = ""  # an acknowledged submit's job


class FailoverProducer(Producer):
    """The chaos soak's producer (same jobs, idempotency keys, retries of refused submits),
    recording every response with its time and shard, and reading each acknowledged job's
    status once."""

    def __init__(self, url: str, rate: float, rng: random.Random, keys: Keys) -> None:
        super().__init__(url, rate, rng)
        self.keys = keys
        self.replies: list[Reply] = []
        self.shard_mismatches = 0  # a job id's shard other than the key's (should be none)

    async def _send(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            key = await self._queue.get()
            self.attempts += 1
            shard = self.keys.shard_for(TENANT, key)  # where the submit puts the job
            start = time.monotonic()
            try:
                reply = await self.client.post(
                    "/v1/jobs", json=self.bodies[key], headers={"idempotency-key": key}
                )
            except httpx.HTTPError as exc:
                self.failures[type(exc).__name__] += 1
                self.replies.append(Reply("submit", start, time.monotonic(), 0, False, shard))
                loop.call_later(0.5, self._queue.put_nowait, key)
                continue
            done = Reply(
                "submit", start, time.monotonic(), reply.status_code,
                "retry-after" in reply.headers, shard,
            )  # fmt: skip
            self.replies.append(done)
            if reply.status_code not in (200, 202):
                self.failures[f"HTTP {reply.status_code}"] += 1
                loop.call_later(0.5, self._queue.put_nowait, key)  # again, same key
                continue
            job_id = reply.json()["id"]
            done.job_id = job_id
            if self.keys.shard_of(job_id) != shard:
                self.shard_mismatches += 1
                done.shard = self.keys.shard_of(job_id)
            if self.acked.setdefault(key, job_id) != job_id:
                self.conflicts.append(f"{key}: {self.acked[key]} then {job_id}")
            self.unacked.discard(key)
            self.ok_times.append(done.end)
            await self._read(job_id, done.shard)

    async def _read(self, job_id: str, shard: int) -> None:
        start = time.monotonic()
        try:
            reply = await self.client.get(f"/v1/jobs/{job_id}")
        except httpx.HTTPError:
            self.replies.append(Reply("read", start, time.monotonic(), 0, False, shard))
            return
        self.replies.append(
            Reply(
                "read",
                start,
                time.monotonic(),
                reply.status_code,
                "retry-after" in reply.headers,
                shard,
            )
        )


# --- failovers -------------------------------------------------------------------------------
@dataclass
class Failover:
    n: int
    victim: int  # its port
    shards: list[int]  # the logical shards it served
    at: float  # seconds since the run's load began
    killed_wall: float  # time.time() of the kill (job times are wall-clock milliseconds)
    killed_mono: float
    promoted: int | None = None  # the port of the node that took over
    promoted_after: float | None = None  # seconds from the kill
    revived_after: float | None = None  # the killed node a replica again
    submits_back: float | None = None  # a submit on its shards, sent after the kill, succeeded
    completes_back: float | None = None  # a job submitted after the kill there completed
    error: str = ""


def first_submit_back(replies: Sequence[Reply], f: Failover, until: float) -> float | None:
    """Seconds from the kill to the answer of the first successful submit on the lost
    master's shards among those sent after the kill (and before ``until``)."""
    shards = set(f.shards)
    ends = [
        r.end
        for r in replies
        if r.kind == "submit" and r.job_id and r.shard in shards
        and f.killed_mono <= r.start < until
    ]  # fmt: skip
    return round(min(ends) - f.killed_mono, 3) if ends else None


async def run_failovers(
    stack: FailoverStack,
    producer: FailoverProducer,
    args: argparse.Namespace,
    rng: random.Random,
    t0: float,
) -> list[Failover]:
    done: list[Failover] = []
    deadline = time.monotonic() + args.max_seconds
    for n in range(1, args.failovers + 1):
        if time.monotonic() > deadline:
            log(f"--max-seconds {args.max_seconds:g} reached after {n - 1} failovers")
            break
        victim = await asyncio.to_thread(stack.pick_master, rng)
        try:
            await asyncio.to_thread(stack.wait_in_sync, victim, args.step_timeout)
            shards = await asyncio.to_thread(stack.shards_on, victim)
        except (TimeoutError, RuntimeError, syncredis.RedisError) as exc:
            log(f"failover {n}: not started: {exc}")
            break
        f = Failover(n, victim.port, shards, 0.0, time.time(), time.monotonic())
        f.at = round(f.killed_mono - t0, 3)
        done.append(f)
        seen = len(producer.replies)  # a request sent after the kill is answered after it
        stack.servers.kill(victim)
        log(f"failover {n}: killed master {victim.port} (shards {shards})")
        try:
            promoted = await asyncio.to_thread(
                stack.servers.wait_promoted, victim, args.step_timeout
            )
            f.promoted, f.promoted_after = promoted.port, round(time.monotonic() - f.killed_mono, 3)
            await asyncio.to_thread(stack.servers.revive, victim, args.step_timeout)
            f.revived_after = round(time.monotonic() - f.killed_mono, 3)
        except (TimeoutError, RuntimeError, syncredis.RedisError) as exc:
            f.error = str(exc)
            log(f"failover {n}: {exc}; no more failovers in this run")
            break
        # the measure: until submits on its shards succeed again (bounded: counted, not fatal)
        limit = f.killed_mono + args.recover_timeout
        while time.monotonic() < limit:
            if first_submit_back(producer.replies[seen:], f, float("inf")) is not None:
                break
            await asyncio.sleep(0.1)
        log(
            f"failover {n}: {f.promoted} promoted after {f.promoted_after} s, "
            f"{victim.port} a replica again after {f.revived_after} s, submits back after "
            f"{first_submit_back(producer.replies[seen:], f, float('inf'))} s"
        )
        await asyncio.sleep(args.gap)  # steady load on the healed set-up before the next kill
    return done


async def completion_times(
    redis: Any, keys: Keys, replies: Sequence[Reply], failovers: list[Failover]
) -> None:
    """Fill each failover's ``submits_back`` and ``completes_back``: the earliest time a job
    submitted on its shards after the kill (before the next kill) reached a terminal state
    (the job's last transition time, Redis's clock on this machine), from the kill."""
    ends = [f.killed_mono for f in failovers[1:]] + [float("inf")]
    for f, until in zip(failovers, ends, strict=True):
        f.submits_back = first_submit_back(replies, f, until)
        shards = set(f.shards)
        ids = [
            r.job_id for r in replies
            if r.kind == "submit" and r.job_id and r.shard in shards
            and f.killed_mono <= r.start < until
        ]  # fmt: skip
        finished: list[int] = []
        for i in range(0, len(ids), 2000):
            pipe = redis.pipeline(transaction=False)
            for job_id in ids[i : i + 2000]:
                pipe.hmget(keys.job(job_id), job_format.small_fields("state"))
            for values in await pipe.execute():
                state = job_format.small_field(values, "state")
                updated = job_format.small_field(values, "updated")
                if state in TERMINAL and updated:
                    finished.append(int(updated))
        if finished:
            f.completes_back = round(min(finished) / 1000 - f.killed_wall, 3)


# --- settle, counts ---------------------------------------------------------------------------
async def settle(
    stack: FailoverStack, producer: FailoverProducer, redis: Any, limit: float
) -> tuple[bool, float, str]:
    """Stop the load and wait until every submit is acknowledged, every acknowledged job
    Redis holds is terminal and the write-behind lag is 0. A job Redis no longer holds (lost
    with a master's unreplicated writes) cannot become terminal: it is left to the audit."""
    producer.generating = False
    start = time.monotonic()
    done: set[str] = set()
    left = ""
    while time.monotonic() - start < limit:
        try:
            pending = [i for i in producer.acked.values() if i not in done]
            states = await job_states(redis, stack.keys, pending)
            done.update(i for i, s in states.items() if s is None or s in TERMINAL)
            behind = (await lag(redis, stack.keys))[0]
        except Exception as exc:  # a hang guard only: try again
            left = f"error {exc!r}"
            await asyncio.sleep(1.0)
            continue
        waiting = len(producer.acked) - len(done)
        left = f"{len(producer.unacked)} unacknowledged, {waiting} not terminal, lag {behind}"
        if not producer.unacked and not waiting and behind == 0:
            return True, time.monotonic() - start, left
        await asyncio.sleep(1.0)
    return False, time.monotonic() - start, left


def category(r: Reply) -> str:
    if r.status == 0:
        return "no answer"
    if r.status == 503:
        return "503 with Retry-After" if r.retry_after else "503 without Retry-After"
    if r.status >= 500:
        return "other 5xx"
    if 200 <= r.status < 300:
        return "2xx"
    return str(r.status)


def status_counts(replies: Sequence[Reply], failovers: list[Failover]) -> dict[str, Any]:
    """Responses by kind and status; each failure also by where it fell: on the shards of
    the master killed last before it was answered (a request sent just before a kill fails
    because of it), or on other shards."""
    kills = [(f.killed_mono, set(f.shards)) for f in failovers]
    out: dict[str, dict[str, Any]] = {}
    for r in replies:
        kind = out.setdefault(r.kind, {"total": 0, "by_status": Counter(), "failures": {}})
        kind["total"] += 1
        what = category(r)
        kind["by_status"][what] += 1
        if what == "2xx" or what.startswith("4"):
            continue
        shards = next((s for at, s in reversed(kills) if at <= r.end), set())
        where = LOST_SHARDS if r.shard in shards else OTHER_SHARDS
        kind["failures"].setdefault(what, Counter())[where] += 1
    return {
        k: {
            "total": v["total"],
            "by_status": dict(v["by_status"].most_common()),
            "failures": {w: dict(c) for w, c in v["failures"].items()},
        }
        for k, v in out.items()
    }


def healthy_latency(replies: Sequence[Reply], failovers: list[Failover]) -> dict[str, Any]:
    """Milliseconds to answer an acknowledged submit on shards the killed master did not
    serve, sent while a failover was under way (from a kill until submits on its shards
    succeeded again) and sent at any other time: what a failover costs the healthy
    masters' clients. With Sentinel one master holds every shard: no such submit."""
    # a failover whose submits never came back lasts until the next kill (or the end)
    ends = [f.killed_mono for f in failovers[1:]] + [float("inf")]
    windows = [
        (
            f.killed_mono,
            f.killed_mono + f.submits_back if f.submits_back is not None else end,
            set(f.shards),
        )
        for f, end in zip(failovers, ends, strict=True)
    ]
    during: list[float] = []
    outside: list[float] = []
    for r in replies:
        if r.kind != "submit" or not r.job_id:
            continue
        ms = (r.end - r.start) * 1000
        hit = next((w for w in windows if w[0] <= r.start < w[1]), None)
        if hit is None:
            outside.append(ms)
        elif r.shard not in hit[2]:
            during.append(ms)

    def cut(values: list[float]) -> dict[str, Any]:
        if not values:
            return {"n": 0, "p50": None, "p99": None, "max": None}
        ordered = sorted(values)

        def at(q: float) -> float:
            return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)

        return {"n": len(values), "p50": at(0.5), "p99": at(0.99), "max": round(ordered[-1], 1)}

    return {"during": cut(during), "outside": cut(outside)}


def spread(values: Sequence[float | None]) -> dict[str, Any]:
    got = [v for v in values if v is not None]
    return {
        "n": len(got),
        "missing": len(values) - len(got),
        "median": round(statistics.median(got), 2) if got else None,
        "max": round(max(got), 2) if got else None,
    }


def writelines_errors(stack: FailoverStack) -> int:
    total = 0
    for p in stack.procs:
        if p.log_path.exists():
            total += p.log_path.read_text(errors="replace").count(WRITELINES)
    return total


# --- one run ---------------------------------------------------------------------------------
class NotReady(Exception):
    """The deployment did not come up: the run is reported as failed, the next one runs."""


async def wait_ready(stack: FailoverStack, timeout: float) -> str:
    """Wait until the API answers /readyz with 200 (its body); NotReady after ``timeout``."""
    last = ""
    async with httpx.AsyncClient(base_url=stack.url) as probe:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                got = await probe.get("/readyz")
                if got.status_code == 200:
                    return got.text
                last = f"/readyz {got.status_code} {got.text}"
            except httpx.HTTPError as exc:
                last = f"/readyz: {exc!r}"
            await asyncio.sleep(0.2)
    api = next(p for p in stack.procs if p.role == "api")
    raise NotReady(
        f"the API was not ready within {timeout:g} s (last: {last}); its log ends:\n" + api.tail(12)
    )


async def one_run(args: argparse.Namespace, stack: FailoverStack) -> dict[str, Any]:
    rng = random.Random(args.seed)
    redis: Any = None
    pool: Any = None
    producer: FailoverProducer | None = None
    supervisor: asyncio.Task[None] | None = None
    name = f"{stack.setup}, durable {'on' if stack.durable else 'off'}"
    try:
        stack.start_processes()
        supervisor = asyncio.create_task(stack.supervise())
        redis = connect(stack.settings)
        ready = await wait_ready(stack, args.ready_timeout)
        log(f"{name}: up (API {stack.url}); /readyz {ready}")
        log(f"{name}: {DURABLE_ENV}={stack.env.get(DURABLE_ENV, '(unset)')}; the processes' "
            f"settings read it as: {stack.durable_as_seen()}")  # fmt: skip
        stack.t0 = time.monotonic()
        producer = FailoverProducer(stack.url, args.rate, rng, stack.keys)
        producer.backlog = max(1, round(args.rate * args.backlog))
        producer.start(senders=args.senders)
        await asyncio.sleep(args.warmup)
        load_start = time.monotonic()
        failovers = await run_failovers(stack, producer, args, rng, stack.t0)
        load_seconds = time.monotonic() - load_start
        generated = len(producer.bodies) / (time.monotonic() - stack.t0)
        log(f"{name}: {len(failovers)} failovers in {load_seconds:.0f} s; settling")
        settled, settle_seconds, left = await settle(stack, producer, redis, args.settle)
        log(f"{name}: settled={settled} in {settle_seconds:.0f} s ({left}); auditing")
        await completion_times(redis, stack.keys, producer.replies, failovers)
        pool = await create_pool(stack.pg.dsn, min_size=1, max_size=2)
        found = await audit(redis, pool, stack.keys, sorted(producer.acked.values()))
        measured_loss = ("lost", "vanished_from_redis") if not stack.durable else ()
        violations = [v for v in found.violations() if not v.startswith(measured_loss)]
        if not settled:
            violations.append(f"did not settle within {args.settle:g} s: {left}")
        if producer.conflicts:
            violations.append(f"idempotency keys answered with two ids: {producer.conflicts[:3]}")
        if len(failovers) < args.failovers:
            violations.append(f"{len(failovers)} failovers of {args.failovers} took place")
        failed = [f for f in failovers if f.error]
        if failed:
            violations.append(f"failover {failed[0].n} did not complete: {failed[0].error}")
        return {
            "setup": stack.setup,
            "durable": stack.durable,
            "durable_setting_seen": stack.durable_as_seen(),
            "load_seconds": round(load_seconds, 1),
            # jobs generated a second: under --rate when the machine could not keep up
            "submit_rate": round(generated, 1),
            "ticks_skipped": producer.skipped,  # no job made: --backlog submits unacknowledged
            "settled": settled,
            "settle_seconds": round(settle_seconds, 1),
            "left": left,
            "producer": {
                "submitted": len(producer.bodies),
                "acknowledged": len(producer.acked),
                "attempts": producer.attempts,
                "failures": dict(producer.failures.most_common()),
                "conflicts": producer.conflicts,
                "shard_mismatches": producer.shard_mismatches,
            },
            "responses": status_counts(producer.replies, failovers),
            "healthy_latency_ms": healthy_latency(producer.replies, failovers),
            "recovery": {
                "promoted": spread([f.promoted_after for f in failovers]),
                "submits_back": spread([f.submits_back for f in failovers]),
                "completes_back": spread([f.completes_back for f in failovers]),
            },
            "failovers": [
                {k: v for k, v in asdict(f).items() if k != "killed_mono"} for f in failovers
            ],
            "audit": found.summary(),
            "unexpected_exits": stack.exits,
            "logs": log_counts(stack),
            "writelines_errors_logged": writelines_errors(stack),
            "violations": violations,
        }
    finally:
        if supervisor is not None:
            supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await supervisor
        if producer is not None:
            await producer.close()
        if pool is not None:
            await pool.close()
        if redis is not None:
            with contextlib.suppress(Exception):
                await redis.aclose()


# --- the report ------------------------------------------------------------------------------
def _median_max(s: dict[str, Any]) -> str:
    if not s["n"]:
        return f"- ({s['missing']} not measured)"
    text = f"{s['median']} / {s['max']}"
    return text + (f" ({s['missing']} never)" if s["missing"] else "")


def report(data: dict[str, Any]) -> str:
    p = data["parameters"]
    done = [r for r in data["runs"] if "error" not in r]
    md = header_markdown("Failover bench", data["environment"])
    md += (
        f"\n{p['failovers']} master SIGKILLs per run (`--failovers`), each a real failover: "
        f"{p.get('replicas', 1)} replica(s) per master, one in sync before the kill, "
        "promoted by the cluster "
        f"(cluster-node-timeout {p['node_timeout_ms']} ms) or by the sentinels "
        f"(down-after {p['down_after_ms']} ms), the killed node started again as a replica. "
        f"Load: {p['rate']:g} submits/s over HTTP with idempotency keys (a refused submit "
        "retried with its key after 0.5 s), a status read after each acknowledged one. "
        f"{p['shards']} logical shards.\n\n"
        f"Durable submit: {data['durable_support']}.\n\n"
    )
    rows = []
    for r in done:
        a = r["audit"]
        rows.append([
            r["setup"], "on" if r["durable"] else "off", str(len(r["failovers"])),
            f"{r['submit_rate']:g}" + (
                f" ({r['ticks_skipped']:,} ticks skipped)" if r.get("ticks_skipped") else ""
            ),
            f"{a['acknowledged']:,}", f"**{a['lost']['count']}**",
            str(a["vanished_from_redis"]["count"]), f"{a['duplicate_executions']:,}",
            str(a["double_success"]["count"]), str(a["not_terminal"]["count"]),
            str(a["history_problems"]["count"]), str(a["pg_differs"]["count"]),
        ])  # fmt: skip
    md += (
        "## Jobs\n\n*Lost*: acknowledged, and at the end in neither Redis nor Postgres; "
        "*only in Postgres*: Redis lost it, the persister had written it; *run twice*: "
        "claims beyond those the task's own failures explain; *jobs/s*: new submits a second "
        "the producer made (under `--rate` when the machine could not keep up, or when "
        "`--backlog` seconds of submits were unacknowledged: it then skips a tick).\n\n"
        + table(
            [
                "set-up",
                "durable",
                "failovers",
                "jobs/s",
                "acknowledged",
                "lost",
                "only in Postgres",
                "run twice",
                "succeeded twice",
                "not terminal",
                "history gaps",
                "Postgres unlike Redis",
            ],
            rows,
        )
        + "\n\n"
    )
    rows = []
    for r in done:
        rec = r["recovery"]
        rows.append([
            r["setup"], "on" if r["durable"] else "off", _median_max(rec["promoted"]),
            _median_max(rec["submits_back"]), _median_max(rec["completes_back"]),
        ])  # fmt: skip
    md += (
        "## Seconds to recover per failover\n\nFrom the kill: until the replica was promoted; "
        "until a submit on the lost master's shards, sent after the kill, succeeded; until a "
        "job submitted there after the kill completed (a job may complete before the answer to its "
        "submit reaches the producer). Median / max over the failovers.\n\n"
        + table(["set-up", "durable", "promoted", "submits succeed", "a job completes"], rows)
        + "\n\n"
    )
    rows = []
    for r in done:
        for kind in ("submit", "read"):
            got = r["responses"].get(kind)
            if got is None:
                continue
            fails = got["failures"]

            def where(what: str, place: str, fails: dict[str, Any] = fails) -> str:
                return f"{fails.get(what, {}).get(place, 0):,}"

            others = sorted(
                s for s in got["by_status"] if s not in ("2xx", *fails) and s != "no answer"
            )
            rows.append([
                r["setup"], "on" if r["durable"] else "off", kind, f"{got['total']:,}",
                f"{got['by_status'].get('2xx', 0):,}",
                where("503 with Retry-After", LOST_SHARDS),
                where("503 with Retry-After", OTHER_SHARDS),
                f"{where('503 without Retry-After', LOST_SHARDS)} / "
                f"{where('503 without Retry-After', OTHER_SHARDS)}",
                f"{where('other 5xx', LOST_SHARDS)} / {where('other 5xx', OTHER_SHARDS)}",
                f"{where('no answer', LOST_SHARDS)} / {where('no answer', OTHER_SHARDS)}",
                ", ".join(f"{s} {got['by_status'][s]:,}" for s in others) or "0",
            ])  # fmt: skip
    md += (
        "## Responses by status\n\nEach failure is placed on the shards of the master killed "
        "last before the request was answered (*lost*) or on the others (*other*; also before "
        "the first kill). With Sentinel one master holds every shard.\n\n"
        + table(
            [
                "set-up",
                "durable",
                "requests",
                "total",
                "2xx",
                "503 + Retry-After, lost",
                "503 + Retry-After, other",
                "503 no Retry-After, lost / other",
                "other 5xx, lost / other",
                "no answer, lost / other",
                "4xx",
            ],
            rows,
        )
        + "\n\n"
    )
    rows = []
    for r in done:
        lat = r.get("healthy_latency_ms")
        if not lat:
            continue
        for when, label in (
            ("during", "during a failover, other shards"),
            ("outside", "at other times, all shards"),
        ):
            got = lat[when]
            rows.append([
                r["setup"], "on" if r["durable"] else "off", label, f"{got['n']:,}",
                *(f"{got[k]:g}" if got[k] is not None else "-" for k in ("p50", "p99", "max")),
            ])  # fmt: skip
    if rows:
        md += (
            "## Submits on the other masters' shards\n\nAcknowledged submits sent during a "
            "failover (from the kill until submits on its shards succeeded again, or the next "
            "kill) on shards the killed master did not serve, against every acknowledged submit "
            "sent at other times; milliseconds from sending to the answer, at the producer. "
            "With Sentinel one master holds every shard: its row during a failover is empty. "
            "The whole deployment and the producer share the machine (see jobs/s): compare "
            "the two rows of a set-up, not these figures with a latency bench's.\n\n"
            + table(["set-up", "durable", "sent", "submits", "p50 ms", "p99 ms", "max ms"], rows)
            + "\n\n"
        )
    rows = []
    for r in done:
        logs = r["logs"]
        exits = Counter(e["role"] for e in r["unexpected_exits"])
        rows.append([
            r["setup"], "on" if r["durable"] else "off",
            ", ".join(f"{k} {v}" for k, v in exits.items()) or "0",
            ", ".join(f"{k} {v.get('tracebacks', 0)}" for k, v in sorted(logs.items())),
            str(r["writelines_errors_logged"]),
        ])  # fmt: skip
    md += (
        "## Processes\n\n"
        + table(
            [
                "set-up",
                "durable",
                "exited by themselves (restarted)",
                "tracebacks logged",
                "redis-py `writelines` errors logged",
            ],
            rows,
        )
        + "\n\n"
    )
    md += "## Each failover\n\n"
    for r in done:
        md += f"### {r['setup']}, durable {'on' if r['durable'] else 'off'}\n\n"
        md += table(
            [
                "#",
                "at s",
                "killed",
                "shards",
                "promoted",
                "promoted after",
                "replica again after",
                "submits back",
                "a job completes",
                "error",
            ],
            [
                [
                    str(f["n"]),
                    str(f["at"]),
                    str(f["victim"]),
                    ",".join(map(str, f["shards"])),
                    str(f["promoted"]),
                    str(f["promoted_after"]),
                    str(f["revived_after"]),
                    str(f["submits_back"]),
                    str(f["completes_back"]),
                    f["error"] or "-",
                ]
                for f in r["failovers"]
            ],
        )
        md += "\n\n"
    for r in data["runs"]:
        if "error" in r:
            md += (
                f"## {r['setup']}, durable {'on' if r['durable'] else 'off'}: did not take "
                f"place\n\n```text\n{r['error']}\n```\n\n"
            )
    violations = data["violations"]
    md += "## Invariants\n\n" + (
        "All hold: every acknowledged job terminal or accounted for, none lost with durable "
        "submit on, none succeeded twice, history complete, Postgres equal to Redis, every "
        "failover completed. (Lost jobs with durable submit off are a measurement.)\n"
        if not violations
        else "**Violated:**\n\n" + "\n".join(f"- {v}" for v in violations) + "\n"
    )
    return md


# --- main ------------------------------------------------------------------------------------
def _names(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        got = [w.strip() for w in text.split(",") if w.strip()]
        bad = [w for w in got if w not in allowed]
        if bad or not got:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)} (comma-separated)")
        return list(dict.fromkeys(got))

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--failovers", type=int, default=30, help="master kills per run (30)")
    p.add_argument(
        "--replicas", type=int, default=1,
        help="replicas per master (1); with 2, a promoted master still has a replica, so "
        "durable submits need not wait for the killed node to come back",
    )  # fmt: skip
    p.add_argument(
        "--setups", type=_names(SETUPS), default=list(SETUPS),
        help="comma-separated: cluster (3 masters + 3 replicas), sentinel (a master, a "
        "replica, 3 sentinels); default both",
    )  # fmt: skip
    p.add_argument(
        "--durable", type=_names(("on", "off")), default=["on", "off"],
        help=f"comma-separated: on ({DURABLE_ENV}=1), off (unset); each set-up runs once "
        "per value (default on,off)",
    )  # fmt: skip
    p.add_argument("--rate", type=float, default=200.0, help="submits per second (200)")
    p.add_argument(
        "--senders", type=int, default=64,
        help="concurrent HTTP senders: enough that requests held through a failover do not "
        "slow the rate (64)",
    )  # fmt: skip
    p.add_argument(
        "--backlog", type=float, default=5.0,
        help="seconds of --rate the producer may have unacknowledged (waiting, in flight or "
        "to be retried) before it skips a tick: a long refusal then leaves no flood of "
        "submits behind it (5)",
    )  # fmt: skip
    p.add_argument(
        "--node-timeout-ms", type=int, default=2500,
        help="cluster-node-timeout: how long a silent master goes before its replica takes "
        "over (2500)",
    )  # fmt: skip
    p.add_argument(
        "--down-after-ms", type=int, default=2000,
        help="Sentinel down-after-milliseconds (2000)",
    )  # fmt: skip
    p.add_argument(
        "--failover-timeout-ms", type=int, default=4000, help="Sentinel failover-timeout (4000)"
    )
    p.add_argument("--shards", type=int, default=16, help="JOBTIER_SHARDS (16)")
    p.add_argument(
        "--warmup", type=float, default=5.0, help="seconds of load before the first kill (5)"
    )
    p.add_argument(
        "--gap", type=float, default=2.0,
        help="seconds of load after a failover's submits are back, before the next kill (2)",
    )  # fmt: skip
    p.add_argument(
        "--recover-timeout", type=float, default=60.0,
        help="most seconds to wait for submits on the lost master's shards to succeed "
        "again (60; a failover that takes longer is reported as never)",
    )  # fmt: skip
    p.add_argument(
        "--step-timeout", type=float, default=60.0,
        help="most seconds for a replica to sync, be promoted or rejoin (60)",
    )  # fmt: skip
    p.add_argument(
        "--ready-timeout", type=float, default=120.0,
        help="most seconds for the deployment to come up; a run that does not is reported "
        "as failed and the next one runs (120)",
    )  # fmt: skip
    p.add_argument(
        "--max-seconds", type=float, default=1800.0,
        help="most seconds of failovers per run (1800)",
    )  # fmt: skip
    p.add_argument(
        "--settle", type=float, default=300.0, help="most seconds to settle after the load (300)"
    )
    p.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    p.add_argument(
        "--out", type=Path, default=None,
        help="write failover.md/.json here instead of bench/results",
    )  # fmt: skip
    p.add_argument("--keep", action="store_true", help="keep each run's data and logs folder")
    args = p.parse_args(argv)
    if args.failovers < 1:
        p.error("--failovers must be at least 1")
    if args.seed is None:
        args.seed = random.randrange(2**31)
    return args


def failed_run(stack: FailoverStack, error: str) -> dict[str, Any]:
    """The record of a run whose deployment never came up."""
    return {
        "setup": stack.setup,
        "durable": stack.durable,
        "durable_setting_seen": stack.durable_as_seen(),
        "error": error,
        "unexpected_exits": stack.exits,
        "logs": log_counts(stack),
        "violations": [f"the run did not take place: {error.splitlines()[0]}"],
    }


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    support = durable_support()
    log(f"seed {args.seed}; {support}")
    env = environment()
    runs: list[dict[str, Any]] = []
    kept: list[Path] = []
    for setup in args.setups:
        for mode in args.durable:
            # SIGTERM as Ctrl-C outside the event loop too (starting and stopping servers);
            # inside it, _cancellable turns both into a cancellation
            signal.signal(signal.SIGTERM, _interrupt)
            folder = Path(tempfile.mkdtemp(prefix=f"jobtier-failover-{setup}-{mode}-"))
            folder.chmod(0o755)  # Postgres runs as another user when we are root
            log(f"{setup}, durable {mode}: data and logs in {folder}")
            stack = FailoverStack(folder, args, setup, mode == "on")
            try:
                stack.start_services()  # in the main thread: the servers die with us
                runs.append(asyncio.run(_cancellable(one_run(args, stack))))
            except NotReady as exc:
                log(f"{setup}, durable {mode}: {exc}")
                runs.append(failed_run(stack, str(exc)))
            except (asyncio.CancelledError, KeyboardInterrupt):
                log(f"stopped by a signal; logs kept in {folder / 'logs'}")
                return 2
            except BaseException:
                log(f"aborted; logs kept in {folder / 'logs'}")
                raise
            finally:
                signal.signal(signal.SIGTERM, _interrupt)
                with contextlib.suppress(KeyboardInterrupt):
                    stack.close(args.keep)
            if runs[-1]["violations"] or args.keep:
                kept.append(folder)
            else:
                shutil.rmtree(folder, ignore_errors=True)
    violations = [f"{r['setup']}, durable {'on' if r['durable'] else 'off'}: {v}"
                  for r in runs for v in r["violations"]]  # fmt: skip
    data = {
        "environment": env,
        "command": env["command"],
        "parameters": {k: v for k, v in vars(args).items() if k != "out"},
        "durable_support": support,
        "runs": runs,
        "violations": violations,
    }
    md = report(data)
    print(md)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "failover.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
        (args.out / "failover.md").write_text(md)
        where = args.out
    else:
        save("failover", json.loads(json.dumps(data, default=str)), md)
        where = HERE / "results"
    for folder in kept:
        log(f"logs kept in {folder / 'logs'}")
    log(
        f"results in {where}; "
        + ("VIOLATIONS: " + "; ".join(violations) if violations else "all invariants hold")
    )
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
