"""Every role rides through a Redis master's failover by itself.

The roles run as the real processes (``python -m jobtier.cli`` api, worker, persister,
scheduler (with the flow resolver) and dispatcher; bench/chaos.py's ``Proc``) against a
replicated Redis: the ``failover_cluster`` (3 masters, 3 replicas) or the ``sentinels`` (a
master and its replica). A steady stream of submits, each followed by a read of its status,
goes through the HTTP API while a master is SIGKILLed and its replica promoted. Then:

* no answer was a 5xx other than a 503 with Retry-After;
* on the cluster, the 503s were all for shards of the lost master (a submit's shard is
  known before it is sent: it carries an idempotency key, whose hash names the shard);
* submits to every shard succeed again, and a job submitted then completes;
* every acknowledged job ends terminal, except those Redis lost: acknowledged by the master
  in its last moment and not yet replicated (asynchronous replication), counted and printed;
* no process was restarted, and none logged an internal error.

``FAILOVER_ROUNDS`` (default 1) kills that many masters in turn, each revived as a
replica before the next; every round prints its recovery times (``failover_round`` lines).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis as syncredis
from redis.crc import key_slot

from jobtier.core.keys import Keys
from jobtier.dev.local_redis import LocalRedis, free_port
from jobtier.dev.local_replicas import LocalCluster, LocalSentinels
from tests.fixtures.cluster import settings_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))
chaos: Any = importlib.import_module("chaos")  # bench/chaos.py: its Proc runs a role

API_KEY, TENANT, ADMIN_KEY = "failover-key", "failover", "failover-admin"
TERMINAL = {"succeeded", "failed", "cancelled"}
HANG_GUARD = 120.0  # s: only stops a broken test from hanging
RATE = 40.0  # submits a second (each followed by a status read)


@dataclass
class Answer:
    at: float  # monotonic
    kind: str  # submit | status
    shard: int
    status: int
    retry_after: str | None
    problem: str
    took: float  # seconds


@dataclass
class Load:
    """Submits with idempotency keys at RATE a second, each followed by a read of its
    status, through the HTTP API; every answer recorded with its shard. A submit that was
    not acknowledged is sent again with its key, until it is."""

    url: str
    keys: Keys
    answers: list[Answer] = field(default_factory=list)
    acked: dict[str, str] = field(default_factory=dict)  # idempotency key -> job id
    acked_at: dict[str, float] = field(default_factory=dict)
    errors: Counter[str] = field(default_factory=Counter)  # transport errors by class
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _queue: asyncio.Queue[str] = field(default_factory=asyncio.Queue)
    _running: bool = True

    def client(self) -> httpx.AsyncClient:
        headers = {"authorization": f"Bearer {API_KEY}"}
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=10.0)

    def start(self, senders: int = 8) -> None:
        self._tasks = [asyncio.create_task(self._generate())]
        self._tasks += [asyncio.create_task(self._send()) for _ in range(senders)]

    async def stop(self) -> None:
        self._running = False
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def shard_of_key(self, key: str) -> int:
        return self.keys.shard_for(TENANT, key)

    async def _generate(self) -> None:
        n = 0
        while self._running:
            n += 1
            self._queue.put_nowait(f"fo-{n}")
            await asyncio.sleep(1 / RATE)

    def _record(self, kind: str, shard: int, reply: httpx.Response, began: float) -> None:
        problem = ""
        if reply.status_code >= 400:
            with contextlib.suppress(ValueError):
                problem = str(reply.json().get("type", ""))
        self.answers.append(
            Answer(
                time.monotonic(), kind, shard, reply.status_code,
                reply.headers.get("retry-after"), problem, time.monotonic() - began,
            )
        )  # fmt: skip

    async def _send(self) -> None:
        loop = asyncio.get_running_loop()
        async with self.client() as http:
            while True:
                key = await self._queue.get()
                shard = self.shard_of_key(key)
                began = time.monotonic()
                try:
                    reply = await http.post(
                        "/v1/jobs",
                        json={"type": "noop", "payload": {"ms": 1}, "max_attempts": 10},
                        headers={"idempotency-key": key},
                    )
                    self._record("submit", shard, reply, began)
                    if reply.status_code not in (200, 201, 202):
                        loop.call_later(0.2, self._queue.put_nowait, key)
                        continue
                    job_id = reply.json()["id"]
                    assert self.keys.shard_of(job_id) == shard
                    self.acked.setdefault(key, job_id)
                    self.acked_at.setdefault(key, time.monotonic())
                    began = time.monotonic()
                    self._record("status", shard, await http.get(f"/v1/jobs/{job_id}"), began)
                except httpx.HTTPError as exc:
                    self.errors[type(exc).__name__] += 1
                    loop.call_later(0.2, self._queue.put_nowait, key)

    def first_success(self, shards: set[int], after: float) -> float | None:
        """When a submit to each of ``shards`` had succeeded after ``after`` (None: not yet)."""
        seen: dict[int, float] = {}
        for a in self.answers:
            if a.kind == "submit" and a.at > after and a.status < 300 and a.shard in shards:
                seen.setdefault(a.shard, a.at)
        return max(seen.values()) if set(seen) == shards else None


class Roles:
    """The jobtier processes of one test, each started once."""

    def __init__(self, folder: Path, env: dict[str, str]) -> None:
        logs = folder / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(BENCH), str(ROOT / "src"), str(ROOT)]),
            "JOBTIER_API_KEYS": f"{API_KEY}:{TENANT}",
            "JOBTIER_ADMIN_KEY": ADMIN_KEY,
            "JOBTIER_API_PORT": str(self.port),
            "JOBTIER_LEASE_SECONDS": "5",
            "JOBTIER_PERSIST_CLAIM_IDLE_SECONDS": "5",
            "JOBTIER_LOG_LEVEL": "INFO",
            **env,
        }
        cli = [sys.executable, "-m", "jobtier.cli"]
        worker = ["worker", "chaos_tasks", "--concurrency", "20", "--grace", "2"]
        self.procs = [
            chaos.Proc("api", "api", [*cli, "api"], self.env, logs),
            chaos.Proc("worker", "worker", [*cli, *worker], self.env, logs),
            chaos.Proc("persister", "persister", [*cli, "persister"], self.env, logs),
            # the scheduler runs the flow resolver too
            chaos.Proc("scheduler", "scheduler", [*cli, "scheduler"], self.env, logs),
            chaos.Proc("dispatcher", "dispatcher", [*cli, "dispatcher"], self.env, logs),
        ]

    def start(self) -> None:
        for proc in self.procs:
            proc.start()

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()

    async def wait_ready(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=2.0) as http:
            await wait_for(lambda: _ready(http), "the API is ready")

    def exited(self) -> dict[str, int]:
        return {p.name: p.exited() for p in self.procs if p.exited() is not None}

    def logs(self, name: str) -> str:
        proc = next(p for p in self.procs if p.name == name)
        return str(proc.log_path.read_text(errors="replace"))

    def tails(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.tail(25)}" for p in self.procs)


async def _ready(http: httpx.AsyncClient) -> bool:
    try:
        return (await http.get("/readyz")).status_code == 200
    except httpx.HTTPError:
        return False


async def wait_for(check: Callable[[], Any], what: str, timeout: float = HANG_GUARD) -> None:
    """Until ``check()`` (awaited if need be) is true; the timeout is a hang guard only."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        assert time.monotonic() < deadline, f"gave up waiting: {what}"
        await asyncio.sleep(0.05)


async def states(url: str, ids: list[str]) -> dict[str, str]:
    """Each job's state through the API ('missing' for a 404)."""
    out: dict[str, str] = {}
    async with httpx.AsyncClient(
        base_url=url, headers={"authorization": f"Bearer {API_KEY}"}, timeout=10.0
    ) as http:
        for job_id in ids:
            reply = await http.get(f"/v1/jobs/{job_id}")
            if reply.status_code == 404:
                out[job_id] = "missing"
            elif reply.status_code == 200:
                out[job_id] = reply.json()["state"]
            else:
                out[job_id] = f"HTTP {reply.status_code}"
    return out


async def submit_and_finish(url: str) -> float:
    """Submit one job (again until acknowledged) and wait until it succeeded: the moment."""
    async with httpx.AsyncClient(
        base_url=url, headers={"authorization": f"Bearer {API_KEY}"}, timeout=10.0
    ) as http:
        key = f"probe-{time.monotonic_ns()}"
        job_id = ""

        async def submitted() -> bool:
            nonlocal job_id
            with contextlib.suppress(httpx.HTTPError):
                reply = await http.post(
                    "/v1/jobs", json={"type": "noop", "payload": {}},
                    headers={"idempotency-key": key},
                )  # fmt: skip
                if reply.status_code < 300:
                    job_id = reply.json()["id"]
                    return True
            return False

        await wait_for(submitted, "a probe job is acknowledged")

        async def done() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                reply = await http.get(f"/v1/jobs/{job_id}")
                return reply.status_code == 200 and reply.json()["state"] == "succeeded"
            return False

        await wait_for(done, f"the probe job {job_id} succeeds")
        return time.monotonic()


def shard_masters(cluster: LocalCluster, keys: Keys) -> dict[int, int]:
    """Shard -> the port of the master serving it now."""
    node = cluster.running()[0]
    with syncredis.Redis(port=node.port) as client:
        ranges = client.execute_command("CLUSTER", "SLOTS")
    out = {}
    for shard in range(keys.shards):
        slot = key_slot(keys.base(shard).encode())
        out[shard] = next(int(r[2][1]) for r in ranges if int(r[0]) <= slot <= int(r[1]))
    return out


def check_answers(load: Load, allowed_503: Callable[[Answer], bool]) -> None:
    """No 5xx but a 503 with Retry-After, each allowed."""
    counts = Counter(f"{a.kind} {a.status}" for a in load.answers)
    bad = [a for a in load.answers if a.status >= 500 and (a.status != 503 or not a.retry_after)]
    assert not bad, (bad[:10], counts)
    stray = [a for a in load.answers if a.status == 503 and not allowed_503(a)]
    assert not stray, (stray[:10], counts)


def check_healthy_shards(load: Load, failovers: list[Failover], everywhere: set[int]) -> None:
    """While a master was being replaced, the other masters' shards were served as usual:
    every request answered in that time succeeded, and requests sent after the kill were
    answered before the promotion (they did not wait for the failover to end)."""
    for f in failovers:
        healthy = everywhere - f.shards
        if not healthy:
            continue  # one master serves every shard (sentinels)
        during = [a for a in load.answers if f.killed_at <= a.at <= f.promoted_at]
        served = [a for a in during if a.shard in healthy]
        assert served, "no request for the other masters' shards during the failover"
        assert all(a.status < 300 for a in served), Counter(a.status for a in served)
        sent_after_kill = [a for a in served if a.at - a.took > f.killed_at]
        assert sent_after_kill, (
            "no request for a healthy shard sent after the kill was answered before the "
            "promotion: they waited for the failover",
            len(served),
        )


async def settle(load: Load, url: str, killed_at: float) -> dict[str, Any]:
    """Every acknowledged job terminal, but those Redis lost (acknowledged before a kill
    and not replicated): waited for, then counted."""
    ids = list(load.acked.values())

    async def all_settled() -> bool:
        found = await states(url, ids)
        return all(s in TERMINAL or s == "missing" for s in found.values())

    await wait_for(all_settled, "every acknowledged job is terminal")
    found = await states(url, ids)
    lost = [k for k, job_id in load.acked.items() if found[job_id] == "missing"]
    after = [k for k in lost if load.acked_at[k] > killed_at]
    return {"acknowledged": len(ids), "lost": len(lost), "lost_acked_after_kill": len(after)}


@dataclass
class Failover:
    """One master's failover, as a test's ``kill`` made it."""

    killed_at: float
    promoted_at: float
    shards: set[int]  # the shards the lost master served
    revive: Callable[[], None]


async def ride(roles: Roles, keys: Keys, setup: str, kill: Callable[[], Failover]) -> None:
    """The roles under load through ``FAILOVER_ROUNDS`` failovers (``kill``), then
    every check of the module docstring."""
    rounds = int(os.environ.get("FAILOVER_ROUNDS", "1"))
    failovers: list[Failover] = []
    roles.start()
    load: Load | None = None
    try:
        await roles.wait_ready()
        load = Load(roles.url, keys)
        load.start()
        await wait_for(lambda: len(load.acked) >= 40, "the load is flowing")
        everywhere = set(range(keys.shards))
        for _ in range(rounds):
            failover = await asyncio.to_thread(kill)
            failovers.append(failover)
            killed_at = failover.killed_at

            def back(shards: set[int] = failover.shards, after: float = killed_at) -> bool:
                return load.first_success(shards, after) is not None

            await wait_for(back, "submits to the lost master's shards succeed again")
            resumed = load.first_success(failover.shards, killed_at)
            assert resumed is not None

            def everywhere_back(after: float = failover.promoted_at) -> bool:
                return load.first_success(everywhere, after) is not None

            await wait_for(everywhere_back, "submits to every shard succeed after the promotion")
            completed = await submit_and_finish(roles.url)
            figures = {
                "setup": setup,
                "promoted_s": round(failover.promoted_at - killed_at, 2),
                "submits_back_s": round(resumed - killed_at, 2),
                "job_completed_s": round(completed - killed_at, 2),
            }
            print("failover_round", json.dumps(figures))
            await asyncio.to_thread(failover.revive)
        acked = len(load.acked)
        await wait_for(lambda: len(load.acked) >= acked + 20, "the load goes on")
        await load.stop()
        outcome = await settle(load, roles.url, failovers[0].killed_at)
        # no role was restarted: each still runs its first start
        assert roles.exited() == {}, roles.tails()
        assert all(p.starts == 1 for p in roles.procs)
    finally:
        if load is not None:
            await load.stop()
        roles.stop()

    def allowed(a: Answer) -> bool:
        # a 503 only for a shard of the master being lost, until a second after its
        # replica's promotion (the sentinels' clients find the new master on their own)
        return any(
            f.killed_at <= a.at <= f.promoted_at + 1.0 and a.shard in f.shards for f in failovers
        )

    counts = Counter(f"{a.kind} {a.status}" for a in load.answers)
    print("failover_outcome", json.dumps({"setup": setup, **outcome, **counts}))
    check_answers(load, allowed)
    check_healthy_shards(load, failovers, everywhere=set(range(keys.shards)))
    for proc in roles.procs:
        text = roles.logs(proc.name)
        assert "event=internal_error" not in text, text[-6000:]
        assert "Traceback" not in text, text[-6000:]


async def test_every_role_rides_through_a_cluster_master_failover(
    failover_cluster: LocalCluster, pg_dsn: str, tmp_path: Path
) -> None:
    keys = Keys("jt", 16)
    env = {
        "JOBTIER_REDIS_URL": failover_cluster.url,
        "JOBTIER_REDIS_CLUSTER": "1",
        "JOBTIER_SHARDS": str(keys.shards),
        "JOBTIER_DATABASE_URL": pg_dsn,
    }

    def kill() -> Failover:
        owners = shard_masters(failover_cluster, keys)
        victim = next(m for m in failover_cluster.masters() if m.port == owners[0])
        killed_at = time.monotonic()
        failover_cluster.kill(victim)
        failover_cluster.wait_promoted(victim)
        promoted_at = time.monotonic()

        def revive() -> None:
            failover_cluster.revive(victim)
            failover_cluster.wait_replicated()

        shards = {s for s, port in owners.items() if port == victim.port}
        return Failover(killed_at, promoted_at, shards, revive)

    await ride(Roles(tmp_path, env), keys, "cluster", kill)


async def test_every_role_rides_through_a_sentinel_failover(
    sentinels: LocalSentinels, pg_dsn: str, tmp_path: Path
) -> None:
    keys = Keys("jt", 4)
    env = {
        "JOBTIER_REDIS_URL": settings_for(sentinels).redis_url,  # as jobtier's user
        "JOBTIER_REDIS_SENTINELS": sentinels.addresses,
        "JOBTIER_REDIS_SENTINEL_MASTER": sentinels.name,
        "JOBTIER_SHARDS": str(keys.shards),
        "JOBTIER_DATABASE_URL": pg_dsn,
    }

    def kill() -> Failover:
        victim: LocalRedis = sentinels.master()
        killed_at = time.monotonic()
        sentinels.kill(victim)
        sentinels.wait_promoted(victim)
        promoted_at = time.monotonic()

        def revive() -> None:
            sentinels.revive(victim)
            sentinels.wait_replicated()

        # one master serves every shard
        return Failover(killed_at, promoted_at, set(range(keys.shards)), revive)

    await ride(Roles(tmp_path, env), keys, "sentinel", kill)
