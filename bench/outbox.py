"""Benchmark: the transactional outbox, commit-to-queued latency at a fixed rate and the
relay's throughput, each against a baseline measured in the same run.

Starts its own Redis (AOF on) and a durable Postgres (fsync on) in temporary folders.

* **latency** (open loop, ``--rate`` jobs a second for ``--seconds``): each job is one
  application transaction (an INSERT into the application's own table, then the job) on a
  pool of plain asyncpg connections. The clock starts as the application sends COMMIT.

  - ``outbox``: the job is ``SELECT jobtier.submit(...)`` in the transaction; the relay runs
    in a process of its own (as in a persister) and stamps each job as its Redis submit
    returns (the job is then claimable: queued): commit-to-queued = that stamp minus the
    start (one machine, one clock).
  - ``after commit`` (the baseline): the job is submitted to Redis by the application right
    after its commit returns (what ``delay_on_commit`` does: no transaction with the job, a
    crash after the commit loses it): commit-to-queued = the submit's return minus the start.

* **throughput**: ``--backlog`` committed outbox rows relayed by one relay (``drain``:
  read, submit, mark, in batches of ``JOBTIER_OUTBOX_BATCH_SIZE``) against the same jobs
  submitted straight into Redis in batches of the same size (``Producer.submit_prepared``):
  what the Postgres side of the relay costs.

Rounds alternate the two sides of each (the machine's load drifts); medians of the rounds.

    .venv/bin/python bench/outbox.py                      # 3 rounds, 1,000/s for 10 s
    .venv/bin/python bench/outbox.py --rounds 1 --seconds 3 --backlog 5000

Results: bench/results/outbox.json and bench/results/outbox.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    environment,
    fmt,
    fresh,
    header_markdown,
    local_redis,
    median,
    percentile,
    save,
    table,
)

from jobtier.config import Settings
from jobtier.core.model import JobSpec
from jobtier.dev.local_postgres import LocalPostgres
from jobtier.engine.produce import Producer
from jobtier.persist.db import create_pool, migrate
from jobtier.persist.outbox import OutboxRelay
from jobtier.store.context import Store

SHARDS = 16
APP_CONNECTIONS = 16
SUBMIT = "SELECT jobtier.submit($1, $2::json)"
POLL = 0.05  # the relay's poll where the application's sessions do not notify
PAYLOAD = '{"order": 1, "email": "someone@example.com"}'


def settings_for(redis_url: str, dsn: str) -> Settings:
    return Settings.from_env({}, redis_url=redis_url, database_url=dsn, shards=SHARDS)


# --- the relay process -----------------------------------------------------------------------
async def relay_child(redis_url: str, dsn: str, out: str, poll: str) -> None:
    """Relay until SIGTERM, stamping each job as its Redis submit returns; the stamps to
    ``out`` (JSON {id: unix time})."""
    settings = settings_for(redis_url, dsn)
    store = await Store.connect(settings)
    pool = await create_pool(dsn, max_size=3)
    stamps: dict[str, float] = {}

    def queued(ids: Any) -> None:
        now = time.time()
        for job_id in ids:
            stamps[job_id] = now

    relay = OutboxRelay(
        settings, pool, Producer(store, None, False, None), after_submit=queued, poll=float(poll)
    )
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, relay.stop)
    print("ready", flush=True)
    await relay.run()
    await asyncio.to_thread(Path(out).write_text, json.dumps(stamps))
    await pool.close()
    await store.close()


# --- latency -------------------------------------------------------------------------------
async def open_loop(rate: float, seconds: float, one: Any) -> tuple[float, int]:
    """Start ``one(i)`` at ``rate`` a second for ``seconds``; (the rate completed: jobs over
    the time until the last finished, late starts: jobs started over 10 ms behind their
    time, which the generator itself could not keep up with)."""
    n = int(rate * seconds)
    start = time.perf_counter()
    tasks = []
    late = 0
    for i in range(n):
        due = start + i / rate
        wait = due - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        elif wait < -0.01:
            late += 1
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    return n / (time.perf_counter() - start), late


async def latency_outbox(
    args: argparse.Namespace, redis_url: str, dsn: str, app: Any, poll: float
) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix="jobtier-bench-outbox-")) / "stamps.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--relay-child", redis_url, dsn, str(out), str(poll),
        stdout=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        assert (await child.stdout.readline()).strip() == b"ready"
        started: dict[str, float] = {}

        async def one(i: int) -> None:
            async with app.acquire() as conn:
                tx = conn.transaction()
                await tx.start()
                await conn.execute("INSERT INTO orders (n) VALUES ($1)", i)
                job_id = await conn.fetchval(SUBMIT, "send_receipt", PAYLOAD)
                started[job_id] = time.time()
                await tx.commit()

        achieved, late = await open_loop(args.rate, args.seconds, one)
        await wait_relayed(dsn)
        child.send_signal(signal.SIGTERM)
        await asyncio.wait_for(child.wait(), 60)
        stamps = json.loads(await asyncio.to_thread(out.read_text))
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
        await asyncio.to_thread(shutil.rmtree, out.parent, True)
    lat = [(stamps[j] - t) * 1000 for j, t in started.items() if j in stamps]
    assert len(lat) == len(started), "a job was not relayed"
    return {"achieved_rate": achieved, "late_starts": late, "latencies_ms": lat}


async def wait_relayed(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        async with asyncio.timeout(120):
            while await conn.fetchval(
                "SELECT count(*) FROM jobtier.outbox WHERE relayed_at IS NULL"
            ):
                await asyncio.sleep(0.05)
    finally:
        await conn.close()


async def latency_after_commit(
    args: argparse.Namespace, producer: Producer, app: Any
) -> dict[str, Any]:
    lat: list[float] = []

    async def one(i: int) -> None:
        async with app.acquire() as conn:
            tx = conn.transaction()
            await tx.start()
            await conn.execute("INSERT INTO orders (n) VALUES ($1)", i)
            started = time.time()
            await tx.commit()
        await producer.submit("send_receipt", {"order": 1, "email": "someone@example.com"})
        lat.append((time.time() - started) * 1000)

    achieved, late = await open_loop(args.rate, args.seconds, one)
    return {"achieved_rate": achieved, "late_starts": late, "latencies_ms": lat}


# --- throughput ------------------------------------------------------------------------------
async def fill_outbox(app: Any, n: int) -> None:
    async with app.acquire() as conn, conn.transaction():
        await conn.execute(
            "SELECT jobtier.submit('send_receipt', $1::json) FROM generate_series(1, $2)",
            PAYLOAD,
            n,
        )


async def throughput_relay(
    settings: Settings, pool: Any, producer: Producer, app: Any, n: int
) -> float:
    await fill_outbox(app, n)
    relay = OutboxRelay(settings, pool, producer)
    started = time.perf_counter()
    assert await relay.drain() == n
    return n / (time.perf_counter() - started)


async def throughput_direct(producer: Producer, n: int, batch: int) -> float:
    spec = JobSpec(type="send_receipt", payload={"order": 1, "email": "someone@example.com"})
    started = time.perf_counter()
    for i in range(0, n, batch):
        items = [producer.prepare(spec, "default") for _ in range(min(batch, n - i))]
        await producer.submit_prepared(items, batch=True)
    return n / (time.perf_counter() - started)


# --- the run ---------------------------------------------------------------------------------
async def bench(args: argparse.Namespace) -> dict[str, Any]:
    env = environment()
    pg = LocalPostgres(Path(tempfile.mkdtemp(prefix="jobtier-bench-pg-")), durable=True)
    got: dict[str, list[Any]] = {
        "outbox": [], "outbox_polling": [], "after_commit": [], "relay": [], "direct": []
    }  # fmt: skip
    with local_redis() as server:
        try:
            pg.start()
            await migrate(pg.dsn)
            settings = settings_for(server.url, pg.dsn)
            store = await Store.connect(settings)
            producer = Producer(store, None, False, None)
            pool = await create_pool(pg.dsn, max_size=4)
            await OutboxRelay(settings, pool, producer).drain()  # records the shard count
            app = await asyncpg.create_pool(
                pg.dsn, min_size=APP_CONNECTIONS, max_size=APP_CONNECTIONS
            )
            # the application's sessions that leave the notification out (jobtier.notify)
            quiet = await asyncpg.create_pool(
                pg.dsn,
                min_size=APP_CONNECTIONS,
                max_size=APP_CONNECTIONS,
                server_settings={"jobtier.notify": "off"},
            )
            await app.execute("CREATE TABLE orders (n int)")
            sides = ["outbox", "outbox_polling", "after_commit"]
            for r in range(args.rounds):
                first = r % 2 == 0
                for side in sides[r % 3 :] + sides[: r % 3]:  # each side first once in 3
                    await fresh(store.redis)
                    if side == "outbox":
                        one = await latency_outbox(args, server.url, pg.dsn, app, 1.0)
                    elif side == "outbox_polling":
                        one = await latency_outbox(args, server.url, pg.dsn, quiet, POLL)
                    else:
                        one = await latency_after_commit(args, producer, app)
                    got[side].append(one)
                    lat = one["latencies_ms"]
                    print(
                        f"round {r + 1} {side}: {one['achieved_rate']:,.0f}/s, commit-to-queued"
                        f" p50 {percentile(lat, 50):.1f} ms p99 {percentile(lat, 99):.1f} ms",
                        flush=True,
                    )
                for side in ("relay", "direct") if first else ("direct", "relay"):
                    await fresh(store.redis)
                    if side == "relay":
                        rate = await throughput_relay(settings, pool, producer, app, args.backlog)
                    else:
                        rate = await throughput_direct(
                            producer, args.backlog, settings.outbox_batch_size
                        )
                    got[side].append(rate)
                    print(f"round {r + 1} {side}: {rate:,.0f} jobs/s", flush=True)
            await app.close()
            await quiet.close()
            await pool.close()
            await store.close()
        finally:
            pg.destroy()
    summary: dict[str, Any] = {}
    for side in ("outbox", "outbox_polling", "after_commit"):
        runs = got[side]
        summary[side] = {
            "jobs_per_round": len(runs[0]["latencies_ms"]),
            "achieved_rate": median([x["achieved_rate"] for x in runs]),
            "late_starts": sum(x["late_starts"] for x in runs),
            **{
                f"p{q}_ms": median([percentile(x["latencies_ms"], q) for x in runs])
                for q in (50, 90, 99)
            },
            "max_ms": median([max(x["latencies_ms"]) for x in runs]),
        }
    for side in ("relay", "direct"):
        summary[side] = {"jobs_per_s": median(got[side]), "rounds": got[side]}
    summary["relay_over_direct"] = median(
        [r / d for r, d in zip(got["relay"], got["direct"], strict=True)]
    )
    # each round's percentiles, not its samples (10K a round: megabytes of JSON in the repo)
    rounds = {
        s: [
            {f"p{q}_ms": round(percentile(x["latencies_ms"], q), 2) for q in (50, 90, 99, 100)}
            | {"achieved_rate": x["achieved_rate"], "late_starts": x["late_starts"]}
            for x in got[s]
        ]
        for s in ("outbox", "outbox_polling", "after_commit")
    }
    return {**env, "arguments": vars(args), "summary": summary, "rounds": rounds}


def report(result: dict[str, Any]) -> str:
    s = result["summary"]
    a = result["arguments"]
    rows = [
        [
            "**outbox** (jobtier.submit in the transaction, relay)",
            *_latency_cells(s["outbox"]),
        ],
        [
            f"outbox, jobtier.notify = off (relay polls every {POLL * 1000:g} ms)",
            *_latency_cells(s["outbox_polling"]),
        ],
        ["after commit (submit to Redis once committed)", *_latency_cells(s["after_commit"])],
    ]
    lat = table(
        ["job", "jobs/round", "completed", "late starts", "p50 ms", "p90 ms", "p99 ms", "max ms"],
        rows,
    )
    thr = table(
        ["path", "jobs/s (median)", "rounds"],
        [
            [
                "**relay** (read, submit, mark)",
                fmt(s["relay"]["jobs_per_s"]),
                ", ".join(fmt(x) for x in s["relay"]["rounds"]),
            ],
            [
                "straight into Redis",
                fmt(s["direct"]["jobs_per_s"]),
                ", ".join(fmt(x) for x in s["direct"]["rounds"]),
            ],
        ],
    )
    o, q, b = s["outbox"], s["outbox_polling"], s["after_commit"]
    return (
        header_markdown("Transactional outbox: commit-to-queued and relay throughput", result)
        + f"\nThe machine is shared: absolute figures move with its load (the load average "
        f"above); each side went first in turn. "
        f"Redis with AOF, Postgres durable (fsync on), {SHARDS} shards, {APP_CONNECTIONS} "
        f"application connections. Medians of {a['rounds']} rounds.\n\n"
        f"## Commit-to-queued at {fmt(float(a['rate']))}/s for {fmt(float(a['seconds']))} s\n\n"
        "Each job is an application transaction (an INSERT of its own, then the job); the "
        "clock starts as the application sends COMMIT and stops as the job is in Redis, "
        "claimable. The relay runs in a process of its own, woken by the commit's "
        "notification. `completed`: the jobs over the time until the last one was queued; below "
        "the rate offered, the machine could not carry the application's transactions (with "
        "fsync) at that rate, and jobs waited for a connection (not counted: the clock starts "
        "at COMMIT). `late starts`: jobs the generator itself started over 10 ms late.\n\n"
        f"{lat}\n\n"
        f"Commit-to-queued through the outbox: p50 {o['p50_ms']:.1f} ms, p99 "
        f"{o['p99_ms']:.1f} ms; a submit made after the commit: p50 {b['p50_ms']:.1f} ms, p99 "
        f"{b['p99_ms']:.1f} ms (ratio at p50 {o['p50_ms'] / b['p50_ms']:.2f}). What the outbox "
        "buys: a rollback never leaves a job, and a crash after the commit never loses one. "
        "The `completed` column is the other cost: Postgres serialises the commits of "
        "transactions that NOTIFY (a lock held through each one's commit), so the notifying "
        f"sessions completed {o['achieved_rate']:,.0f}/s against {q['achieved_rate']:,.0f}/s "
        f"for sessions with `jobtier.notify = off` (p50 {q['p50_ms']:.1f} ms, p99 "
        f"{q['p99_ms']:.1f} ms, the relay polling every {POLL * 1000:g} ms).\n\n"
        f"## Relay throughput: a backlog of {fmt(a['backlog'])} committed rows\n\n"
        f"{thr}\n\n"
        f"The relay moves {s['relay_over_direct']:.2f}x the jobs a second of submits straight "
        "into Redis in batches of the same size; what it adds is its Postgres side (the "
        "locked read and the update marking each batch, one transaction a batch), not timed "
        "apart here.\n"
    )


def _latency_cells(x: dict[str, Any]) -> list[str]:
    return [
        fmt(x["jobs_per_round"]),
        f"{fmt(x['achieved_rate'])}/s",
        fmt(x["late_starts"]),
        *(fmt(x[f"p{q}_ms"], 1) for q in (50, 90, 99)),
        fmt(x["max_ms"], 1),
    ]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--report":  # the page again, from the JSON
        result = json.loads(Path(sys.argv[2]).read_text())
        save("outbox", result, report(result))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--relay-child":
        asyncio.run(relay_child(*sys.argv[2:6]))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rate", type=float, default=1000.0, help="jobs a second (latency)")
    p.add_argument("--seconds", type=float, default=10.0, help="of load per latency round")
    p.add_argument("--backlog", type=int, default=20000, help="rows relayed (throughput)")
    args = p.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    result = asyncio.run(bench(args))
    markdown = report(result)
    print(markdown)
    json_path, md_path = save("outbox", result, markdown)
    print(f"saved {json_path} and {md_path}")


if __name__ == "__main__":
    main()
