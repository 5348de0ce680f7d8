"""Chaos soak: the whole system as separate processes, killed at random under load, audited.

It starts its own redis-server (AOF, everysec) and Postgres (durable) in a temporary folder,
runs `jobtier migrate`, then the deployment as separate processes with the real CLI — `jobtier
api`, `jobtier worker` x2, `jobtier scheduler`, `jobtier persister` x2, each in its own
process group, each restarted when it dies (a supervisor's job) — and a producer that submits
jobs over HTTP with idempotency keys, retrying each until acknowledged and recording every
acknowledged id. Meanwhile a driver SIGKILLs random workers, persisters, schedulers and API
processes (restarting each), SIGKILLs Redis (restarted from its AOF, sometimes right after an
AOF rewrite), and stops Postgres for a while (fast or immediate shutdown, or its postmaster
SIGKILLed). Then load stops, everything runs for a bounded settle time, and the auditor
(``chaos_audit.py``) checks the invariants: every acknowledged job terminal and none lost,
none succeeded twice, Postgres history complete and Postgres equal to Redis, lag 0 once
drained. Loopback only; bounded in time and in kills.

    .venv/bin/python bench/chaos.py --short                     # ~2 min; `make test` runs it
    .venv/bin/python bench/chaos.py --kills 1000 --pg-down 60   # the long soak (~25 min)

It prints a table and saves bench/results/chaos.md and chaos.json (``--out DIR`` elsewhere);
exit status 1 when an invariant does not hold.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chaos_audit import TERMINAL, Audit, audit, job_states
from common import environment, header_markdown, save, table

from jobtier.config import Settings
from jobtier.core.keys import Keys
from jobtier.dev.local_postgres import LocalPostgres
from jobtier.dev.local_redis import LocalRedis, free_port
from jobtier.persist.db import create_pool
from jobtier.store.redis import connect
from jobtier.streams.group import lag

HERE = Path(__file__).resolve().parent
API_KEY, TENANT, ADMIN_KEY = "chaos-key", "chaos", "chaos-admin"
PROCESS_ROLES = ("worker", "persister", "scheduler", "api")
ROLES = (*PROCESS_ROLES, "redis", "postgres")
# how often each role is picked for a kill, in the long run
WEIGHTS = {"worker": 30, "persister": 25, "scheduler": 12, "api": 15, "redis": 12, "postgres": 6}
LEASE_SECONDS = 5.0  # a killed worker's jobs come back after this (heartbeats every third)
CLAIM_IDLE_SECONDS = 5.0  # a killed persister's entries are taken over after this
WORKER_ARGS = ["worker", "chaos_tasks", "--concurrency", "20", "--grace", "2"]
RESTART_AFTER = 1.0  # seconds a process that died by itself stays down (its supervisor's)


def log(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", flush=True)


# --- processes ---------------------------------------------------------------------------------
class Proc:
    """One jobtier process in its own process group; its log is appended across restarts."""

    def __init__(self, name: str, role: str, argv: list[str], env: dict[str, str], logs: Path):
        self.name, self.role, self.argv, self.env = name, role, argv, env
        self.log_path = logs / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.wanted = False  # the supervisor restarts it when it dies by itself
        self.starts = 0
        self.every: list[subprocess.Popen[bytes]] = []  # each one started, for the last sweep

    def start(self) -> None:
        """Start it, unless it runs (a supervisor's restart racing the driver's, say)."""
        if self.proc is not None and self.proc.poll() is None:
            return
        with self.log_path.open("ab") as out:
            out.write(f"=== start {self.starts + 1} at {time.strftime('%H:%M:%S')}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self.every.append(self.proc)
        self.starts += 1
        self.wanted = True

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def kill(self) -> None:
        """SIGKILL the whole process group (an API server's worker processes too)."""
        self.wanted = False
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        """SIGTERM (a graceful stop), SIGKILL after 20 s; then any earlier start still
        running is killed too (none should be: a last guard against leaving one behind)."""
        self.wanted = False
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
        for proc in self.every:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def kill_postmaster(pg: LocalPostgres) -> None:
    pid = int((pg.data / "postmaster.pid").read_text().split()[0])
    os.kill(pid, signal.SIGKILL)


def start_postgres(pg: LocalPostgres) -> None:
    """Start; after a SIGKILLed postmaster its orphaned backends may hold the shared memory
    for a moment, and the start is refused until they are gone."""
    deadline = time.monotonic() + 120
    while True:
        try:
            pg.start()
            return
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@dataclass
class Event:
    at: float  # seconds since the chaos began
    role: str
    target: str
    action: str
    back_at: float | None = None  # when it was started again
    # seconds from back_at until a submit succeeded again, and until the lag drained
    submits_back: float | None = None
    lag_drained: float | None = None
    postgres_down_meanwhile: bool = False  # (its lag could not drain before Postgres was back)


class Stack:
    """Redis, Postgres and the jobtier processes of one soak, and their supervisor."""

    def __init__(self, folder: Path, args: argparse.Namespace) -> None:
        self.folder = folder
        self.logs = folder / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.redis = LocalRedis(folder / "redis")
        self.pg = LocalPostgres(folder / "pg", durable=True)
        self.api_port = free_port()
        self.url = f"http://127.0.0.1:{self.api_port}"
        self.settings = Settings.from_env(
            {}, redis_url=self.redis.url, database_url=self.pg.dsn, shards=args.shards
        )
        self.keys = Keys(self.settings.prefix, self.settings.shards)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
            "JOBTIER_REDIS_URL": self.redis.url,
            "JOBTIER_DATABASE_URL": self.pg.dsn,
            "JOBTIER_SHARDS": str(args.shards),
            "JOBTIER_LEASE_SECONDS": str(LEASE_SECONDS),
            "JOBTIER_PERSIST_CLAIM_IDLE_SECONDS": str(CLAIM_IDLE_SECONDS),
            "JOBTIER_API_KEYS": f"{API_KEY}:{TENANT}",
            "JOBTIER_ADMIN_KEY": ADMIN_KEY,
            "JOBTIER_API_PORT": str(self.api_port),
            "JOBTIER_LOG_LEVEL": "INFO",
        }
        self.env = env
        cli = [sys.executable, "-m", "jobtier.cli"]
        self.procs = [
            Proc("api", "api", [*cli, "api"], env, self.logs),
            Proc("scheduler", "scheduler", [*cli, "scheduler"], env, self.logs),
            *(
                Proc(f"persister-{i}", "persister", [*cli, "persister"], env, self.logs)
                for i in (1, 2)
            ),
            *(
                Proc(f"worker-{i}", "worker", [*cli, *WORKER_ARGS], env, self.logs)
                for i in (1, 2)
            ),
        ]  # fmt: skip
        self.exits: list[dict[str, Any]] = []  # processes that died by themselves
        self.t0 = time.monotonic()
        self._closing = False

    def by_role(self, role: str) -> list[Proc]:
        return [p for p in self.procs if p.role == role]

    def start_services(self) -> None:
        self.redis.start()
        self.pg.start()
        subprocess.run(
            [sys.executable, "-m", "jobtier.cli", "migrate"], env=self.env, check=True,
            stdout=subprocess.DEVNULL,
        )  # fmt: skip

    def start_processes(self) -> None:
        for p in self.procs:
            p.start()

    async def supervise(self) -> None:
        """Start again every process that died by itself, as systemd or Docker would."""
        while not self._closing:
            for p in self.procs:
                code = p.exited()
                if p.wanted and code is not None:
                    p.wanted = False
                    self.exits.append({
                        "at": round(time.monotonic() - self.t0, 1), "process": p.name,
                        "role": p.role, "code": code, "log": p.tail(),
                    })  # fmt: skip
                    log(f"{p.name} exited by itself with {code}; restarting it")
                    asyncio.get_running_loop().call_later(RESTART_AFTER, self._restart, p)
            await asyncio.sleep(0.2)

    def _restart(self, p: Proc) -> None:
        if not self._closing and p.exited() is not None:
            p.start()

    def close(self, keep_data: bool) -> None:
        """Stop every process and server (idempotent: also the last resort of ``main``)."""
        self._closing = True
        for p in self.procs:
            p.stop()
        self.redis.stop()
        if keep_data:
            self.pg.stop()
        else:
            self.pg.destroy()


# --- load --------------------------------------------------------------------------------------
class Producer:
    """Submits jobs at a steady rate, each with an idempotency key, retrying each until the API
    acknowledges it; records every acknowledged id."""

    def __init__(self, url: str, rate: float, rng: random.Random) -> None:
        self.client = httpx.AsyncClient(
            base_url=url, headers={"authorization": f"Bearer {API_KEY}"}, timeout=10.0
        )
        self.rate, self.rng = rate, rng
        self.bodies: dict[str, dict[str, Any]] = {}
        self.acked: dict[str, str] = {}  # idempotency key -> job id
        self.unacked: set[str] = set()
        self.conflicts: list[str] = []  # a key answered with two different ids
        self.attempts = 0
        self.failures: Counter[str] = Counter()
        self.ok_times: list[float] = []
        self.generating = True
        # most submits not yet acknowledged (waiting, in flight or to be retried): at the
        # bound a tick makes no job, so a stretch of refusals does not leave a backlog that
        # floods the API once it answers again (None: no bound)
        self.backlog: int | None = None
        self.skipped = 0  # ticks that made no job for the bound
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, senders: int = 8) -> None:
        self._tasks = [asyncio.create_task(self._generate())]
        self._tasks += [asyncio.create_task(self._send()) for _ in range(senders)]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.client.aclose()

    async def _generate(self) -> None:
        n = 0
        start = time.monotonic()
        tick = 0
        while self.generating:
            tick += 1
            # on a clock: the n-th tick is due at start + n / rate however late the loop wakes
            # (a plain sleep of 1 / rate each falls short of the rate on a busy machine)
            await asyncio.sleep(max(0.0, start + tick / self.rate - time.monotonic()))
            if not self.generating:
                break
            if self.backlog is not None and len(self.unacked) >= self.backlog:
                self.skipped += 1
                continue
            n += 1
            key = f"chaos-{n}"
            if self.rng.random() < 0.15:
                body: dict[str, Any] = {
                    "type": "flaky",
                    "payload": {"n": n, "succeed_on": self.rng.choice([2, 3])},
                }
            else:
                # a few take longer: a killed worker then often holds some, whose leases expire
                roll = self.rng.random()
                ms = self.rng.randint(0, 5)
                if roll < 0.02:
                    ms = self.rng.randint(500, 2000)
                elif roll < 0.10:
                    ms = self.rng.randint(50, 300)
                body = {"type": "noop", "payload": {"n": n, "ms": ms}}
            body["max_attempts"] = 10
            self.bodies[key] = body
            self.unacked.add(key)
            self._queue.put_nowait(key)

    async def _send(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            key = await self._queue.get()
            self.attempts += 1
            try:
                reply = await self.client.post(
                    "/v1/jobs", json=self.bodies[key], headers={"idempotency-key": key}
                )
            except httpx.HTTPError as exc:
                self.failures[type(exc).__name__] += 1
            else:
                if reply.status_code in (200, 202):
                    job_id = reply.json()["id"]
                    if self.acked.setdefault(key, job_id) != job_id:
                        self.conflicts.append(f"{key}: {self.acked[key]} then {job_id}")
                    self.unacked.discard(key)
                    self.ok_times.append(time.monotonic())
                    continue
                self.failures[f"HTTP {reply.status_code}"] += 1
            loop.call_later(0.5, self._queue.put_nowait, key)  # again, same key


class LagMonitor:
    """Samples lag() twice a second (through Redis restarts)."""

    def __init__(self, redis: Any, keys: Keys) -> None:
        self.redis, self.keys = redis, keys
        self.samples: list[tuple[float, int]] = []
        self.errors = 0

    async def run(self) -> None:
        while True:
            try:
                self.samples.append((time.monotonic(), (await lag(self.redis, self.keys))[0]))
            except Exception:  # Redis restarting: no sample
                self.errors += 1
            await asyncio.sleep(0.5)


# --- the driver --------------------------------------------------------------------------------
class Driver:
    def __init__(self, stack: Stack, args: argparse.Namespace, rng: random.Random) -> None:
        self.stack, self.args, self.rng = stack, args, rng
        self.events: list[Event] = []
        self.kills: Counter[str] = Counter()
        self.redis_busy = False
        self.pg_busy = False
        self.redis_back_at = 0.0
        self.pg_back_at = 0.0
        self._background: set[asyncio.Task[None]] = set()
        self._pg_modes: list[str] = []

    def now(self) -> float:
        return time.monotonic() - self.stack.t0

    def plan(self) -> Iterator[str]:
        """The roles to kill, in order: --short names each role a fixed number of times,
        shuffled; otherwise weighted random picks among the roles that may go down now."""
        if self.args.short:
            roles = [r for r in ROLES for _ in range(self.args.per_role)]
            self.rng.shuffle(roles)
            yield from roles
            return
        for _ in range(self.args.kills):
            eligible = [r for r in ROLES if self._may_go_down(r)]
            yield self.rng.choices(eligible, [WEIGHTS[r] for r in eligible])[0]

    def _may_go_down(self, role: str) -> bool:
        if role in PROCESS_ROLES:
            return any(p.wanted and p.exited() is None for p in self.stack.by_role(role))
        if role == "redis":  # keep it up a while between restarts: service in between
            return not self.redis_busy and self.now() - self.redis_back_at > 10
        if role == "postgres":  # down at most a third of the time
            return not self.pg_busy and self.now() - self.pg_back_at > 2 * self.args.pg_down
        return True

    async def run(self, deadline: float) -> None:
        lo, hi = self.args.interval
        for role in self.plan():
            if time.monotonic() > deadline:
                log("chaos time is up")
                break
            while not self._may_go_down(role) and time.monotonic() < deadline:
                await asyncio.sleep(0.5)  # --short: the role's previous outage is not over
            await self.kill(role)
            await asyncio.sleep(self.rng.uniform(lo, hi))
        while self._background:
            await asyncio.wait(self._background)

    async def kill(self, role: str) -> None:
        if role == "redis":
            self._spawn(self._redis_outage())
        elif role == "postgres":
            self._spawn(self._pg_outage())
        else:  # one that runs now (not one still down from an earlier kill)
            running = [p for p in self.stack.by_role(role) if p.wanted and p.exited() is None]
            if not running:
                return
            self._spawn(self._process_kill(self.rng.choice(running)))
        self.kills[role] += 1

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _process_kill(self, p: Proc) -> None:
        event = Event(self.now(), p.role, p.name, "sigkill")
        self.events.append(event)
        p.kill()
        await asyncio.sleep(self.rng.uniform(0.1, 2.0))
        p.start()
        event.back_at = self.now()

    async def _redis_outage(self) -> None:
        self.redis_busy = True
        try:
            action = "sigkill"
            if self.rng.random() < 0.5:
                # Right after an AOF rewrite: the restart reloads the group's read counter as it
                # was at the rewrite (the stale-lag case lag() must see through).
                action = "sigkill after aof rewrite"
                with contextlib.suppress(Exception):
                    r = connect(self.stack.settings)
                    await r.bgrewriteaof()
                    await asyncio.sleep(self.rng.uniform(1.0, 3.0))
                    await r.aclose()
            event = Event(self.now(), "redis", "redis", action)
            self.events.append(event)
            self.stack.redis.stop(signal.SIGKILL)
            await asyncio.sleep(self.rng.uniform(0.0, 2.0))
            await asyncio.to_thread(self.stack.redis.start)
            event.back_at = self.redis_back_at = self.now()
        finally:
            self.redis_busy = False

    async def _pg_outage(self) -> None:
        self.pg_busy = True
        try:
            if not self._pg_modes:  # each way in turn, in a random order
                self._pg_modes = ["fast", "immediate", "sigkill postmaster"]
                self.rng.shuffle(self._pg_modes)
            mode = self._pg_modes.pop()
            event = Event(self.now(), "postgres", "postgres", f"stop {mode}")
            self.events.append(event)
            if mode == "sigkill postmaster":
                kill_postmaster(self.stack.pg)
            else:
                await asyncio.to_thread(self.stack.pg.stop, mode)
            await asyncio.sleep(self.args.pg_down)
            await asyncio.to_thread(start_postgres, self.stack.pg)
            event.back_at = self.pg_back_at = self.now()
        finally:
            self.pg_busy = False


# --- settle, recovery, report ----------------------------------------------------------------
async def settle(
    stack: Stack, producer: Producer, redis: Any, limit: float
) -> tuple[bool, float, str]:
    """Wait until every submit is acknowledged, every acknowledged job is terminal and the lag
    is 0 (everything running, no new load). Returns (settled, seconds taken, what is left)."""
    producer.generating = False
    start = time.monotonic()
    done: set[str] = set()  # terminal stays terminal
    left = ""
    while time.monotonic() - start < limit:
        try:
            pending = [i for i in producer.acked.values() if i not in done]
            states = await job_states(redis, stack.keys, pending)
            done.update(i for i, state in states.items() if state in TERMINAL)
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


KINDS = {"redis": "Redis restart", "postgres": "Postgres start", "api": "API restart"}


def recovery(
    events: list[Event],
    t0: float,
    ok_times: list[float],
    lag_samples: list[tuple[float, int]],
    drained: int,
) -> dict[str, dict[str, Any]]:
    """For each event that interrupts service (Redis restart, Postgres start, API restart):
    seconds from the restart until a submit succeeds again and until the lag is back under
    ``drained`` transitions (noted on the event); then the median and max per kind. A Redis or
    API restart whose lag could only drain once a Postgres outage was over is left out of
    the lag figures (that wait is the Postgres outage's, counted under its own start)."""
    outages = [(e.at, e.back_at or float("inf")) for e in events if e.role == "postgres"]
    series: dict[str, dict[str, list[float]]] = {}
    counts: Counter[str] = Counter()
    for e in events:
        if e.back_at is None or e.role not in KINDS:
            continue
        counts[KINDS[e.role]] += 1
        kind = series.setdefault(KINDS[e.role], {"submits": [], "lag": []})
        back = t0 + e.back_at
        ok = next((t for t in ok_times if t >= back), None)
        low = next((t for t, n in lag_samples if t >= back and n <= drained), None)
        if ok is not None:
            e.submits_back = round(ok - back, 3)
            kind["submits"].append(ok - back)
        if low is not None:
            e.lag_drained = round(low - back, 3)
            e.postgres_down_meanwhile = e.role != "postgres" and any(
                start <= low - t0 and end >= e.at for start, end in outages
            )
            if not e.postgres_down_meanwhile:
                kind["lag"].append(low - back)
    summary: dict[str, dict[str, Any]] = {}
    for name, by in series.items():
        summary[name] = {"events": counts[name]}
        for what, values in by.items():
            summary[name][what] = {
                "n": len(values),
                "median": round(statistics.median(values), 2) if values else None,
                "max": round(max(values), 2) if values else None,
            }
    return summary


PERSISTER_EVENTS = (
    "postgres_unavailable", "redis_unavailable", "redis_refused", "batch_failed", "flush_failed",
    "loop_failed",
    "entries_claimed", "dead_consumers_removed",
)  # fmt: skip


def log_counts(stack: Stack) -> dict[str, dict[str, int]]:
    """Per role: tracebacks in its logs other than the flaky task's failures (counted apart);
    for the persisters, their outage and error lines."""
    out: dict[str, Counter[str]] = defaultdict(Counter)
    for p in stack.procs:
        text = p.log_path.read_text(errors="replace") if p.log_path.exists() else ""
        # a worker logs the traceback of every failed attempt (the flaky task's deliberate
        # ChaosFailure among them): only the others can be a crash
        tracebacks = text.count("Traceback (most recent call last)")
        deliberate = text.count("ChaosFailure: attempt ")
        out[p.role]["tracebacks"] += max(tracebacks - deliberate, 0)
        out[p.role]["task_failures"] += deliberate
        if p.role == "persister":
            for event in PERSISTER_EVENTS:
                out[p.role][event] += text.count(f"event={event}")
    return {role: dict(c) for role, c in out.items()}


def report(data: dict[str, Any]) -> str:
    env, res, a = data["environment"], data["results"], data["audit"]
    md = header_markdown("Chaos soak", env)
    md += (
        f"\nChaos for {res['chaos_seconds']:.0f} s, then settled in {res['settle_seconds']:.0f} s"
        f" ({'settled' if res['settled'] else 'NOT settled: ' + res['left']}). Load: "
        f"{data['parameters']['rate']:g} jobs/s submitted over HTTP with idempotency keys "
        "(15 % `flaky`: fail 1-2 attempts, then succeed; of the others 8 % take 50-300 ms, "
        "2 % 0.5-2 s, the rest 0-5 ms). Postgres down "
        f"{data['parameters']['pg_down']:g} s per stop.\n\n"
    )
    kills = res["kills"]
    actions: dict[str, Counter[str]] = defaultdict(Counter)
    for e in data["events"]:
        actions[e["role"]][e["action"]] += 1
    md += (
        "## Kills by role\n\n"
        + table(
            ["role", "kills", "how"],
            [
                [r, str(kills.get(r, 0)), ", ".join(f"{k} x{v}" for k, v in actions[r].items())]
                for r in ROLES
            ]
            + [["total", str(sum(kills.values())), ""]],
        )
        + "\n\n"
    )
    p = res["producer"]
    md += (
        "## Jobs\n\n"
        + table(
            ["what", "count"],
            [
                ["submitted (distinct idempotency keys)", f"{p['submitted']:,}"],
                ["acknowledged", f"{p['acknowledged']:,}"],
                ["submit attempts (retries included)", f"{p['attempts']:,}"],
                [
                    "failed attempts, by reason",
                    ", ".join(f"{k} {v}" for k, v in p["failures"].items()) or "0",
                ],
                ["a key answered with two ids", str(len(p["conflicts"]))],
                [
                    "terminal states",
                    ", ".join(f"{k} {v:,}" for k, v in a["terminal_states"].items()),
                ],
                [
                    "**lost** (acknowledged, in neither Redis nor Postgres)",
                    f"**{a['lost']['count']}**",
                ],
                [
                    "vanished from Redis (only Postgres has it)",
                    str(a["vanished_from_redis"]["count"]),
                ],
                ["not terminal after settling", str(a["not_terminal"]["count"])],
                ["succeeded twice", str(a["double_success"]["count"])],
                [
                    "duplicate executions (claims beyond those failures explain)",
                    f"{a['duplicate_executions']:,}",
                ],
                [
                    "lease expirations (killed workers' attempts taken back)",
                    f"{a['lease_expirations']:,}",
                ],
                [
                    "history rows checked / problems",
                    f"{a['history_rows']:,} / {a['history_problems']['count']}"
                    f" ({a['history_check']})",
                ],
                ["Postgres job rows unlike Redis", str(a["pg_differs"]["count"])],
                ["largest write-behind lag seen (transitions)", f"{res['max_lag_seen']:,}"],
                [
                    "lag() after drain / Redis's own XINFO count",
                    f"{a['lag_after_drain']} / {a['redis_reported_lag']}",
                ],
            ],
        )
        + "\n\n"
    )
    rows = []
    for kind, series in res["recovery"].items():
        s, lg = series["submits"], series["lag"]
        rows.append([
            kind, str(series["events"]),
            f"{s['median']} / {s['max']} ({s['n']})" if s["n"] else "-",
            f"{lg['median']} / {lg['max']} ({lg['n']})" if lg["n"] else "-",
        ])  # fmt: skip
    md += (
        "## Recovery\n\nSeconds from the restart until a submit succeeds again and until the "
        f"write-behind lag is under {res['drained_threshold']} transitions (about a second of "
        "load): median / max (events measured). A Redis or API restart during a Postgres "
        "outage is left out of the lag column: its backlog waits for Postgres, whose start "
        "has its own row.\n\n"
        + table(["event", "count", "submits succeed again", "lag drained"], rows)
        + "\n\n"
    )
    exits: Counter[str] = Counter(e["role"] for e in res["unexpected_exits"])
    md += (
        "## Processes that exited by themselves (restarted by the supervisor)\n\n"
        + table(
            ["role", "exits", "tracebacks in its logs", "the flaky task's failures logged"],
            [
                [
                    r,
                    str(exits.get(r, 0)),
                    str(res["logs"].get(r, {}).get("tracebacks", 0)),
                    str(res["logs"].get(r, {}).get("task_failures", 0)),
                ]
                for r in PROCESS_ROLES
            ],
        )
        + "\n\n"
    )
    verdict = res["violations"]
    md += "## Invariants\n\n" + (
        "All hold: every acknowledged job terminal, none lost, none succeeded twice, history "
        "complete, Postgres equal to Redis, lag 0 once drained, no persister exit.\n"
        if not verdict
        else "**Violated:**\n\n" + "\n".join(f"- {v}" for v in verdict) + "\n"
    )
    return md


# --- main ------------------------------------------------------------------------------------
async def soak(args: argparse.Namespace, stack: Stack) -> dict[str, Any]:
    rng = random.Random(args.seed)
    env = environment()
    redis: Any = None
    pool: Any = None
    producer: Producer | None = None
    tasks: list[asyncio.Task[None]] = []
    try:
        await asyncio.to_thread(stack.start_services)
        stack.start_processes()
        redis = connect(stack.settings)
        async with httpx.AsyncClient(base_url=stack.url) as probe:
            async with asyncio.timeout(120):
                while True:
                    with contextlib.suppress(httpx.HTTPError):
                        if (await probe.get("/readyz")).status_code == 200:
                            break
                    await asyncio.sleep(0.2)
        log(f"stack up: API {stack.url}, Redis {stack.redis.url}, Postgres port {stack.pg.port}")
        stack.t0 = time.monotonic()
        producer = Producer(stack.url, args.rate, rng)
        monitor = LagMonitor(redis, stack.keys)
        driver = Driver(stack, args, rng)
        producer.start()
        tasks = [asyncio.create_task(stack.supervise()), asyncio.create_task(monitor.run())]
        await asyncio.sleep(args.warmup)
        chaos_start = time.monotonic()
        await driver.run(chaos_start + args.duration)
        chaos_seconds = time.monotonic() - chaos_start
        log(f"chaos over: {sum(driver.kills.values())} kills {dict(driver.kills)}; settling")
        settled, settle_seconds, left = await settle(stack, producer, redis, args.settle)
        log(f"settled={settled} in {settle_seconds:.0f} s ({left}); auditing")
        pool = await create_pool(stack.pg.dsn, min_size=1, max_size=2)
        found: Audit = await audit(redis, pool, stack.keys, sorted(producer.acked.values()))
        violations = found.violations()
        if not settled:
            violations.append(f"did not settle within {args.settle:g} s: {left}")
        if producer.conflicts:
            violations.append(f"idempotency keys answered with two ids: {producer.conflicts[:3]}")
        persister_exits = [e for e in stack.exits if e["role"] == "persister"]
        if persister_exits:
            violations.append(f"persisters exited by themselves {len(persister_exits)} times")
        drained = max(100, int(args.rate * 3))  # about a second of transitions
        results = {
            "chaos_seconds": round(chaos_seconds, 1),
            "settle_seconds": round(settle_seconds, 1),
            "settled": settled,
            "left": left,
            "kills": dict(driver.kills),
            "producer": {
                "submitted": len(producer.bodies),
                "acknowledged": len(producer.acked),
                "attempts": producer.attempts,
                "failures": dict(producer.failures.most_common()),
                "conflicts": producer.conflicts,
            },
            "recovery": recovery(
                driver.events, stack.t0, producer.ok_times, monitor.samples, drained
            ),
            "drained_threshold": drained,
            "max_lag_seen": max((n for _, n in monitor.samples), default=0),
            "unexpected_exits": stack.exits,
            "logs": log_counts(stack),
            "violations": violations,
        }
        return {
            "environment": env,
            "parameters": {k: v for k, v in vars(args).items() if k != "out"},
            "results": results,
            "audit": found.summary(),
            "events": [asdict(e) for e in driver.events],
        }
    finally:
        for task in tasks:
            task.cancel()
        if producer is not None:
            await producer.close()
        if pool is not None:
            await pool.close()
        if redis is not None:
            with contextlib.suppress(Exception):
                await redis.aclose()
        await asyncio.to_thread(stack.close, args.keep)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--short",
        action="store_true",
        help="--per-role kills of each role (Redis and Postgres too), Postgres down a few "
        "seconds each time: the run of `make test`",
    )
    p.add_argument("--per-role", type=int, default=3, help="--short: kills of each role (3)")
    p.add_argument(
        "--kills", type=int, default=1000, help="kills in all (not --short; default 1000)"
    )
    p.add_argument("--duration", type=float, default=3600.0, help="most seconds of chaos (3600)")
    p.add_argument(
        "--interval",
        type=float,
        nargs=2,
        default=(0.5, 2.0),
        metavar=("MIN", "MAX"),
        help="seconds between kills, uniform (0.5 2.0)",
    )
    p.add_argument(
        "--pg-down", type=float, default=60.0, help="seconds Postgres stays down per stop (60)"
    )
    p.add_argument("--rate", type=float, default=50.0, help="jobs submitted per second (50)")
    p.add_argument("--shards", type=int, default=16, help="JOBTIER_SHARDS (16)")
    p.add_argument(
        "--warmup", type=float, default=5.0, help="seconds of load before the first kill (5)"
    )
    p.add_argument(
        "--settle", type=float, default=600.0, help="most seconds to settle after the chaos (600)"
    )
    p.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    p.add_argument(
        "--out", type=Path, default=None, help="write chaos.md/.json here instead of bench/results"
    )
    p.add_argument("--keep", action="store_true", help="keep the data and logs folder")
    args = p.parse_args(argv)
    if args.seed is None:
        args.seed = random.randrange(2**31)
    if args.short:
        args.pg_down = min(args.pg_down, 3.0)
        args.interval = (2.0, 4.0)
        args.rate = min(args.rate, 25.0)
        args.settle = min(args.settle, 300.0)
        args.duration = min(args.duration, 240.0)
        args.kills = args.per_role * len(ROLES)
    return args


async def _cancellable(soak: Any) -> dict[str, Any]:
    """Run the soak; SIGTERM or SIGINT (a test's hang guard, Ctrl-C) cancels it, and its
    clean-up runs as for any other way out."""
    task = asyncio.ensure_future(soak)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    result: dict[str, Any] = await task
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="jobtier-chaos-"))
    folder.chmod(0o755)  # Postgres runs as another user when we are root: it must get in
    log(f"seed {args.seed}; data and logs in {folder}")
    stack = Stack(folder, args)
    try:
        data = asyncio.run(_cancellable(soak(args, stack)))
    except (asyncio.CancelledError, KeyboardInterrupt):
        log(f"stopped by a signal; logs kept in {folder / 'logs'}")
        return 2
    except BaseException:
        log(f"aborted; logs kept in {folder / 'logs'}")
        raise
    finally:
        stack.close(args.keep)
    md = report(data)
    print(md)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "chaos.json").write_text(json.dumps(data, indent=2) + "\n")
        (args.out / "chaos.md").write_text(md)
        where = args.out
    else:
        save("chaos", data, md)
        where = HERE / "results"
    violated = data["results"]["violations"]
    if violated or args.keep:
        log(f"logs kept in {folder / 'logs'}")
    else:
        shutil.rmtree(folder, ignore_errors=True)
    log(
        f"results in {where}; "
        + ("VIOLATIONS: " + "; ".join(violated) if violated else "all invariants hold")
    )
    return 1 if violated else 0


if __name__ == "__main__":
    sys.exit(main())
